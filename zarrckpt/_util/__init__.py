"""General helpers that know nothing of checkpoints."""
