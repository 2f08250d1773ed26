"""The SentEval transfer tasks, as SimCSE's `evaluation.py --mode test` runs them.

A logistic regression (`jaxsim.eval.logreg`) on frozen sentence vectors, under SentEval's
protocols (facebookresearch/SentEval, `senteval/tools/validation.py`; the table is in
docs/evaluation.md): `InnerKFoldClassifier` for MR, CR, SUBJ, MPQA (per outer fold, the L2
value chosen by a 10-fold CV inside the training part, each inner classifier early-stopping on
its inner test fold, then a refit on the whole training part with a 5% early-stopping
carve-out; both fold splits are `StratifiedKFold(shuffle=True, random_state=1111)`),
`SplitClassifier` for SST2, `KFoldClassifier` for TREC and MRPC.

Fold assignment depends on the sample order, so samples are put in SentEval's order first:
sorted (stably) by token count, then label (MRPC: by both sentences' token counts, then label).
Scores are rounded as SentEval rounds them (x100, 2 decimals, per fold and again overall).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Optional

import numpy as np

from jaxsim.data import transfer as transfer_data
from jaxsim.data.transfer import LabeledText, PathLike, TransferData
from jaxsim.eval import logreg
from jaxsim.eval.embeddings import EncodeFn
from jaxsim.eval.logreg import ClassifierConfig, ClassifierError, Problem
from jaxsim.progress import CountProgress
from jaxsim.storage import store

# Task name -> SentEval protocol.
PROTOCOLS = {
    'MR': 'cv', 'CR': 'cv', 'SUBJ': 'cv', 'MPQA': 'cv',
    'SST2': 'dev_test', 'TREC': 'cv_test', 'MRPC': 'cv_test',
}
TASK_NAMES = tuple(PROTOCOLS)                 # SimCSE's column order
PROTOCOL_DOC = {
    'cv': '10-fold CV, L2 chosen by inner 10-fold CV',
    'dev_test': 'L2 chosen on dev, scored on test',
    'cv_test': 'L2 chosen by 10-fold CV on train, scored on test',
}
KFOLD = 10
# SentEval's InnerKFoldClassifier fixes both fold splits' seed, whatever the task seed.
INNER_KFOLD_SEED = 1111


@dataclasses.dataclass(frozen=True)
class TransferResult:
    """One transfer task's score.

    Attributes:
      task: 'MR', 'SST2', ...
      acc: test accuracy x100 (mean over the outer folds for MR/CR/SUBJ/MPQA).
      devacc: the chosen L2 value's dev accuracy x100 (SentEval's 'devacc').
      f1: MRPC only: F1 x100 of the paraphrase class on test.
      n_dev: SentEval's 'ndev' (all samples for the CV tasks, dev or train size otherwise).
      n_test: SentEval's 'ntest'.
      model: free-form model label for tables.
      details: protocol, chosen L2 value(s), dev scores per L2 value, epochs, timings
        (encode_s: reading and encoding; classifier_s, classifier_cpu_s, total_s), files read
        (path -> sha256).
    """

    task: str
    acc: float
    devacc: float
    f1: Optional[float]
    n_dev: int
    n_test: int
    model: str = ''
    details: dict = dataclasses.field(default_factory=dict)


# ---------------------------------------------------------------------------------------
# Folds: scikit-learn's StratifiedKFold(shuffle=True), which SentEval uses.
# ---------------------------------------------------------------------------------------


def stratified_kfold(y, n_splits: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(train rows, test rows) per fold, as `StratifiedKFold(n_splits, shuffle=True,
    random_state=seed).split(X, y)` (scikit-learn >= 0.22) yields them.

    Classes are numbered by first appearance; the per-fold count of each class comes from
    dealing the class-sorted labels round-robin over the folds; each class's block of fold
    ids is then shuffled with one `RandomState(seed)`, class by class.
    """
    y = np.asarray(y)
    _, first, inverse = np.unique(y, return_index=True, return_inverse=True)
    # Renumber classes by order of first appearance.
    by_appearance = np.argsort(np.argsort(first))
    encoded = by_appearance[inverse.reshape(-1)]
    counts = np.bincount(encoded)
    if n_splits < 2 or np.all(counts < n_splits):
        raise ClassifierError(f'cannot make {n_splits} stratified folds: class sizes '
                              f'{counts.tolist()}')
    num_classes = len(counts)
    dealt = np.sort(encoded)
    allocation = np.stack([np.bincount(dealt[i::n_splits], minlength=num_classes)
                           for i in range(n_splits)])          # [folds, classes]
    rng = np.random.RandomState(seed)
    test_fold = np.empty(len(y), np.int64)
    for k in range(num_classes):
        folds = np.repeat(np.arange(n_splits), allocation[:, k])
        rng.shuffle(folds)
        test_fold[encoded == k] = folds
    rows = np.arange(len(y))
    return [(rows[test_fold != i], rows[test_fold == i]) for i in range(n_splits)]


