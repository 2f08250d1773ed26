"""Evaluating models end to end: load, encode once, calibrate, score.

`eval.py` is a thin command line over `run`; training's evaluation calls `stsb_score`. Models
load through `jaxsim.load_pretrained` and encode through the one `jaxsim.encode`; calibrations
come from `jaxsim.calibrate`; what is scored and what a calibration is fitted on is
`jaxsim.eval.protocol`.
"""
from __future__ import annotations

import functools
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

import jaxsim
from jaxsim import calibrate
from jaxsim.data import senteval
from jaxsim.data import transfer as transfer_data
from jaxsim.data.senteval import StsTask
from jaxsim.eval import diagnostics as diag
from jaxsim.eval import metrics, protocol, transfer
from jaxsim.eval.embeddings import CachedEncoder, EmbeddingTable, EncodeFn
from jaxsim.eval.protocol import FitSet, StsResult
from jaxsim.formats.pretrained import describe_provenance, provenance
from jaxsim.models.st_head import output_size
from jaxsim.storage.paths import SENTEVAL_ROOT

DEFAULT_DATA = SENTEVAL_ROOT
BUNDLED_NAME = 'all-MiniLM-L6-v2 (bundled)'
# SentEval's task seed (senteval/engine.py), the transfer classifiers' default.
SENTEVAL_SEED = 1111
# (sentences, dropout key) -> dropout-noised [N, D] vectors, for flows fitted on noised inputs.
NoisyEncodeFn = Callable[[list[str], jax.Array], np.ndarray]


def is_seeded(post: str) -> bool:
    """Whether fitting `post` depends on a seed (it is then fitted once per seed)."""
    cls = calibrate.CALIBRATIONS.get(calibrate.parse_spec(post)[0])
    accepted = calibrate.base._accepted_options(cls)  # None: it takes **options
    return accepted is None or 'seed' in accepted


def _fit(post: str, fit_set: FitSet, table: EmbeddingTable, seed: int, options: dict,
         noisy: Optional[NoisyEncodeFn], checkpoint) -> calibrate.Calibration:
    """Fits `post` on the fit set's vectors (or loads `checkpoint` for a flow)."""
    if checkpoint is not None and calibrate.parse_spec(post)[0] == 'flow':
        cal = calibrate.load(checkpoint)
        if cal.spec.split(':')[0] not in ('', 'flow'):  # else a 'flow' row scores another
            raise calibrate.CalibrationError(f'--flow-checkpoint {checkpoint}: holds a '
                                             f'{cal.spec!r} calibration, not a flow')
        return cal
    # calibrate.fit passes each calibration the options it takes.
    embed = None if noisy is None else functools.partial(noisy, fit_set.sentences)
    try:
        return calibrate.fit(post, table.lookup(fit_set.sentences),
                             **{**options, 'seed': seed, 'embed': embed})
    except calibrate.CalibrationError as e:  # say which fit set (a file of too few sentences)
        raise calibrate.CalibrationError(f'fit on {fit_set.fit_on}: {e}') from None


