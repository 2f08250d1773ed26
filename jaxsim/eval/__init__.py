"""STS evaluation: the SimCSE protocol, calibrations, diagnostics, reports."""
from jaxsim.eval.sts import (
    AGGREGATES,
    CachedEncoder,
    StsResult,
    TaskScore,
    evaluate,
    evaluate_rows,
    spearman_x100,
    stsb_dev_score,
)

__all__ = [
    'AGGREGATES', 'CachedEncoder', 'StsResult', 'TaskScore', 'evaluate', 'evaluate_rows',
    'spearman_x100', 'stsb_dev_score',
]
