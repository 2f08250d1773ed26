"""Evaluating models end to end: load, encode once (cached), calibrate, score, report.

`eval.py` is a thin argparse layer over `run`.
"""
from __future__ import annotations

import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Optional

from jaxsim import calibration
from jaxsim.data import senteval
from jaxsim.eval.sts import CachedEncoder, StsResult, evaluate_rows
from jaxsim.paths import SENTEVAL_ROOT

DEFAULT_DATA = SENTEVAL_ROOT  # ../shared/data/senteval beside the repository


def default_tasks(roots, split: str = 'test', verbose: bool = True) -> list[str]:
    """Every task found under `roots` (the 7 SimCSE tasks for 'test'; STS-B for 'dev')."""
    if split == 'dev':
        return ['stsb']
    found = [t for t in senteval.ALL_TASKS if senteval.has_task(t, roots)]
    missing = [senteval.TASK_KEYS[t] for t in senteval.ALL_TASKS if t not in found]
    if not found:
        raise senteval.SentEvalFormatError(
            f'no STS task folder under {", ".join(map(str, roots))} (expected STS/STS1X-en-test, '
            'STS/STSBenchmark or SICK)')
    if missing and verbose:
        print(f'note: not found under the data roots, skipped: {", ".join(missing)}',
              file=sys.stderr)
    return found


def make_encoder(model, pooler: str, max_length: Optional[int], batch_size: int,
                 dtype: str = 'float32') -> CachedEncoder:
    """A cached `list[str] -> [N, H]` for one (model, pooler, max_length, dtype), dropout off."""
    import jax.numpy as jnp  # Deferred: importing JAX costs seconds.

    from jaxsim.encode import encode

    def encode_fn(sentences: list[str]):
        # `encode` applies the model with deterministic=True: evaluation never uses dropout.
        return encode(model, sentences, pooler=pooler, batch_size=batch_size,
                      max_length=max_length, progress=False, dtype=getattr(jnp, dtype))

    return CachedEncoder(encode_fn)


def run(models: Sequence[str], roots: Sequence, tasks: Optional[Sequence[str]] = None, *,
        posts: Sequence[str] = ('none',), pooler: Optional[str] = None,
        max_length: Optional[int] = None, batch_size: int = 64, split: str = 'test',
        aggregate: str = 'all', fit_on: str = 'target', flow_checkpoint=None, flow_config=None,
        eps: float = 0.0, diagnostics: bool = True, verbose: bool = True,
        dtype: str = 'float32') -> list[StsResult]:
    """Evaluates each model under each calibration: one row per (model, post).

    Args:
      models: model folders, hub ids or train workdirs ('' or None: the bundled model).
      roots: data roots; a task is read from the first root holding it.
      tasks: task names; default: every task found (STS-B only for split='dev').
      flow_config: a flow config file (e.g. configs/flow_realnvp.py) for `--post flow`.
      posts, split, aggregate, fit_on, flow_checkpoint, eps, diagnostics: see
        `jaxsim.eval.sts.evaluate_rows`.
      dtype: encoder compute dtype, 'float32' or 'bfloat16' (parameters stay float32).
      pooler: default: the model's own (sentence-transformers / training config), else 'avg'.
      max_length: token limit; default: the tokenizer's (no truncation in practice, as SimCSE).
      batch_size: encoding batch size.
      verbose: notes to stderr.

    Returns:
      Rows, model-major.
    """
    import jax

    import jaxsim
    from jaxsim.pretrained import bundled_model_path, load_pretrained

    for p in posts:
        calibration.parse_post(p)  # A typo in --post fails before any loading.
    roots = [pathlib.Path(r) for r in roots]
    tasks = list(tasks) if tasks else default_tasks(roots, split, verbose)
    # Load (and validate) the data before any model: bad data fails in a second.
    loaded = [senteval.load_sts_task(t, roots, split=split, verbose=verbose) for t in tasks]
    encoders: dict[tuple, CachedEncoder] = {}
    flow_cfg = None
    if flow_config is not None:  # read before any model loads, so a bad file fails fast
        from jaxsim.flows.config import load_config_file
        flow_cfg = load_config_file(flow_config)
    rows: list[StsResult] = []
    for name in models:
        path = name or str(bundled_model_path())
        t0 = time.perf_counter()
        model = load_pretrained(path)
        load_s = time.perf_counter() - t0
        use_pooler = pooler or model.default_pooler or 'avg'
        key = (str(model.path), use_pooler, max_length, dtype)
        if key not in encoders:
            encoders[key] = make_encoder(model, use_pooler, max_length, batch_size, dtype)
        rows += evaluate_rows(
            encoders[key], loaded, posts=posts, split=split, aggregate=aggregate,
            fit_on=fit_on, flow_checkpoint=flow_checkpoint, eps=eps, diagnostics=diagnostics,
            flow_config=flow_cfg,
            model=str(name or 'all-MiniLM-L6-v2 (bundled)'), pooler=use_pooler,
            verbose=verbose,
            extra_details={'model_path': str(model.path), 'max_length': max_length,
                           'batch_size': batch_size, 'load_model_s': load_s,
                           'versions': {'jaxsim': jaxsim.__version__, 'jax': jax.__version__}})
    return rows