def evaluate_rows(encode_fn: EncodeFn, tasks, roots=None, *, posts: Sequence[str] = ('none',),
                  split: str = 'test', aggregate: str = 'all',
                  fit_on: Union[str, Sequence[str]] = 'target',
                  seeds: Sequence[int] = (0,), flow_checkpoint=None,
                  fit_options: Optional[Mapping[str, Any]] = None,
                  noisy_encode_fn: Optional[NoisyEncodeFn] = None, diagnostics: bool = True,
                  model: str = '', pooler: str = '',
                  extra_details: Optional[Mapping[str, Any]] = None) -> list[StsResult]:
    """Evaluates one encoder under several calibrations, encoding each sentence once.

    Args:
      encode_fn: list of N sentences -> [N, D] vectors; deterministic (no dropout). Wrap it
        in `CachedEncoder` to share encodings across calls.
      tasks: task names (sts12..sts16, stsb, sickr), a comma string, or loaded StsTasks.
      roots: data root(s), searched per file in order (None: the default root).
      posts: calibration specs (`jaxsim.calibrate.parse_spec`), one result row each.
      split: 'test' (the protocol) or 'dev' (STS-B dev, SICK trial).
      aggregate: 'all' | 'mean' | 'wmean', what `StsResult.tasks` / `.avg` show.
      fit_on: 'target', 'task', 'paper' or a sentence file (see `jaxsim.eval.protocol`), or
        several: one row per (post, fit set); 'none' gets one row.
      seeds: a calibration whose fit takes a seed (flows) is fitted once per seed and its
        scores averaged; the JSON keeps each seed's.
      flow_checkpoint: a saved flow calibration used for 'flow' posts instead of fitting.
      fit_options: options for `jaxsim.calibrate.fit` (eps, config, mesh, progress); each
        calibration receives those it takes.
      noisy_encode_fn: (sentences, key) -> dropout-noised vectors, for flow configs fitted on
        dropout-noised embeddings (BERT-flow's setting).
      diagnostics: compute alignment / uniformity / anisotropy / spectrum per row.
      model, pooler: recorded in the results.
      extra_details: merged into every row's details.

    Returns:
      One `StsResult` per (post, fit set), post-major. Notes are in `details['notes']`,
      never printed.
    """
    metrics.check_aggregate(aggregate)
    roots = senteval.as_roots(roots)
    fit_ons = [fit_on] if isinstance(fit_on, str) else list(fit_on)
    if not fit_ons or len(set(fit_ons)) != len(fit_ons):
        raise protocol.ProtocolError(f'fit_on: give each fit set once, got {fit_ons}')
    seeds = [int(s) for s in seeds] or [0]
    for p in posts:
        calibrate.parse_spec(p)  # a bad spec fails before any encoding
    t_start = time.perf_counter()
    task_list = protocol.load_tasks(tasks, roots, split=split)
    encoder = encode_fn if isinstance(encode_fn, CachedEncoder) else CachedEncoder(encode_fn)
    seconds_before = encoder.seconds

    rows_asked = list(dict.fromkeys((p, None) if calibrate.parse_spec(p)[0] == 'none' else (p, f)
                                    for p in posts for f in fit_ons))
    sets = {(p, f): protocol.fit_sets(f, task_list, roots, p) for p, f in rows_asked
            if f is not None}
    sentences = [s for t in task_list for s in t.sentences()]
    fit_sentences = [s for per_task in sets.values()
                     for fs in {id(f): f for f in per_task.values()}.values()
                     for s in fs.sentences]
    t_load = time.perf_counter()
    table = EmbeddingTable.build(encoder, sentences + fit_sentences)
    evaluated = table.subset(sentences)

    task_notes = [n for t in task_list for n in t.notes]
    files = dict(senteval.task_files(task_list))
    sources = {t.name: list(t.roots) for t in task_list}
    stsb = next((t for t in task_list if t.name == 'STSBenchmark'), None)
    ref_task = (stsb or task_list[0]).name

    results = []
    for post, fit_on in rows_asked:
        t_post = time.perf_counter()
        name, _ = calibrate.parse_spec(post)
        row_notes = list(task_notes)
        per_seed: list[dict[str, metrics.TaskScore]] = []
        ref_table = evaluated
        fit_record = None
        seeded = name != 'none' and is_seeded(post)
        post_seeds = seeds if seeded else seeds[:1]
        if name == 'none':
            per_seed.append({t.name: protocol.score_task(t, evaluated.lookup) for t in task_list})
        else:
            per_task = sets[post, fit_on]
            groups: dict[int, list[StsTask]] = {}
            for t in task_list:
                groups.setdefault(id(per_task[t.name]), []).append(t)
            shared = len(groups) == 1 and len(task_list) > 1
            fit_record = {'fit_on': fit_on,
                          'rule': (protocol.PAPER_RULES[protocol.paper_family(post)]
                                   if fit_on == 'paper' else None),
                          'sets': {t.name: per_task[t.name].record() for t in task_list},
                          'calibration': {}}
            for fs in {id(f): f for f in per_task.values()}.values():
                row_notes += [n for n in fs.notes if n not in row_notes]
                files.update(fs.files)
            for seed in post_seeds:
                scores = {}
                for members in groups.values():
                    fs = per_task[members[0].name]
                    names = [t.name for t in members]
                    cal = _fit(post, fs, table, seed, dict(fit_options or {}), noisy_encode_fn,
                               flow_checkpoint)
                    if cal.note:
                        where = fs.fit_on if shared else f'{fs.fit_on} fit for {", ".join(names)}'
                        note = f'[{post}, {where}] {cal.note}'
                        row_notes += [note] if note not in row_notes else []
                    for n in names:
                        fit_record['calibration'].setdefault(n, cal.describe())
                    own = evaluated.subset([s for t in members for s in t.sentences()])
                    own = own.replace(cal.apply(own.matrix))
                    scores.update({t.name: protocol.score_task(t, own.lookup) for t in members})
                    if diagnostics and ref_task in names and seed == post_seeds[0]:
                        ref_table = evaluated.replace(cal.apply(evaluated.matrix))
                per_seed.append({t.name: scores[t.name] for t in task_list})
        scores = {k: metrics.mean_task_score([s[k] for s in per_seed]) for k in per_seed[0]}
        details: dict[str, Any] = {
            'aggregate': aggregate,
            'aggregate_doc': metrics.AGGREGATE_DOC[aggregate],
            'split': split,
            'metric': 'spearman x100 of cosine similarity',
            'fit_on': fit_on,
            'fit': fit_record,
            'seeds': post_seeds if seeded else None,
            'per_seed': ({k: [s[k].get(aggregate) for s in per_seed] for k in scores}
                         if len(per_seed) > 1 else None),
            'per_task': {k: v.to_dict() for k, v in scores.items()},
            'aggregates': {
                a: {'tasks': {k: v.get(a) for k, v in scores.items()},
                    'avg': float(np.mean([v.get(a) for v in scores.values()]))}
                for a in metrics.AGGREGATES},
            'data_sources': sources,
            'data_files': dict(files),
            'notes': row_notes,
        }
        if diagnostics:
            # Geometry of the vectors STS-B was scored with (else the first task's).
            pos1, pos2 = protocol.stsb_positive_pairs(stsb) if stsb else ([], [])
            details['diagnostics'] = diag.diagnostics(
                ref_table.matrix, ref_table.lookup(pos1), ref_table.lookup(pos2),
                ref_table.subset(stsb.sentences()).matrix if stsb else None)
        details['seconds_post'] = time.perf_counter() - t_post
        if extra_details:
            details.update(extra_details)
        results.append(StsResult(model, pooler, post, aggregate, split, scores, details, fit_on))

    total = time.perf_counter() - t_start
    timing = {'total_s': total, 'load_data_s': t_load - t_start,
              'encode_s': encoder.seconds - seconds_before,
              'sentences_encoded': len(table.index)}
    timing['rest_s'] = total - timing['encode_s']
    for r in results:
        r.details['timing'] = timing
    return results


