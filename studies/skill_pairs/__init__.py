"""Real settings on SmolLM2: one-skill LoRA experts, pairs of them, and the merge-or-compose outcome of each."""
