"""The sans-IO wire core: the standard library only, no sockets, no asyncio, time passed in."""
