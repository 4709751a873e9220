"""The ASGI driver: the wire core in front of any ASGI app."""