def evaluate(encode_fn: EncodeFn, tasks, roots=None, *, post: str = 'none', **kwargs) -> StsResult:
    """Evaluates one encoder under one calibration (see `evaluate_rows` for the arguments).

    Example (model selection during training):
      `evaluate(fn, ['stsb'], roots, split='dev', diagnostics=False).avg`
    """
    return evaluate_rows(encode_fn, tasks, roots, posts=(post,), **kwargs)[0]


def stsb_score(encode_fn: EncodeFn, roots=None, split: str = 'dev',
               task: Optional[StsTask] = None) -> float:
    """STS-B Spearman x100 of one split (dev: training's model-selection metric); pass `task`
    (a loaded STS-B split) to skip I/O."""
    task = task or senteval.load_sts_task('stsb', roots, split=split)
    table = EmbeddingTable.build(CachedEncoder(encode_fn), task.sentences())
    return protocol.score_task(task, table.lookup).all


def make_encoder(model: jaxsim.SentenceModel, max_length: Optional[int] = None,
                 batch_size: int = 64, dtype: str = 'float32') -> CachedEncoder:
    """A cached `list[str] -> [N, H]` over `jaxsim.encode` (eval mode: no dropout; a progress
    bar for long inputs)."""
    return CachedEncoder(functools.partial(jaxsim.encode, model, batch_size=batch_size,
                                           max_length=max_length, dtype=getattr(jnp, dtype)))


