"""Training objectives (pure functions of embeddings)."""
