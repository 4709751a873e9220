"""What tests and benches both start: the fake engine and pods, the sidecar and nginx targets."""
