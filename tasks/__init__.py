"""Synthetic tasks: letter replacement, its training and `mergecompose compare`."""
