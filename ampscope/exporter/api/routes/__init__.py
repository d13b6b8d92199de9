"""HTTP routes, one router per concern; each owns its prefix and tags."""
