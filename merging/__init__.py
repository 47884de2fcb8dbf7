"""Parameter-space merging."""
