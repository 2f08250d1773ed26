"""STS evaluation: metrics, the SimCSE protocol and its fit sets, the runner, reports."""
from jaxsim.eval.embeddings import CachedEncoder
from jaxsim.eval.metrics import AGGREGATES, TaskScore, spearman_x100
from jaxsim.eval.protocol import StsResult
from jaxsim.eval.runner import evaluate, evaluate_rows, stsb_score

__all__ = [
    'AGGREGATES', 'CachedEncoder', 'StsResult', 'TaskScore', 'evaluate', 'evaluate_rows',
    'spearman_x100', 'stsb_score',
]