def make_noisy_encoder(model: jaxsim.SentenceModel, max_length: Optional[int] = None,
                       batch_size: int = 64, dtype: str = 'float32') -> NoisyEncodeFn:
    """`(sentences, key) -> [N, H]` with dropout on (train mode), for flow fitting."""
    def noisy(sentences: list[str], key: jax.Array) -> np.ndarray:
        return jaxsim.encode(model, sentences, batch_size=batch_size, max_length=max_length,
                             progress=False, dtype=getattr(jnp, dtype), dropout_key=key)

    return noisy


def split_tasks(names: Sequence[str]) -> tuple[list[str], list[str]]:
    """(STS task keys, transfer task names) of `names`; an unknown name is an error listing
    both kinds."""
    sts, other = [], []
    for name in (n.strip() for n in names if n.strip()):
        try:
            sts.append(senteval.canonical(name))
        except senteval.SentEvalFormatError:
            try:
                other.append(transfer_data.canonical_name(name))
            except transfer_data.TransferDataError:
                raise protocol.ProtocolError(
                    f'unknown task {name!r}; STS tasks: {", ".join(senteval.ALL_TASKS)}; '
                    f'transfer tasks: {", ".join(t.lower() for t in transfer.TASK_NAMES)}'
                ) from None
    return sts, other


def _load(name: Optional[str], pooler: Optional[str]) -> tuple[jaxsim.SentenceModel, float]:
    t0 = time.perf_counter()
    model = jaxsim.load_pretrained(jaxsim.bundled_model_path() if name is None else name, pooler)
    return model, time.perf_counter() - t0


def checkpoint_of(name: Optional[str]) -> dict:
    """Where a model's weights come from (a workdir's checkpoint step and its metric)."""
    return provenance(name) if name else {'source': BUNDLED_NAME}


def _mean_transfer(results: Sequence[transfer.TransferResult], seeds: Sequence[int]
                   ) -> transfer.TransferResult:
    """One task's results over several seeds: mean acc / devacc / F1, each seed's kept."""
    first = results[0]
    if len(results) == 1:
        return first
    mean = lambda get: float(np.mean([get(r) for r in results]))  # noqa: E731
    per_seed = [{'seed': s, 'acc': r.acc, 'devacc': r.devacc, 'f1': r.f1}
                for s, r in zip(seeds, results)]
    return transfer.TransferResult(
        first.task, mean(lambda r: r.acc), mean(lambda r: r.devacc),
        None if first.f1 is None else mean(lambda r: r.f1), first.n_dev, first.n_test,
        first.model, {**first.details, 'seeds': list(seeds), 'per_seed': per_seed})


def check_transfer_data(tasks: Sequence[str], roots: Sequence) -> list[str]:
    """Canonical transfer task names; a task folder missing under `roots` fails now, before
    any model loads or STS evaluation runs."""
    tasks = [transfer_data.canonical_name(t) for t in tasks]
    for t in tasks:
        transfer_data.find_task_dir(t, roots)
    return tasks


