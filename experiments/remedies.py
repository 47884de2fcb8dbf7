"""Remedy sets of a compare config: each named set (`mergecompose.composition.remedies.RemedySettings`) is a system `compose+<name>`."""

from __future__ import annotations


def remedy_system_name(name: str) -> str:
    return f"compose+{name}"