# ---------------------------------------------------------------------------------------
# SentEval's rounding: `round(np.float64, 2)` (NumPy: scale, round half even) where SentEval
# rounds a NumPy mean, Python's `round(float, 2)` where it rounds `clf.score`.
# ---------------------------------------------------------------------------------------


def _np_round(v) -> float:
    return float(np.round(np.float64(v), 2))


def _py_round(v) -> float:
    return round(float(v), 2)


def _accuracy(pred, y) -> float:
    return float(np.mean(np.asarray(pred) == np.asarray(y)))


def _dev_scores(fit: logreg.FitResult, problems: slice) -> np.ndarray:
    """[R] rounded mean dev accuracy x100 over `problems`, as SentEval's L2 search."""
    acc = fit.dev_accuracy[problems]                                    # [folds, R]
    return np.asarray([_np_round(100 * np.mean(acc[:, r])) for r in range(acc.shape[1])])


def _tested(fit: logreg.FitResult, problem: int, scores: np.ndarray, x_test, y_test,
            cfg: ClassifierConfig) -> dict:
    """The classifier of `problem` at the L2 value best on dev (`scores` [R]), on test."""
    r = int(np.argmax(scores))
    pred = logreg.predict(fit.weight[problem, r], fit.bias[problem, r], x_test)
    return {'acc': _py_round(100 * _accuracy(pred, y_test)), 'devacc': float(scores[r]),
            'l2': cfg.l2_grid[r], 'dev_scores': scores.tolist(), 'pred': pred,
            'epochs': fit.epochs.tolist(), 'rounds': fit.rounds}


# ---------------------------------------------------------------------------------------
# Protocols on features.
# ---------------------------------------------------------------------------------------


def cross_validate(x, y, num_classes: int, cfg: ClassifierConfig = ClassifierConfig(),
                   kfold: int = KFOLD, progress=None) -> dict:
    """MR/CR/SUBJ/MPQA: SentEval's InnerKFoldClassifier on [N, D] features and [N] labels.

    Returns:
      {'acc', 'devacc', 'l2' (chosen per outer fold), 'fold_acc', 'dev_scores' [outer][R],
       'epochs', 'rounds'}.
    """
    y = np.asarray(y)
    outer = stratified_kfold(y, kfold, INNER_KFOLD_SEED)
    problems = []
    for train, _ in outer:
        for inner_train, inner_test in stratified_kfold(y[train], kfold, INNER_KFOLD_SEED):
            problems.append(Problem(train[inner_train], train[inner_test]))
    problems += [Problem(train) for train, _ in outer]              # the refits, 5% carve-out
    fit = logreg.fit(x, y, problems, num_classes, cfg, progress=progress)
    # Outer fold o: its inner problems are o * kfold ..., its refit kfold * kfold + o.
    folds = [_tested(fit, kfold * kfold + o, _dev_scores(fit, slice(o * kfold, (o + 1) * kfold)),
                     np.asarray(x)[test], y[test], cfg) for o, (_, test) in enumerate(outer)]
    fold_acc = [f['acc'] for f in folds]
    return {'acc': _np_round(np.mean(fold_acc)),
            'devacc': _np_round(np.mean([f['devacc'] for f in folds])),
            'l2': [f['l2'] for f in folds], 'fold_acc': fold_acc,
            'dev_scores': [f['dev_scores'] for f in folds],
            'epochs': fit.epochs.tolist(), 'rounds': fit.rounds}


