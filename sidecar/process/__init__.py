"""The process: server, workers, acceptor, listener, TLS, admin port, metrics."""
