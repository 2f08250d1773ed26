"""Result tables (Markdown) and JSON for STS evaluations."""
from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

from jaxsim.eval.sts import AGGREGATE_DOC, StsResult

# Column headers as in the SimCSE paper's tables.
SHORT_NAMES = {
    'STS12': 'STS12', 'STS13': 'STS13', 'STS14': 'STS14', 'STS15': 'STS15', 'STS16': 'STS16',
    'STSBenchmark': 'STS-B', 'SICKRelatedness': 'SICK-R',
}


def _fmt(v: float) -> str:
    return 'n/a' if v is None or (isinstance(v, float) and math.isnan(v)) else f'{v:.2f}'


def markdown_table(results: Sequence[StsResult], aggregate: str | None = None) -> str:
    """One row per (model, calibration), one column per task, plus Avg.

    Args:
      results: rows; the task columns are the union over rows, in paper order.
      aggregate: which aggregation to show; default: the rows' own.

    Returns:
      A caption line naming metric, aggregation, pooler and split, then the table.
    """
    if not results:
        raise ValueError('no results to tabulate')
    aggregate = aggregate or results[0].aggregate
    columns: list[str] = []
    for r in results:
        columns += [k for k in r.scores if k not in columns]
    multi_model = len({r.model for r in results}) > 1
    poolers = sorted({r.pooler for r in results})
    splits = sorted({r.split for r in results})
    caption = (f'Spearman x100 of cosine similarity; aggregation: {aggregate} '
               f'({AGGREGATE_DOC[aggregate]}); pooler: {", ".join(poolers)}; '
               f'split: {", ".join(splits)}')
    head = (['Model'] if multi_model else []) + ['Post'] + [SHORT_NAMES.get(c, c) for c in columns]
    head.append('Avg.')
    lines = [caption, '', '| ' + ' | '.join(head) + ' |',
             '|' + '|'.join(['---'] * (len(head) - len(columns) - 1)
                            + ['---:'] * (len(columns) + 1)) + '|']
    for r in results:
        cells = ([str(r.model)] if multi_model else []) + [r.label]
        cells += [_fmt(r.scores[c].get(aggregate)) if c in r.scores else '' for c in columns]
        cells.append(_fmt(r.avg_of(aggregate)))
        lines.append('| ' + ' | '.join(cells) + ' |')
    notes = sorted({n for r in results for n in r.details.get('notes', [])})
    if notes:
        lines.append('')
        lines += [f'note: {n}' for n in notes]
    return '\n'.join(lines)


def result_to_json(r: StsResult) -> dict:
    """The issue's JSON record: model, pooler, post, tasks, avg, details."""
    return {
        'model': r.model,
        'pooler': r.pooler,
        'post': r.post,
        'aggregate': r.aggregate,
        'tasks': r.tasks,
        'avg': r.avg,
        'details': r.details,
    }


def write_json(path: str | os.PathLike, results: Sequence[StsResult]) -> None:
    """Writes one record for one row, else a list of records (one per row)."""
    payload = (result_to_json(results[0]) if len(results) == 1
               else [result_to_json(r) for r in results])
    dirname = os.path.dirname(os.fspath(path))
    if dirname:
        os.makedirs(dirname, exist_ok=True)
    with open(path, 'w', encoding='utf-8') as f:
        json.dump(payload, f, indent=2, allow_nan=False)
        f.write('\n')