def cv_then_test(x_train, y_train, x_test, y_test, num_classes: int,
                 cfg: ClassifierConfig = ClassifierConfig(), kfold: int = KFOLD,
                 progress=None) -> dict:
    """TREC/MRPC: SentEval's KFoldClassifier (L2 by k-fold CV on train, refit, test).

    Returns:
      {'acc', 'devacc', 'l2', 'dev_scores' [R], 'pred' (test predictions), 'epochs', 'rounds'}.
    """
    x_train, y_train = np.asarray(x_train, np.float32), np.asarray(y_train)
    folds = stratified_kfold(y_train, kfold, cfg.seed)
    problems = [Problem(train, test) for train, test in folds]
    problems.append(Problem(np.arange(len(y_train))))
    fit = logreg.fit(x_train, y_train, problems, num_classes, cfg, progress=progress)
    return _tested(fit, kfold, _dev_scores(fit, slice(0, kfold)), x_test, y_test, cfg)


def dev_then_test(x_train, y_train, x_dev, y_dev, x_test, y_test, num_classes: int,
                  cfg: ClassifierConfig = ClassifierConfig(), progress=None) -> dict:
    """SST2: SentEval's SplitClassifier (L2 chosen on dev, scored on test).

    SentEval retrains the chosen L2 value with the same seed and data, which reproduces the
    classifier of the search; that one is reused.
    """
    x = np.concatenate([np.asarray(x_train, np.float32), np.asarray(x_dev, np.float32)])
    y = np.concatenate([np.asarray(y_train), np.asarray(y_dev)])
    n = len(y_train)
    fit = logreg.fit(x, y, [Problem(np.arange(n), np.arange(n, len(y)))], num_classes, cfg,
                     progress=progress)
    scores = np.asarray([_py_round(100 * a) for a in fit.dev_accuracy[0]])
    return _tested(fit, 0, scores, x_test, y_test, cfg)


def f1_x100(y_true, y_pred, positive: int = 1) -> float:
    """F1 x100 of the `positive` class (sklearn's binary f1_score), rounded to 2 decimals."""
    y_true, y_pred = np.asarray(y_true), np.asarray(y_pred)
    tp = np.sum((y_pred == positive) & (y_true == positive))
    denom = np.sum(y_pred == positive) + np.sum(y_true == positive)
    return _py_round(100 * (2 * tp / denom if denom else 0.0))


# ---------------------------------------------------------------------------------------
# Tasks end to end.
# ---------------------------------------------------------------------------------------


def senteval_order(split: LabeledText) -> np.ndarray:
    """Sample order after SentEval's stable sort by (token count[s], label)."""
    n1 = [len(s.split()) for s in split.sent1]
    if split.sent2 is None:
        keys = list(zip(n1, split.labels.tolist()))
    else:
        keys = list(zip(n1, [len(s.split()) for s in split.sent2], split.labels.tolist()))
    return np.asarray(sorted(range(len(keys)), key=keys.__getitem__), np.int64)


def _ordered(split: LabeledText) -> LabeledText:
    order = senteval_order(split)
    pick = lambda s: None if s is None else [s[i] for i in order]  # noqa: E731
    return LabeledText(pick(split.sent1), pick(split.sent2), split.labels[order])


