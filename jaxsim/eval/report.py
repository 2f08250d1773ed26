"""Result tables (Markdown) and JSON records for STS evaluations.

A table says what it shows: metric, aggregation, pooler and split in its caption; an average
over fewer than the 7 STS tasks is headed "Avg. (n)" and the caption lists the tasks it
covers; below the table, the data root each task was read from and every note, once.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np

from jaxsim.data import senteval
from jaxsim.eval import transfer
from jaxsim.eval.metrics import AGGREGATE_DOC
from jaxsim.eval.protocol import StsResult
from jaxsim.eval.transfer import TransferResult, fmt_score
from jaxsim.formats.pretrained import describe_provenance
from jaxsim.storage import store

# Column headers as in the SimCSE paper's tables (STS12-16 keep their keys).
SHORT_NAMES = {'STSBenchmark': 'STS-B', 'SICKRelatedness': 'SICK-R'}
NUM_TASKS = len(senteval.TASK_KEYS)


def avg_header(tasks: Sequence[str], total: int = NUM_TASKS) -> str:
    """'Avg.' over all `total` tasks, else 'Avg. (n)'."""
    return 'Avg.' if len(tasks) == total else f'Avg. ({len(tasks)})'


def _dedup(items) -> list:
    return list(dict.fromkeys(items))


def markdown_table(results: Sequence[StsResult], aggregate: str | None = None) -> str:
    """One row per (model, calibration), one column per task (the union over rows, in paper
    order), plus the average, at `aggregate` (default: the rows' own); caption lines first,
    'data:' and 'note:' lines last."""
    if not results:
        raise ValueError('no results to tabulate')
    aggregate = aggregate or results[0].aggregate
    columns = _dedup(k for r in results for k in r.scores)
    multi_model = len({r.model for r in results}) > 1
    avg = avg_header(columns)
    caption = (f'Spearman x100 of cosine similarity; aggregation: {aggregate} '
               f'({AGGREGATE_DOC[aggregate]}); '
               f'pooler: {", ".join(_dedup(r.pooler for r in results))}; '
               f'split: {", ".join(_dedup(r.split for r in results))}')
    fit_ons = _dedup(r.fit_on for r in results if r.fit_on)
    if fit_ons:
        caption += f'; calibrations fitted on: {", ".join(map(str, fit_ons))}'
    show_fit = len(fit_ons) > 1
    lines = [caption]
    if avg != 'Avg.':
        lines.append(f'{avg}: the mean over {", ".join(SHORT_NAMES.get(c, c) for c in columns)}'
                     f' only (not the 7-task average)')
    head = (['Model'] if multi_model else []) + ['Post'] + [SHORT_NAMES.get(c, c) for c in columns]
    head.append(avg)
    lines += ['', '| ' + ' | '.join(head) + ' |',
              '|' + '|'.join(['---'] * (len(head) - len(columns) - 1)
                             + ['---:'] * (len(columns) + 1)) + '|']
    for r in results:
        label = f'{r.label} ({r.fit_on})' if show_fit and r.fit_on else r.label
        cells = ([str(r.model)] if multi_model else []) + [label]
        spread = seed_spread(r, aggregate)
        cells += [fmt_score(r.scores[c].get(aggregate)) + spread.get(c, '') if c in r.scores else ''
                  for c in columns]
        cells.append(fmt_score(r.avg_of(aggregate)) + spread.get('avg', '')
                     if set(r.scores) == set(columns) else 'n/a')
        lines.append('| ' + ' | '.join(cells) + ' |')
    if any(r.details.get('per_seed') for r in results):
        lines += ['', 'mean ±std over seeds ' + '; '.join(_dedup(
            f'{r.label}: {", ".join(map(str, r.details["seeds"]))}' for r in results
            if r.details.get('per_seed'))) + ' (std: population, ddof 0)']
    lines += ['', *checkpoint_lines(results), *data_lines(results)]
    lines += [f'note: {n}' for n in _dedup(n for r in results for n in r.details.get('notes', []))]
    return '\n'.join(lines)


def seed_spread(r: StsResult, aggregate: str) -> dict[str, str]:
    """' ±std' per task (and 'avg') of a row scored over several seeds, else {}."""
    per_seed = r.details.get('per_seed')
    if not per_seed:
        return {}
    out = {task: f' ±{float(np.std(values)):.2f}' for task, values in per_seed.items()}
    if set(r.scores) == set(per_seed):
        averages = np.mean([per_seed[t] for t in r.scores], axis=0)  # one average per seed
        out['avg'] = f' ±{float(np.std(averages)):.2f}'
    return out


def checkpoint_lines(results: Sequence[StsResult]) -> list[str]:
    """'checkpoint: WORKDIR step N (best stsb_dev X)' for models loaded from a train workdir."""
    records = _dedup(json.dumps(r.details['checkpoint'], sort_keys=True) for r in results
                     if 'step' in r.details.get('checkpoint', {}))
    return [f'checkpoint: {describe_provenance(json.loads(x))}' for x in records]


def data_lines(results: Sequence[StsResult]) -> list[str]:
    """'data: STS12, STS-B from ROOT' lines: which data root each task was read from."""
    by_roots: dict[tuple[str, ...], dict[str, None]] = {}  # roots -> task names, in order
    for r in results:
        for task, roots in r.details.get('data_sources', {}).items():
            by_roots.setdefault(tuple(roots), {})[SHORT_NAMES.get(task, task)] = None
    return [f'data: {", ".join(tasks)} from {" + ".join(roots)}'
            for roots, tasks in by_roots.items()]


def transfer_table(rows: Sequence[tuple[str, str, Sequence[TransferResult]]]) -> str:
    """The transfer tasks as the STS table shows them: one row per model, accuracy x100 per
    task (SimCSE's order), MRPC's F1 beside it, the average labelled with its coverage.

    Args:
      rows: (model label, pooler, results) per model, as `runner.run_transfer` returns.
    """
    if not rows:
        raise ValueError('no results to tabulate')
    columns = [t for t in transfer.TASK_NAMES if any(r.task == t for _, _, rs in rows for r in rs)]
    n = len(transfer.TASK_NAMES)
    avg = avg_header(columns, n)
    lines = [transfer.caption(columns, ', '.join(_dedup(p for _, p, _ in rows)))]
    if avg != 'Avg.':
        lines.append(f'{avg}: the mean accuracy over {", ".join(columns)} only (not the '
                     f'{n}-task average)')
    head = ['Model'] + [c for t in columns for c in ([t, 'MRPC F1'] if t == 'MRPC' else [t])]
    head.append(avg)
    lines += ['', '| ' + ' | '.join(head) + ' |', '|---|' + '|'.join(['---:'] * (len(head) - 1))
              + '|']
    for model, _, results in rows:
        by_task = {r.task: r for r in results}
        cells = [model]
        for t in columns:
            r = by_task.get(t)
            cells.append(fmt_score(r.acc) + _transfer_spread(r, 'acc') if r else '')
            if t == 'MRPC':
                cells.append(fmt_score(r.f1) + _transfer_spread(r, 'f1') if r else '')
        accs = [by_task[t].acc for t in columns if t in by_task]
        cells.append(fmt_score(float(np.mean(accs))) if len(accs) == len(columns) else 'n/a')
        lines.append('| ' + ' | '.join(cells) + ' |')
    roots = _dedup(r.details.get('root', '') for _, _, rs in rows for r in rs)
    seeds = _dedup(str(r.details['seeds']) for _, _, rs in rows for r in rs
                   if r.details.get('per_seed'))
    if seeds:
        lines += ['', f'mean ±std over seeds {", ".join(seeds)} (std: population, ddof 0)']
    lines += ['', f'data: {", ".join(columns)} from {" + ".join(roots)}']
    return '\n'.join(lines)


def _transfer_spread(r: TransferResult, key: str) -> str:
    """' ±std' over seeds of a transfer result scored with several, else ''."""
    per_seed = r.details.get('per_seed')
    if not per_seed or per_seed[0].get(key) is None:
        return ''
    return f' ±{float(np.std([s[key] for s in per_seed])):.2f}'


def transfer_to_json(model: str, pooler: str, results: Sequence[TransferResult]) -> dict:
    """One model's transfer record, shaped like an STS record: tasks (accuracy x100), avg and
    what it covers, MRPC's F1, and each task's details."""
    accs = {r.task: r.acc for r in results}
    return {
        'model': model, 'pooler': pooler, 'post': 'none', 'metric': 'accuracy x100',
        'tasks': accs, 'avg': float(np.mean(list(accs.values()))), 'avg_over': list(accs),
        'f1': {r.task: r.f1 for r in results if r.f1 is not None},
        'details': {r.task: {'devacc': r.devacc, 'n_dev': r.n_dev, 'n_test': r.n_test,
                             **r.details} for r in results},
    }


def result_to_json(r: StsResult) -> dict:
    """One row's JSON record: model, pooler, post, tasks, avg (and what it covers), details."""
    return {'model': r.model, 'pooler': r.pooler, 'post': r.post, 'aggregate': r.aggregate,
            'tasks': r.tasks, 'avg': r.avg, 'avg_over': list(r.scores), 'details': r.details}


def write_json(path: str | os.PathLike, results: Sequence[StsResult],
               transfer_rows: Sequence[tuple[str, str, Sequence[TransferResult]]] = (),
               overwrite: bool = False) -> None:
    """Writes one record for one row, else a list of records (STS rows, then one transfer
    record per model); whole or not at all, and an existing file only with `overwrite`."""
    records = ([result_to_json(r) for r in results]
               + [transfer_to_json(*row) for row in transfer_rows])
    payload = records[0] if len(records) == 1 else records
    store.write_json(path, payload, overwrite=overwrite, what='--json', indent=2)
