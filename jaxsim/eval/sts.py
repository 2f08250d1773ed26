"""The SimCSE STS evaluation protocol.

Exactly as SimCSE's `evaluation.py` over SentEval (princeton-nlp/SimCSE):
  - a pair's score is the cosine similarity of its two sentence vectors;
  - a task's score is Spearman's rank correlation x100 against gold;
  - STS12-16 are scored on the concatenation of all their subsets (SentEval's "all");
    STS-B and SICK-R on their test split; "Avg." averages over the tasks run.

BERT-flow and BERT-whitening report "wmean" (per-subset Spearman averaged weighted by subset
size) and SentEval also prints "mean"; these differ from "all" by up to ~20 points on single
tasks, so every result carries all three and always says which one it shows.

Encoding is the expensive part: sentences are de-duplicated across tasks and encoded once;
calibrations (whitening, SN, NATSV, flow) are row-wise maps applied to the unique-sentence
matrix, so several `--post` values share one encoding.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, Union

import numpy as np
import scipy.stats

from jaxsim import calibration
from jaxsim.data import senteval
from jaxsim.data.senteval import StsTask

AGGREGATES = ('all', 'mean', 'wmean')
AGGREGATE_DOC = {
    'all': 'STS12-16 scored on the concatenation of their subsets (SimCSE)',
    'mean': 'STS12-16 as the unweighted mean over subsets',
    'wmean': 'STS12-16 as the mean over subsets weighted by size (BERT-flow / BERT-whitening)',
}
# Positive pairs for alignment: STS-B pairs with gold > 4 (SimCSE, Sec. 3 / Fig. 2).
ALIGN_GOLD_THRESHOLD = 4.0

EncodeFn = Callable[[list[str]], np.ndarray]


# ---------------------------------------------------------------------------------------
# Scores.
# ---------------------------------------------------------------------------------------


def cosine_rows(emb1, emb2) -> np.ndarray:
    """Row-wise cosine similarity.

    Args:
      emb1: [N, D] vectors.
      emb2: [N, D] vectors.

    Returns:
      [N] float64 cosines.
    """
    a = np.asarray(emb1, np.float64)
    b = np.asarray(emb2, np.float64)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(
            f'cosine: expected two [N, D] arrays of one shape, got {a.shape}, {b.shape}')
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError('cosine: embeddings contain NaN or inf')
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    zero = np.flatnonzero((na == 0) | (nb == 0))
    if zero.size:
        raise ValueError(f'cosine: {zero.size} pairs have a zero vector (first: pair {zero[0]})')
    return np.einsum('nd,nd->n', a, b) / (na * nb)


def _check_gold(scores: np.ndarray, gold) -> np.ndarray:
    gold = np.asarray(gold, np.float64)
    if gold.shape != scores.shape:
        raise ValueError(f'{scores.shape[0]} similarities but {gold.shape} gold scores')
    if scores.shape[0] < 2:
        raise ValueError('a correlation needs at least 2 pairs')
    if np.ptp(gold) == 0:
        raise ValueError('gold scores are all equal: the correlation is undefined')
    return gold


def spearman_of_scores_x100(scores, gold) -> float:
    """Spearman x100 of system scores against gold (ties get average ranks, as scipy)."""
    scores = np.asarray(scores, np.float64)
    gold = _check_gold(scores, gold)
    if np.ptp(scores) == 0:
        return 0.0  # A constant system carries no ranking information.
    return float(scipy.stats.spearmanr(scores, gold).statistic * 100.0)


def spearman_x100(emb1, emb2, gold) -> float:
    """The SimCSE score of one pair set: cosine similarity, then Spearman x100 against gold."""
    return spearman_of_scores_x100(cosine_rows(emb1, emb2), gold)


def pearson_x100(emb1, emb2, gold) -> float:
    scores = cosine_rows(emb1, emb2)
    gold = _check_gold(scores, gold)
    if np.ptp(scores) == 0:
        return 0.0
    return float(scipy.stats.pearsonr(scores, gold).statistic * 100.0)


@dataclasses.dataclass(frozen=True)
class SubsetScore:
    n: int
    spearman: float
    pearson: float


@dataclasses.dataclass(frozen=True)
class TaskScore:
    """One task's scores under every aggregation (Spearman x100 unless named pearson).

    Attributes:
      name: canonical key ('STS12', 'STSBenchmark', ...).
      n: number of pairs scored.
      all: Spearman on the concatenation of all subsets (the SimCSE number).
      mean: unweighted mean of subset Spearmans.
      wmean: subset Spearmans weighted by subset size.
      pearson_all: Pearson on the concatenation.
      subsets: per-subset scores.
    """

    name: str
    n: int
    all: float
    mean: float
    wmean: float
    pearson_all: float
    subsets: dict[str, SubsetScore]

    def get(self, aggregate: str) -> float:
        if aggregate not in AGGREGATES:
            raise ValueError(f'aggregate must be one of {AGGREGATES}, got {aggregate!r}')
        return getattr(self, aggregate)

    def to_dict(self) -> dict:
        return {
            'n': self.n, 'all': self.all, 'mean': self.mean, 'wmean': self.wmean,
            'pearson_all': self.pearson_all,
            'subsets': {k: dataclasses.asdict(v) for k, v in self.subsets.items()},
        }


def score_task(task: StsTask, vectors: Callable[[list[str]], np.ndarray]) -> TaskScore:
    """Scores one task given a sentence -> vector lookup.

    Args:
      task: the loaded task.
      vectors: maps a list of N sentences to [N, D] vectors.

    Returns:
      The task's scores.
    """
    sims, golds, subsets = [], [], {}
    for name, pairs in task.subsets.items():
        s = cosine_rows(vectors(pairs.sent1), vectors(pairs.sent2))
        try:
            sp = spearman_of_scores_x100(s, pairs.gold)
            pe = (float(scipy.stats.pearsonr(s, pairs.gold).statistic * 100.0)
                  if np.ptp(s) > 0 else 0.0)
        except ValueError as e:
            raise ValueError(f'{task.name} subset {name}: {e}') from None
        subsets[name] = SubsetScore(len(pairs), sp, pe)
        sims.append(s)
        golds.append(pairs.gold)
    sims, golds = np.concatenate(sims), np.concatenate(golds)
    sizes = np.array([v.n for v in subsets.values()], np.float64)
    sps = np.array([v.spearman for v in subsets.values()])
    return TaskScore(
        name=task.name, n=int(sizes.sum()),
        all=spearman_of_scores_x100(sims, golds),
        mean=float(sps.mean()),
        wmean=float((sps * sizes).sum() / sizes.sum()),
        pearson_all=(float(scipy.stats.pearsonr(sims, golds).statistic * 100.0)
                     if np.ptp(sims) > 0 else 0.0),
        subsets=subsets,
    )


# ---------------------------------------------------------------------------------------
# Embeddings: encode each unique sentence once.
# ---------------------------------------------------------------------------------------


class CachedEncoder:
    """Wraps an `encode_fn` so each distinct text is encoded once.

    One instance belongs to one (model, pooler, max_length): the cache key is the text.
    `seconds` accumulates the time spent inside `encode_fn`.
    """

    def __init__(self, encode_fn: EncodeFn):
        self._encode_fn = encode_fn
        self._cache: dict[str, np.ndarray] = {}
        self.seconds = 0.0
        self.num_encoded = 0

    def __call__(self, sentences: Sequence[str]) -> np.ndarray:
        sentences = list(sentences)
        todo = list(dict.fromkeys(s for s in sentences if s not in self._cache))
        if todo:
            t0 = time.perf_counter()
            out = np.asarray(self._encode_fn(todo), np.float32)
            self.seconds += time.perf_counter() - t0
            if out.ndim != 2 or out.shape[0] != len(todo):
                raise ValueError(
                    f'encode_fn returned shape {out.shape} for {len(todo)} sentences')
            if not np.isfinite(out).all():
                bad = int(np.flatnonzero(~np.isfinite(out).all(axis=1))[0])
                raise ValueError(f'encode_fn returned NaN/inf for sentence {todo[bad]!r:.80}')
            self._cache.update(zip(todo, out))
            self.num_encoded += len(todo)
        if not sentences:
            return np.zeros((0, 0), np.float32)
        return np.stack([self._cache[s] for s in sentences])


@dataclasses.dataclass(frozen=True)
class EmbeddingTable:
    """Unique sentences and their vectors: `matrix[index[text]]`.

    Attributes:
      index: text -> row.
      matrix: [U, D] vectors.
    """

    index: dict[str, int]
    matrix: np.ndarray

    @classmethod
    def build(cls, encoder: EncodeFn, sentences: Sequence[str]) -> 'EmbeddingTable':
        unique = list(dict.fromkeys(sentences))
        return cls({s: i for i, s in enumerate(unique)}, np.asarray(encoder(unique)))

    def rows(self, sentences: Sequence[str]) -> np.ndarray:
        return np.asarray([self.index[s] for s in sentences], np.int64)

    def lookup(self, sentences: Sequence[str]) -> np.ndarray:
        return self.matrix[self.rows(sentences)]

    def replace(self, matrix: np.ndarray) -> 'EmbeddingTable':
        return EmbeddingTable(self.index, np.asarray(matrix))


def task_sentences(tasks: Sequence[StsTask]) -> list[str]:
    """All sentences of all pairs, both sides, duplicates kept (the "target" fit set)."""
    out = []
    for t in tasks:
        for p in t.subsets.values():
            out.extend(p.sent1)
            out.extend(p.sent2)
    return out


# ---------------------------------------------------------------------------------------
# Calibrations applied to a table.
# ---------------------------------------------------------------------------------------


def _fit_apply(post: str, fit_x: np.ndarray, x: np.ndarray, flow_checkpoint=None,
               eps: float = 0.0, flow_config=None):
    """Fits `post` on fit_x [M, D] and applies it to x [U, D]; returns (y, fitted object)."""
    kind, _ = calibration.parse_post(post)
    if kind == 'none':
        return x, None
    if kind == 'flow':
        try:
            from jaxsim.flows import calibration as flow_calibration
        except ImportError as e:
            raise RuntimeError(
                f'--post flow needs jaxsim.flows.calibration (the flow issue), which failed to '
                f'import: {e}') from None
        if flow_checkpoint is not None:
            fc = flow_calibration.load_flow(flow_checkpoint)
        else:
            fc = flow_calibration.fit_flow_calibration(np.asarray(fit_x, np.float32),
                                                      config=flow_config, seed=0)
        return np.asarray(fc.apply(np.asarray(x, np.float32)), np.float64), fc
    w = calibration.fit_post(post, fit_x, eps=eps)
    return np.asarray(calibration.apply_whitening(w, np.asarray(x, np.float64))), w


def _fit_notes(fitted, where: str, verbose: bool) -> list[str]:
    note = getattr(fitted, 'note', '')
    if not note:
        return []
    if verbose:
        print(f'note: [{where}] {note}', file=sys.stderr)
    return [f'[{where}] {note}']


# ---------------------------------------------------------------------------------------
# Results.
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StsResult:
    """One row of the results table: one model, pooler and calibration.

    Attributes:
      model: the model's name or path.
      pooler: the pooler used.
      post: the `--post` value ('none', 'whitening:256', ...).
      aggregate: which aggregation `tasks` and `avg` show.
      split: 'test' (the protocol) or 'dev'.
      scores: task key -> all its scores.
      details: everything else for the JSON (fit set, diagnostics, file hashes, timing).
    """

    model: str
    pooler: str
    post: str
    aggregate: str
    split: str
    scores: dict[str, TaskScore]
    details: dict[str, Any]

    @property
    def label(self) -> str:
        return calibration.post_label(self.post)

    @property
    def tasks(self) -> dict[str, float]:
        return {k: v.get(self.aggregate) for k, v in self.scores.items()}

    def avg_of(self, aggregate: str) -> float:
        return float(np.mean([v.get(aggregate) for v in self.scores.values()]))

    @property
    def avg(self) -> float:
        return self.avg_of(self.aggregate)


def load_tasks(tasks: Union[str, Sequence[Union[str, StsTask]]],
               roots, split: str = 'test', verbose: bool = True) -> list[StsTask]:
    """Loads task names (a list or a comma-separated string); StsTask items pass through."""
    if isinstance(tasks, str):
        tasks = [t for t in tasks.split(',') if t.strip()]
    if not tasks:
        raise ValueError('no tasks given')
    out = []
    for t in tasks:
        if isinstance(t, StsTask):
            out.append(t)
        else:
            out.append(senteval.load_sts_task(t.strip(), roots, split=split, verbose=verbose))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise ValueError(f'a task is listed twice: {names}')
    # Report in the paper's column order whatever the order asked.
    order = list(senteval.TASK_KEYS.values())
    return sorted(out, key=lambda t: order.index(t.name) if t.name in order else len(order))


def evaluate_rows(encode_fn: EncodeFn, tasks, roots=None, *, posts: Sequence[str] = ('none',),
                  split: str = 'test', aggregate: str = 'all', fit_on: str = 'target',
                  flow_checkpoint=None, eps: float = 0.0, diagnostics: bool = True,
                  flow_config=None, model: str = '', pooler: str = '', verbose: bool = True,
                  extra_details: Optional[Mapping[str, Any]] = None) -> list[StsResult]:
    """Evaluates one encoder under several calibrations, encoding each sentence once.

    Args:
      encode_fn: list of N sentences -> [N, D] vectors; must be deterministic (no dropout).
        Wrap it in `CachedEncoder` to share encodings across calls.
      tasks: task names (sts12..sts16, stsb, sickr), a comma string, or loaded StsTasks.
      roots: data root(s) for task names.
      posts: `--post` values, one result row each.
      split: 'test' (the protocol) or 'dev' (STS-B dev, SICK trial).
      aggregate: 'all' | 'mean' | 'wmean', what `StsResult.tasks` / `.avg` show.
      fit_on: 'target' (all sentences of all evaluated tasks), 'task' (each task's own
        sentences), or a corpus file path (one sentence a line).
      flow_checkpoint: a saved flow directory for `--post flow` (else one is fitted).
      flow_config: the FlowConfig to fit for `--post flow` (default: the reference Glow).
      eps: covariance regularizer for whitening / SN (0: reject degenerate fits).
      diagnostics: compute alignment / uniformity / anisotropy / spectrum per row.
      model, pooler: recorded in the results.
      verbose: print notes to stderr.
      extra_details: merged into every row's details.

    Returns:
      One `StsResult` per post, in order.
    """
    from jaxsim.eval import diagnostics as diag  # Local: keeps `sts` importable alone.

    if aggregate not in AGGREGATES:
        raise ValueError(f'aggregate must be one of {AGGREGATES}, got {aggregate!r}')
    for p in posts:
        calibration.parse_post(p)  # Fail on a bad --post before encoding anything.
    t_start = time.perf_counter()
    task_list = load_tasks(tasks, roots, split=split, verbose=verbose)
    encoder = encode_fn if isinstance(encode_fn, CachedEncoder) else CachedEncoder(encode_fn)
    seconds_before = encoder.seconds

    sentences = task_sentences(task_list)
    corpus = None
    if fit_on not in ('target', 'task'):
        corpus = senteval.load_sentences(fit_on)
    t_load = time.perf_counter()
    table = EmbeddingTable.build(encoder, sentences + (corpus or []))

    notes = [n for t in task_list for n in t.notes]
    files = dict(senteval.task_files(task_list))
    if corpus is not None:
        files[str(fit_on)] = senteval.file_hash(fit_on)
    stsb = next((t for t in task_list if t.name == 'STSBenchmark'), None)
    eval_rows = table.rows(list(dict.fromkeys(sentences)))  # unique evaluated sentences

    results = []
    for post in posts:
        t_post = time.perf_counter()
        kind, _ = calibration.parse_post(post)
        per_task_tables: dict[str, EmbeddingTable] = {}
        fitted_on = None
        row_notes = list(notes)
        if kind == 'none':
            for t in task_list:
                per_task_tables[t.name] = table
        elif fit_on == 'task':
            fitted_on = {}
            for t in task_list:
                fit_x = table.lookup(task_sentences([t]))
                y, fitted = _fit_apply(post, fit_x, table.matrix, flow_checkpoint, eps,
                                       flow_config)
                row_notes += _fit_notes(fitted, f'{post} on {t.name}', verbose)
                per_task_tables[t.name] = table.replace(y)
                fitted_on[t.name] = int(fit_x.shape[0])
        else:
            fit_x = table.lookup(corpus if corpus is not None else sentences)
            y, fitted = _fit_apply(post, fit_x, table.matrix, flow_checkpoint, eps,
                                   flow_config)
            row_notes += _fit_notes(fitted, post, verbose)
            calibrated = table.replace(y)
            for t in task_list:
                per_task_tables[t.name] = calibrated
            fitted_on = int(fit_x.shape[0])
        scores = {t.name: score_task(t, per_task_tables[t.name].lookup) for t in task_list}
        details: dict[str, Any] = {
            'aggregate': aggregate,
            'aggregate_doc': AGGREGATE_DOC[aggregate],
            'split': split,
            'metric': 'spearman x100 of cosine similarity',
            'fit_on': None if kind == 'none' else fit_on,
            'fit_sentences': fitted_on,
            'per_task': {k: v.to_dict() for k, v in scores.items()},
            'aggregates': {
                a: {'tasks': {k: v.get(a) for k, v in scores.items()},
                    'avg': float(np.mean([v.get(a) for v in scores.values()]))}
                for a in AGGREGATES},
            'data_roots': sorted({t.root for t in task_list}),
            'data_files': files,
            'notes': row_notes,
        }
        if diagnostics:
            # Diagnostics look at the table the first task was scored with ('task' fit mode:
            # STS-B's own when present).
            ref = per_task_tables[(stsb or task_list[0]).name]
            details['diagnostics'] = diag.diagnostics(
                ref.matrix[eval_rows],
                ref.lookup(stsb_positive_pairs(stsb)[0]) if stsb else None,
                ref.lookup(stsb_positive_pairs(stsb)[1]) if stsb else None,
                ref.lookup(list(dict.fromkeys(task_sentences([stsb])))) if stsb else None)
        details['seconds_post'] = time.perf_counter() - t_post
        if extra_details:
            details.update(extra_details)
        results.append(StsResult(model, pooler, post, aggregate, split, scores, details))

    total = time.perf_counter() - t_start
    timing = {
        'total_s': total,
        'load_data_s': t_load - t_start,
        'encode_s': encoder.seconds - seconds_before,
        'sentences_encoded': len(table.index),
    }
    timing['rest_s'] = total - timing['encode_s']
    for r in results:
        r.details['timing'] = timing
    return results


def stsb_positive_pairs(task: StsTask) -> tuple[list[str], list[str]]:
    """STS-B pairs with gold > 4: SimCSE's positives for the alignment metric."""
    s1, s2 = [], []
    for p in task.subsets.values():
        keep = np.flatnonzero(p.gold > ALIGN_GOLD_THRESHOLD)
        s1.extend(p.sent1[i] for i in keep)
        s2.extend(p.sent2[i] for i in keep)
    return s1, s2


def evaluate(encode_fn: EncodeFn, tasks, roots=None, *, post: str = 'none',
             **kwargs) -> StsResult:
    """Evaluates one encoder under one calibration (see `evaluate_rows` for the arguments).

    Example (model selection during training):
      `evaluate(fn, ['stsb'], roots, split='dev', diagnostics=False).avg`
    """
    return evaluate_rows(encode_fn, tasks, roots, posts=(post,), **kwargs)[0]


def stsb_dev_score(encode_fn: EncodeFn, roots=None, task: Optional[StsTask] = None) -> float:
    """STS-B dev Spearman x100 (training's model-selection metric); pass `task` to skip I/O."""
    task = task or senteval.load_sts_task('stsb', roots, split='dev')
    enc = CachedEncoder(encode_fn)
    table = EmbeddingTable.build(enc, task_sentences([task]))
    return score_task(task, table.lookup).all
