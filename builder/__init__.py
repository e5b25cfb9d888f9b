"""machgen."""
