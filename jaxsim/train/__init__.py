"""SimCSE-style contrastive training of a SentenceEncoder (its modules: docs/layout.md).

This package file imports nothing, so the three config modules load without the training stack.
"""
