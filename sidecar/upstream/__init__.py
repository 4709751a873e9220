"""The engine side: the pod set and membership, probes, the attempt, the own HTTP/1.1 client."""
