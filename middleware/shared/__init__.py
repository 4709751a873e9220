"""What every driver of the core shares: the driver helpers and the replay stores."""
