"""One proxied request: the driver loop, the attempt, departures, forwarding."""
