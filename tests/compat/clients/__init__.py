"""Real clients through both drivers, compared with the same clients reading the upstream directly."""