def _encode_all(data: TransferData, encode_fn: EncodeFn) -> Callable[[list[str]], np.ndarray]:
    """Encodes every distinct sentence of the task once; returns a lookup for lists."""
    unique = list(dict.fromkeys(s for split in data.splits.values()
                                for col in (split.sent1, split.sent2 or []) for s in col))
    vectors = np.asarray(encode_fn(unique), np.float32)
    if vectors.ndim != 2 or len(vectors) != len(unique):
        raise ClassifierError(f'{data.name}: encode_fn returned shape {vectors.shape} for '
                              f'{len(unique)} sentences; expected [{len(unique)}, D]')
    index = {s: i for i, s in enumerate(unique)}
    return lambda sents: vectors[[index[s] for s in sents]]


def _features(split: LabeledText, lookup) -> np.ndarray:
    u = lookup(split.sent1)
    if split.sent2 is None:
        return u
    v = lookup(split.sent2)
    return np.concatenate([np.abs(u - v), u * v], axis=1)           # SentEval's mrpc.py


def run_protocol(data: TransferData, lookup, cfg: ClassifierConfig, progress=None) -> dict:
    """The task's protocol on SentEval-ordered splits; `lookup(sentences) -> [n, D]`;
    `progress(done, total)` is called as the classifiers finish."""
    splits = {k: _ordered(v) for k, v in data.splits.items()}
    feats = {k: _features(v, lookup) for k, v in splits.items()}
    labels = {k: v.labels for k, v in splits.items()}
    protocol = PROTOCOLS[data.name]
    if protocol == 'cv':
        out = cross_validate(feats['all'], labels['all'], data.num_classes, cfg, progress=progress)
        out.update(n_dev=len(labels['all']), n_test=len(labels['all']))
    elif protocol == 'dev_test':
        out = dev_then_test(feats['train'], labels['train'], feats['dev'], labels['dev'],
                            feats['test'], labels['test'], data.num_classes, cfg,
                            progress=progress)
        out.update(n_dev=len(labels['dev']), n_test=len(labels['test']))
    else:
        out = cv_then_test(feats['train'], labels['train'], feats['test'], labels['test'],
                           data.num_classes, cfg, progress=progress)
        out.update(n_dev=len(labels['train']), n_test=len(labels['test']))
    if data.name == 'MRPC':
        out['f1'] = f1_x100(labels['test'], out['pred'])
    out.pop('pred', None)
    return out


def evaluate_transfer(task_name: str, encode_fn: EncodeFn,
                      roots: PathLike | Sequence[PathLike], *, seed: int = 1111,
                      config: Optional[ClassifierConfig] = None,
                      model: str = '', progress: bool = True) -> TransferResult:
    """Scores sentence vectors on one SentEval transfer task.

    Args:
      task_name: MR, CR, SUBJ, MPQA, SST2, TREC or MRPC (case-insensitive).
      encode_fn: list of sentences -> [n, D] vectors (called once, on the distinct sentences).
      roots: data root(s) in SentEval's layout (see `jaxsim.data.transfer`).
      seed: SentEval's task seed (classifier batch order and init; TREC/MRPC folds).
      config: classifier settings (its seed is replaced by `seed`); default SimCSE's test mode.
      model: label stored in the result for tables.
      progress: report the classifiers' progress on stderr (a bar on a terminal, else lines).

    Returns:
      The task's TransferResult.
    """
    t0 = time.perf_counter()
    data = transfer_data.load_transfer_task(task_name, roots)
    cfg = dataclasses.replace(config or ClassifierConfig(), seed=seed)
    lookup = _encode_all(data, encode_fn)
    t1, c1 = time.perf_counter(), time.process_time()
    # The classifiers train together, round by round: progress counts those done.
    with contextlib.closing(CountProgress(f'{data.name} classifiers', unit='clf',
                                          enable=progress)) as bar:
        out = run_protocol(data, lookup, cfg, progress=bar)
    t2, c2 = time.perf_counter(), time.process_time()
    details = {
        'protocol': PROTOCOL_DOC[PROTOCOLS[data.name]],
        'l2': out['l2'], 'dev_scores': out['dev_scores'], 'l2_grid': list(cfg.l2_grid),
        'rounds': out['rounds'],
        'epochs_max': int(np.max(out['epochs'])),
        # Wall seconds; classifier_cpu_s (CPU seconds of this process) tells a busy machine.
        'timing': {'encode_s': round(t1 - t0, 3), 'classifier_s': round(t2 - t1, 3),
                   'classifier_cpu_s': round(c2 - c1, 3), 'total_s': round(t2 - t0, 3)},
        'files': data.files, 'root': data.root,
    }
    if 'fold_acc' in out:
        details['fold_acc'] = out['fold_acc']
    return TransferResult(task=data.name, acc=out['acc'], devacc=out['devacc'],
                          f1=out.get('f1'), n_dev=out['n_dev'], n_test=out['n_test'],
                          model=model, details=details)


