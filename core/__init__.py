"""The ground floor: atomic io and locks, model and adapter sources, shared CLI flags, tiny test models, training."""
