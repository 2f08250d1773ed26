"""Evaluation scores as TensorBoard scalars (`eval.py --tb DIR`), to read beside the curves
training writes: one run (a subfolder of DIR) per evaluated model, every score one point at its
checkpoint step (0 for a model that is not a train workdir). docs/evaluation.md lists the tags;
their <post> is the calibration as --post names it, characters TensorBoard refuses in tags made
'_' ('whitening:256' -> 'whitening_256'), plus '.fit_<fit set>' when a calibration is scored
under several --fit-on.
"""
from __future__ import annotations

import pathlib
import re
from collections.abc import Sequence
from typing import Optional

import numpy as np

from jaxsim.eval import runner
from jaxsim.eval.protocol import StsResult
from jaxsim.eval.transfer import TransferResult
from jaxsim.storage import store
from jaxsim.storage.tb import ScalarWriter

EVENT_FILE_PREFIX = 'events.out.tfevents.'  # how tensorboardX names event files


def tag_part(text: str) -> str:
    """`text` as one tag component: TensorBoard keeps letters, digits and `_ . -` only."""
    return re.sub(r'[^\w.-]+', '_', str(text)).strip('_') or '_'


def run_names(models: Sequence[Optional[str]]) -> list[str]:
    """One run folder name per model: its folder's (or hub id's) last part, made unique."""
    names: list[str] = []
    for name in models:
        base = tag_part(pathlib.PurePath(str(name or runner.BUNDLED_NAME).rstrip('/')).name)
        unique, n = base, 2
        while unique in names:
            unique, n = f'{base}-{n}', n + 1
        names.append(unique)
    return names


def sts_scalars(rows: Sequence[StsResult]) -> dict[str, float]:
    """tag -> score of one model's STS rows."""
    fit_sets = {}
    for r in rows:
        fit_sets.setdefault(r.post, set()).add(r.fit_on)
    out = {}
    for r in rows:
        post = r.post if len(fit_sets[r.post]) < 2 else f'{r.post}.fit_{r.fit_on}'
        prefix = f'sts_{r.split}/{tag_part(post)}'
        out.update({f'{prefix}/{task}': score for task, score in r.tasks.items()})
        out[f'{prefix}/avg'] = r.avg
    return out


def transfer_scalars(results: Sequence[TransferResult]) -> dict[str, float]:
    """tag -> score of one model's transfer results."""
    out = {f'transfer/{r.task}/accuracy': r.acc for r in results}
    out.update({f'transfer/{r.task}/f1': r.f1 for r in results if r.f1 is not None})
    if results:
        out['transfer/avg/accuracy'] = float(np.mean([r.acc for r in results]))
    return out


def check_replaceable(directory) -> None:
    """An existing --tb folder that --overwrite may replace: one holding only what an earlier
    `write_scores` left there (run folders of event files)."""
    others = sorted(p.name for p in directory.iterdir() if not p.is_dir() or any(
        not f.name.startswith(EVENT_FILE_PREFIX) for f in p.iterdir()))
    if others:
        raise store.StorageError(
            f'--tb {directory} holds other files ({", ".join(others[:3])}); it is not replaced '
            'even with --overwrite: choose another folder')


def write_scores(folder, models: Sequence[Optional[str]], rows: Sequence[StsResult],
                 transfer_rows: Sequence[tuple[str, str, Sequence[TransferResult]]],
                 overwrite: bool = False) -> list[pathlib.Path]:
    """Writes every model's scores into `folder` (swapped in whole: `store.replace_dir`);
    returns the run folders written, one per model.

    Args:
      models: the models as given (None: the bundled one), in evaluation order.
      rows: `runner.run`'s STS rows (model-major, as many per model); may be empty.
      transfer_rows: `runner.run_transfer`'s rows, one per model; may be empty.
      overwrite: replace an earlier --tb folder (one holding only event files).
    """
    if len(rows) % len(models):
        raise ValueError(f'{len(rows)} STS rows do not split evenly over {len(models)} models')
    per_model = len(rows) // len(models)
    names = run_names(models)
    with store.replace_dir(folder, overwrite, '--tb', keep=check_replaceable) as tmp:
        for i, name in enumerate(models):
            values = sts_scalars(rows[i * per_model: (i + 1) * per_model])
            if transfer_rows:
                values.update(transfer_scalars(transfer_rows[i][2]))
            step = runner.checkpoint_of(name).get('step', 0)
            with ScalarWriter(tmp / names[i]) as tb:
                tb.write(step, values)
    return [pathlib.Path(folder) / n for n in names]