# ---------------------------------------------------------------------------------------
# Reports.
# ---------------------------------------------------------------------------------------


def fmt_score(v: Optional[float]) -> str:
    """A score for a table: 2 decimals, 'n/a' for None or NaN."""
    return 'n/a' if v is None or not np.isfinite(v) else f'{v:.2f}'


def caption(columns: Sequence[str], pooler: Optional[str] = None) -> str:
    """What a transfer table shows (with its `pooler`), and each task column's protocol."""
    parts = ['Accuracy x100 of logistic regression on frozen sentence vectors (SentEval, '
             'SimCSE test mode)']
    if pooler is not None:
        parts.append(f'pooler: {pooler}')
    parts += [f'{", ".join(t for t in columns if PROTOCOLS[t] == p)}: {PROTOCOL_DOC[p]}'
              for p in PROTOCOL_DOC if any(PROTOCOLS[t] == p for t in columns)]
    return '; '.join(parts)


def format_transfer_table(results: Sequence[TransferResult]) -> str:
    """Markdown: one row per model, one column per task (SimCSE's order), plus Avg.; a caption
    line naming the metric and protocols first, a note line with MRPC's F1 last."""
    if not results:
        raise ValueError('no results to tabulate')
    columns = [t for t in TASK_NAMES if any(r.task == t for r in results)]
    models = list(dict.fromkeys(r.model for r in results))
    cell = {(r.model, r.task): r for r in results}
    head = ['Model'] + columns + ['Avg.']
    lines = [caption(columns), '', '| ' + ' | '.join(head) + ' |',
             '|---|' + '|'.join(['---:'] * (len(columns) + 1)) + '|']
    notes = []
    for m in models:
        accs = [cell[m, t].acc if (m, t) in cell else None for t in columns]
        avg = float(np.mean(accs)) if all(a is not None for a in accs) else None
        cells = ['' if a is None else fmt_score(a) for a in accs]
        lines.append('| ' + ' | '.join([m or '-'] + cells + [fmt_score(avg)]) + ' |')
        if (m, 'MRPC') in cell and cell[m, 'MRPC'].f1 is not None:
            notes.append(f'note: MRPC F1 x100{" (" + m + ")" if m else ""}: '
                         f'{fmt_score(cell[m, "MRPC"].f1)}')
    return '\n'.join(lines + ([''] + notes if notes else []))


def write_transfer_json(path: PathLike, results: Sequence[TransferResult],
                        overwrite: bool = False) -> None:
    """Writes a list of records (one per task and model) to `path`, whole or not at all; an
    existing file only with `overwrite`."""
    records = [{'task': r.task, 'model': r.model, 'acc': r.acc, 'devacc': r.devacc, 'f1': r.f1,
                'n_dev': r.n_dev, 'n_test': r.n_test, 'details': r.details} for r in results]
    store.write_json(path, records, overwrite=overwrite, what='transfer JSON', indent=2)
