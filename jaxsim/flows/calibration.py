"""BERT-flow calibration: fit a flow on sentence vectors, map them to its Gaussian latent.

This is the contract eval.py's `--post flow [--flow-checkpoint DIR]` uses:

  fc = fit_flow_calibration(embeddings)   # [N, D] -> FlowCalibration (reference Glow)
  z = fc.apply(embeddings)                # [N, D] latent, the calibrated embedding
  save_flow(fc, directory); load_flow(directory)
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxsim.flows.config import FlowConfig
from jaxsim.flows.fit import FitResult, _jitted, check_embeddings, fit_flow
from jaxsim.flows.models import make_flow
from jaxsim.flows.prior import nll_nats

_META_FILE = 'flow.json'
_PARAMS_DIR = 'params'
# Rows per jitted call in apply(): bounds memory and keeps one compiled shape per call site.
_APPLY_CHUNK = 8192


@functools.lru_cache(maxsize=16)
def _apply_fns(config: FlowConfig, dim: int):
    model = make_flow(config, dim)
    forward = jax.jit(lambda p, x: model.apply({'params': p}, x, method='forward'))
    inverse = jax.jit(lambda p, z: model.apply({'params': p}, z, method='inverse'))
    return forward, inverse


def _chunked(fn, x: np.ndarray) -> list:
    return [fn(x[i: i + _APPLY_CHUNK]) for i in range(0, x.shape[0], _APPLY_CHUNK)]


@dataclasses.dataclass(frozen=True)
class FlowCalibration:
    """A fitted flow.

    Attributes:
      config: the architecture/optimisation config it was fitted with.
      dim: embedding size D.
      params: the flow's parameter tree.
      history: per-evaluation fit log (see `FitResult.history`).
      best_step: optimizer step of `params`.
    """

    config: FlowConfig
    dim: int
    params: Any
    history: tuple = ()
    best_step: int = 0

    def _check(self, x: Any, what: str) -> np.ndarray:
        arr = check_embeddings(x, what)
        if arr.shape[1] != self.dim:
            raise ValueError(f'{what}: the flow was fitted on {self.dim}-dim vectors, got shape '
                             f'{arr.shape}')
        return arr

    def apply(self, x: Any) -> np.ndarray:
        """Maps embeddings x [N, D] to the flow latent z [N, D] (float32 numpy)."""
        arr = self._check(x, 'embeddings')
        forward, _ = _apply_fns(self.config, self.dim)
        outs = _chunked(lambda c: forward(self.params, c).z, arr)
        return np.concatenate([np.asarray(o) for o in outs], axis=0)

    def inverse(self, z: Any) -> np.ndarray:
        """Maps latents z [N, D] back to embeddings [N, D]."""
        arr = self._check(z, 'latents')
        _, inverse = _apply_fns(self.config, self.dim)
        outs = _chunked(lambda c: inverse(self.params, c), arr)
        return np.concatenate([np.asarray(o) for o in outs], axis=0)

    def nll(self, x: Any) -> np.ndarray:
        """Per-row negative log-likelihood in nats, [N]."""
        arr = self._check(x, 'embeddings')
        forward, _ = _apply_fns(self.config, self.dim)
        outs = _chunked(lambda c: nll_nats(*forward(self.params, c)), arr)
        return np.concatenate([np.asarray(o) for o in outs], axis=0)


def fit_flow_calibration(embeddings: Any, config: Optional[FlowConfig] = None, seed: int = 0,
                         progress: Optional[bool] = None) -> FlowCalibration:
    """Fits a flow on embeddings [N, D] by maximum likelihood (BERT frozen, as in BERT-flow).

    Args:
      embeddings: [N, D] sentence vectors, finite.
      config: flow config; default the reference Glow (levels 2, depth 3, additive, width 32).
      seed: PRNG seed; the fit is deterministic given (embeddings, config, seed).
      progress: tqdm bar; default on for more than 5,000 rows.

    Raises:
      ValueError: NaN/inf rows, a dimension the architecture cannot split, or too few rows for
        the config; all raised before anything is compiled.
    """
    config = FlowConfig() if config is None else config
    if not isinstance(config, FlowConfig):
        raise TypeError(f'config must be a jaxsim.flows.FlowConfig, got {type(config).__name__}')
    x = check_embeddings(embeddings)
    show = x.shape[0] > 5000 if progress is None else progress
    result: FitResult = fit_flow(x, config, jax.random.key(seed), progress=show)
    return FlowCalibration(config=config, dim=x.shape[1], params=result.params,
                           history=tuple(result.history), best_step=result.best_step)


def _json_safe(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def save_flow(fc: FlowCalibration, directory: Union[str, pathlib.Path]) -> pathlib.Path:
    """Saves a fitted flow: params with orbax under DIR/params, config and log in DIR/flow.json.

    Overwrites a flow saved earlier in the same directory.
    """
    directory = pathlib.Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    import orbax.checkpoint as ocp

    ckptr = ocp.StandardCheckpointer()
    ckptr.save(directory / _PARAMS_DIR, fc.params, force=True)
    ckptr.wait_until_finished()
    meta = {'format': 'jaxsim.flow/1', 'config': fc.config.to_dict(), 'dim': fc.dim,
            'best_step': fc.best_step,
            'history': [{k: _json_safe(v) for k, v in h.items()} for h in fc.history]}
    (directory / _META_FILE).write_text(json.dumps(meta, indent=2))
    return directory


def load_flow(directory: Union[str, pathlib.Path]) -> FlowCalibration:
    """Loads a flow written by `save_flow`.

    Raises:
      FileNotFoundError / ValueError naming the file when the directory is not a saved flow.
    """
    directory = pathlib.Path(directory).absolute()
    meta_path = directory / _META_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f'{meta_path}: not found; is {directory} a saved flow '
                                '(written by jaxsim.flows.save_flow)?')
    try:
        meta = json.loads(meta_path.read_text())
        config = FlowConfig.from_dict(meta['config'])
        dim = int(meta['dim'])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f'{meta_path}: malformed flow metadata ({type(e).__name__}: {e})') from None
    config.check_dim(dim)
    params_dir = directory / _PARAMS_DIR
    if not params_dir.is_dir():
        raise FileNotFoundError(f'{params_dir}: flow parameters not found')
    import orbax.checkpoint as ocp

    model = _jitted(config, dim)[0]
    abstract = jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros((1, dim), jnp.float32),
                           method='forward'))['params']
    params = ocp.StandardCheckpointer().restore(params_dir, abstract)
    history = tuple({k: (math.nan if v is None else v) for k, v in h.items()}
                    for h in meta.get('history', []))
    return FlowCalibration(config=config, dim=dim, params=params, history=history,
                           best_step=int(meta.get('best_step', 0)))
