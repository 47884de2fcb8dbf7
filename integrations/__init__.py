"""Integrations with other tools; each subpackage needs its optional extra and is imported by nothing below it."""
