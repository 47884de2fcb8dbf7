"""lm-evaluation-harness: the `composed` lm-eval model and `mergecompose lm-eval` (the `lm-eval` extra)."""
