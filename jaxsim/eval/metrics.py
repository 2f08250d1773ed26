"""STS scores: cosine similarity, Spearman x100, and the aggregations over subsets.

As SentEval computes them (facebookresearch/SentEval `senteval/sts.py`) and SimCSE reports
them (princeton-nlp/SimCSE `evaluation.py`):
  - a pair's score is the cosine similarity of its two sentence vectors;
  - a subset's score is Spearman's rank correlation x100 against gold (ties: average ranks);
  - a task of several subsets (STS12-16) aggregates them three ways:
      all   - Spearman on the concatenation of all subsets (SimCSE's number);
      mean  - the unweighted mean of subset Spearmans (SentEval's "mean");
      wmean - the mean weighted by subset size (BERT-flow / BERT-whitening's number).
These differ by up to ~20 points on single tasks, so every score carries all three.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from jaxsim.errors import JaxsimError

AGGREGATES = ('all', 'mean', 'wmean')
AGGREGATE_DOC = {
    'all': 'STS12-16 scored on the concatenation of their subsets (SimCSE)',
    'mean': 'STS12-16 as the unweighted mean over subsets',
    'wmean': 'STS12-16 as the mean over subsets weighted by size (BERT-flow / BERT-whitening)',
}


class MetricError(JaxsimError):
    """Scores that cannot be computed (shapes, NaN, zero vectors, constant gold)."""


def cosine_rows(emb1, emb2) -> np.ndarray:
    """Row-wise cosine similarity of two [N, D] arrays: [N] float64."""
    a = np.asarray(emb1, np.float64)
    b = np.asarray(emb2, np.float64)
    if a.shape != b.shape or a.ndim != 2:
        raise MetricError(
            f'cosine: expected two [N, D] arrays of one shape, got {a.shape}, {b.shape}')
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise MetricError('cosine: embeddings contain NaN or inf')
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    zero = np.flatnonzero((na == 0) | (nb == 0))
    if zero.size:
        raise MetricError(f'cosine: {zero.size} pairs have a zero vector (first: pair {zero[0]})')
    return np.einsum('nd,nd->n', a, b) / (na * nb)


def _correlation_x100(statistic: str, scores, gold) -> float:
    """scipy.stats.<statistic> x100 of system scores against gold."""
    scores, gold = np.asarray(scores, np.float64), np.asarray(gold, np.float64)
    if gold.shape != scores.shape:
        raise MetricError(f'{scores.shape[0]} similarities but {gold.shape} gold scores')
    if scores.shape[0] < 2:
        raise MetricError('a correlation needs at least 2 pairs')
    if np.ptp(gold) == 0:
        raise MetricError('gold scores are all equal: the correlation is undefined')
    if np.ptp(scores) == 0:
        return 0.0  # A constant system carries no ranking information.
    import scipy.stats  # on first use: it slows every command's start-up otherwise
    return float(getattr(scipy.stats, statistic)(scores, gold).statistic * 100.0)


def spearman_of_scores_x100(scores, gold) -> float:
    """Spearman x100 of system scores against gold (ties get average ranks, as scipy)."""
    return _correlation_x100('spearmanr', scores, gold)


def pearson_of_scores_x100(scores, gold) -> float:
    """Pearson x100 of system scores against gold."""
    return _correlation_x100('pearsonr', scores, gold)


def spearman_x100(emb1, emb2, gold) -> float:
    """The SimCSE score of one pair set: cosine similarity, then Spearman x100 against gold."""
    return spearman_of_scores_x100(cosine_rows(emb1, emb2), gold)


def pearson_x100(emb1, emb2, gold) -> float:
    return pearson_of_scores_x100(cosine_rows(emb1, emb2), gold)


@dataclasses.dataclass(frozen=True)
class SubsetScore:
    n: int
    spearman: float
    pearson: float


@dataclasses.dataclass(frozen=True)
class TaskScore:
    """One task's scores under every aggregation (Spearman x100 unless named pearson): its
    canonical key ('STS12', 'STSBenchmark', ...), the number of pairs scored, all / mean /
    wmean (see the module docstring), Pearson on the concatenation, per-subset scores."""

    name: str
    n: int
    all: float
    mean: float
    wmean: float
    pearson_all: float
    subsets: dict[str, SubsetScore]

    def get(self, aggregate: str) -> float:
        check_aggregate(aggregate)
        return getattr(self, aggregate)

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != 'name'}


def check_aggregate(aggregate: str) -> None:
    if aggregate not in AGGREGATES:
        raise MetricError(f'aggregate must be one of {AGGREGATES}, got {aggregate!r}')


def task_score(name: str, subsets: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> TaskScore:
    """Scores task `name` under every aggregation from subset name -> (cosines [n], gold [n])."""
    if not subsets:
        raise MetricError(f'{name}: no subsets to score')
    scored = {}
    for sub, (sims, gold) in subsets.items():
        try:
            scored[sub] = SubsetScore(len(gold), spearman_of_scores_x100(sims, gold),
                                      pearson_of_scores_x100(sims, gold))
        except MetricError as e:
            raise MetricError(f'{name} subset {sub}: {e}') from None
    sims = np.concatenate([np.asarray(s, np.float64) for s, _ in subsets.values()])
    golds = np.concatenate([np.asarray(g, np.float64) for _, g in subsets.values()])
    sizes = np.array([v.n for v in scored.values()], np.float64)
    sps = np.array([v.spearman for v in scored.values()])
    return TaskScore(
        name=name, n=int(sizes.sum()),
        all=spearman_of_scores_x100(sims, golds),
        mean=float(sps.mean()),
        wmean=float((sps * sizes).sum() / sizes.sum()),
        pearson_all=pearson_of_scores_x100(sims, golds),
        subsets=scored,
    )


def mean_task_score(scores: Sequence[TaskScore]) -> TaskScore:
    """The field-wise mean of one task's scores over repeated fits (e.g. seeds)."""
    if not scores:
        raise MetricError('no scores to average')
    first = scores[0]
    avg = lambda get: float(np.mean([get(s) for s in scores]))  # noqa: E731
    subsets = {k: SubsetScore(v.n, avg(lambda s: s.subsets[k].spearman),
                              avg(lambda s: s.subsets[k].pearson))
               for k, v in first.subsets.items()}
    return TaskScore(first.name, first.n, avg(lambda s: s.all), avg(lambda s: s.mean),
                     avg(lambda s: s.wmean), avg(lambda s: s.pearson_all), subsets)
