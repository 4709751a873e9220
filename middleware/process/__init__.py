"""Process plumbing: config layers, logs, tracing, metrics, the compiled-module list."""
