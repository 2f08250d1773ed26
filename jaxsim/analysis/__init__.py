"""Analyses of a model beyond its scores: BERT-flow's frequency analysis of the token embeddings
(frequency.py), and the same after calibrations, with sentence-level diagnostics
(frequency_post.py); `python -m jaxsim analyze` runs them (jaxsim/cli/analyze.py)."""