def run_transfer(models: Sequence[Optional[str]], roots: Sequence, tasks: Sequence[str], *,
                 pooler: Optional[str] = None, max_length: Optional[int] = None,
                 batch_size: int = 64, seeds: Sequence[int] = (SENTEVAL_SEED,),
                 dtype: str = 'float32') -> list[tuple[str, str, list[transfer.TransferResult]]]:
    """SentEval transfer tasks (`jaxsim.eval.transfer`) on each model's raw vectors.

    Returns:
      (model label, pooler, results in task order) per model; with several seeds each task's
      scores are the mean over seeds (each seed's in the result's details).
    """
    tasks = check_transfer_data(tasks, roots)
    out = []
    for name in models:
        model, _ = _load(name, pooler)
        encoder = make_encoder(model, max_length, batch_size, dtype)
        origin = checkpoint_of(name)
        label = describe_provenance(origin) if 'step' in origin else str(name or BUNDLED_NAME)
        results = [_mean_transfer([transfer.evaluate_transfer(t, encoder, roots, seed=s,
                                                              model=label) for s in seeds],
                                  seeds) for t in tasks]
        out.append((label, model.pooler, results))
    return out


def run(models: Sequence[Optional[str]], roots: Sequence, tasks: Optional[Sequence[str]] = None,
        *, posts: Sequence[str] = ('none',), pooler: Optional[str] = None,
        max_length: Optional[int] = None, batch_size: int = 64, split: str = 'test',
        aggregate: str = 'all', fit_on: Union[str, Sequence[str]] = 'target',
        seeds: Sequence[int] = (0,),
        flow_checkpoint=None, flow_config=None, eps: float = 0.0, diagnostics: bool = True,
        dtype: str = 'float32') -> list[StsResult]:
    """Evaluates each model under each calibration: one row per (model, post).

    Args:
      models: model folders, hub ids or train workdirs (None: the bundled model).
      roots: data roots, searched per file in order.
      tasks: task names; default: every task found (STS-B only for split='dev').
      flow_config: a flow config (name or file) for flow posts given without one.
      eps: covariance regularizer for whitening / sn (0: drop null directions, with a note).
      pooler: default: the model's own (sentence-transformers / training config), else 'avg'.
      max_length: token limit; default: the model's (no truncation in practice, as SimCSE).
      dtype: encoder compute dtype, 'float32' or 'bfloat16' (parameters stay float32).
      posts, split, aggregate, fit_on, seeds, flow_checkpoint, diagnostics, batch_size: see
        `evaluate_rows`.

    Returns:
      Rows, model-major. Notes (skipped tasks included) are in each row's details.
    """
    for p in posts:
        calibrate.parse_spec(p)  # a typo in --post fails before any loading
    for f in [fit_on] if isinstance(fit_on, str) else fit_on:
        protocol.check_fit_on(f)
    roots = [pathlib.Path(r) for r in roots]
    skipped: list[str] = []
    if not tasks:
        tasks, skipped = protocol.default_tasks(roots, split)
    # Data before any model: bad data fails in a second.
    loaded = protocol.load_tasks(list(tasks), roots, split=split)
    options = {'eps': eps, 'config': flow_config}
    rows: list[StsResult] = []
    for name in models:
        model, load_s = _load(name, pooler)
        protocol.check_post_widths(posts, output_size(model.head, model.hidden_size),
                                   str(name or BUNDLED_NAME))
        encoder = make_encoder(model, max_length, batch_size, dtype)
        noisy = make_noisy_encoder(model, max_length, batch_size, dtype)
        out = evaluate_rows(
            encoder, loaded, roots, posts=posts, split=split, aggregate=aggregate,
            fit_on=fit_on, seeds=seeds, flow_checkpoint=flow_checkpoint, fit_options=options,
            noisy_encode_fn=noisy, diagnostics=diagnostics,
            model=str(name or BUNDLED_NAME), pooler=model.pooler,
            extra_details={'model_path': str(model.path), 'checkpoint': checkpoint_of(name),
                           'max_length': max_length,
                           'batch_size': batch_size, 'dtype': dtype, 'load_model_s': load_s,
                           'versions': {'jaxsim': jaxsim.__version__,
                                        'jax': jax.__version__}})
        for r in out:
            r.details['notes'][:0] = skipped
        rows += out
    return rows
