"""BERT-flow calibration: fit a flow on sentence vectors, map them to its Gaussian latent.

  'flow'            BERT-flow as its code executes it: fitted on dropout-noised vectors
                    (configs/flow_bert_flow_dropout.py) when `embed` gives them (eval.py
                    does), else on the clean vectors given, with a note saying so
  'flow:bert_flow'  the same flow always fitted on the clean vectors given
  'flow:glow'       a config shipped in configs/ by name (configs/flow_glow.py)
  'flow:PATH.py'    any config file defining get_config()

Options of `jaxsim.calibrate.fit`: config (a FlowConfig or a config path; instead of the
spec's arg), seed, embed (callable key -> dropout-noised [N, D] embeddings of the same
sentences), mesh, progress.
"""
from __future__ import annotations

import functools
import math
import pathlib
from typing import Any, Optional, Union

import jax
import numpy as np
from flax import traverse_util
from jax.sharding import Mesh

from jaxsim import compile_options
from jaxsim.calibrate.base import CALIBRATIONS, Calibration, CalibrationError, check_dim
from jaxsim.flows.checks import check_matrix
from jaxsim.flows.config import FlowConfig, FlowError, load_config_file
from jaxsim.flows.models import make_flow
from jaxsim.flows.prior import nll_nats
from jaxsim.flows.training import EmbedFn, fit_flow
from jaxsim.formats import st_flow

# Shipped configs live beside the package: <repo>/configs/flow_<name>.py.
CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / 'configs'
# What plain 'flow' fits when the caller can noise the vectors (`embed`), as the reference does.
BERT_FLOW_AS_RUN = 'bert_flow_dropout'
CLEAN_FIT_NOTE = ('flow: fitted on the clean vectors given; BERT-flow fits on dropout-noised '
                  'ones (pass embed=, as eval.py does; flow:bert_flow names this clean fit)')
_APPLY_ROWS = 1024  # rows are padded to a multiple of this: few compiled shapes
_APPLY_CHUNK = 8192  # rows per jitted call: bounds memory


def resolve_config(config: Union[None, str, pathlib.Path, FlowConfig]) -> FlowConfig:
    """A FlowConfig from None (the default), a FlowConfig, a shipped name or a file path."""
    if config is None:
        return FlowConfig()
    if isinstance(config, FlowConfig):
        return config
    if not isinstance(config, (str, pathlib.Path)):
        raise CalibrationError(f'flow config must be a FlowConfig, a shipped config name or a '
                               f'path, got {type(config).__name__}')
    text = str(config)
    path = pathlib.Path(text)
    if not text.endswith('.py') and '/' not in text:
        path = CONFIG_DIR / f'flow_{text}.py'
        if not path.is_file():
            shipped = sorted(p.stem[len('flow_'):] for p in CONFIG_DIR.glob('flow_*.py'))
            raise CalibrationError(f'no shipped flow config {text!r} ({path} not found); '
                                   f'shipped: {shipped}, or pass a config file path')
    return load_config_file(path)


@functools.lru_cache(maxsize=16)
def _jitted(config: FlowConfig, dim: int):
    model = make_flow(config, dim)
    # A flow is applied to a few thousand rows: compile time matters more than peak speed.
    options = compile_options.for_effort(jax.local_devices()[:1], 'light')
    forward = jax.jit(lambda p, x: model.apply({'params': p}, x, method='forward'),
                      compiler_options=options)
    inverse = jax.jit(lambda p, z: model.apply({'params': p}, z, method='inverse'),
                      compiler_options=options)
    return model, forward, inverse


def _rowwise(fn, x: np.ndarray) -> np.ndarray:
    """fn over x [N, D] in padded chunks; returns numpy rows [N, ...]."""
    if x.shape[0] == 0:  # one chunk of zeros gives the result's row shape and dtype
        return np.asarray(fn(np.zeros((_APPLY_ROWS, x.shape[1]), x.dtype)))[:0]
    out = []
    for i in range(0, x.shape[0], _APPLY_CHUNK):
        chunk = x[i: i + _APPLY_CHUNK]
        padded = np.pad(chunk, ((0, -chunk.shape[0] % _APPLY_ROWS), (0, 0)))
        out.append(np.asarray(fn(padded))[: chunk.shape[0]])
    return np.concatenate(out, axis=0)


# A flow module in a sentence-transformers folder reads back as this class (the folder format
# sits below calibrate/ and cannot import it).
@st_flow.FLOW_CALIBRATIONS.register('flow')
@CALIBRATIONS.register('flow')
class FlowCalibration(Calibration):
    """A fitted flow; `apply` maps embeddings to the flow's latent z (same size).

    Attributes:
      config: the flow config it was fitted with.
      dim: embedding size D.
      params: the flow's parameter tree.
      history: per-evaluation fit log (see `jaxsim.flows.FitResult.history`).
      best_step: optimizer step of `params`.
    """

    arg = 'optional'
    arg_type = str

    def __init__(self, config: FlowConfig, dim: int, params: Any, history: tuple = (),
                 best_step: int = 0, note: str = ''):
        self.note = note
        self.config = config
        self.dim = int(dim)
        self.params = params
        self.history = tuple(history)
        self.best_step = int(best_step)

    @classmethod
    def fit(cls, x, arg: Optional[str] = None, *, config=None, seed: int = 0,
            embed: Optional[EmbedFn] = None, mesh: Optional[Mesh] = None,
            progress: Optional[bool] = None, tb_dir: Optional[str] = None
            ) -> 'FlowCalibration':
        """Fits a flow on x [N, D] by maximum likelihood (the encoder stays frozen).

        Args:
          arg: config name or path from the spec ('flow:glow').
          config: FlowConfig or path, instead of `arg`.
          seed: PRNG seed; the fit is a pure function of (x, config, seed, embed).
          embed: `embed(key) -> [N, D]` dropout-noised embeddings of the same sentences;
            configs with dropout_noise train each epoch on a fresh draw (and require it);
            other configs ignore it. Plain 'flow' (no config named) fits BERT-flow on them
            when given, else on x with a note saying so (`.note`).
          mesh: device mesh the batch is split over (default: all local devices).
          progress: tqdm bar (default: on above 5,000 rows).
          tb_dir: a folder for TensorBoard scalars of the fit (train/held-out NLL, bits/dim
            per evaluation step; see `jaxsim.flows.fit_flow`).
        """
        if arg is not None and config is not None:
            raise CalibrationError(f'flow:{arg} and config={config!r} both name a flow config; '
                                   'give one')
        named = config if config is not None else arg
        notes = []
        try:
            if named is None and embed is not None:
                # BERT-flow trains its flow under the encoder in train mode.
                cfg = resolve_config(BERT_FLOW_AS_RUN)
            else:
                cfg = resolve_config(named)
                if named is None:
                    notes.append(CLEAN_FIT_NOTE)
            arr = check_matrix(x, 'flow fit embeddings', min_rows=2)
            show = arr.shape[0] > 5000 if progress is None else progress
            result = fit_flow(arr, cfg, jax.random.key(seed), embed=embed, mesh=mesh,
                              progress=show, tb_dir=tb_dir)
        except FlowError as e:
            raise CalibrationError(str(e)) from None
        notes += [result.note] if result.note else []
        return cls(cfg, arr.shape[1], result.params, tuple(result.history), result.best_step,
                   '; '.join(notes))

    def _input(self, x: Any, what: str) -> np.ndarray:
        try:
            arr = check_matrix(x, what, min_rows=0)  # no rows: no rows back
        except FlowError as e:
            raise CalibrationError(str(e)) from None
        check_dim(arr, self.dim, self.spec or 'flow')
        return arr

    def apply(self, x: Any) -> np.ndarray:
        """Maps embeddings x [N, D] to the flow latent z [N, D] (float32 numpy)."""
        _, forward, _ = _jitted(self.config, self.dim)
        return _rowwise(lambda c: forward(self.params, c).z, self._input(x, 'embeddings'))

    def inverse(self, z: Any) -> np.ndarray:
        """Maps latents z [N, D] back to embeddings [N, D]."""
        _, _, inverse = _jitted(self.config, self.dim)
        return _rowwise(lambda c: inverse(self.params, c), self._input(z, 'latents'))

    def nll(self, x: Any) -> np.ndarray:
        """Per-row negative log-likelihood in nats, [N]."""
        _, forward, _ = _jitted(self.config, self.dim)
        return _rowwise(lambda c: nll_nats(*forward(self.params, c)), self._input(x, 'embeddings'))

    def describe(self) -> str:
        last = self.history[-1] if self.history else {}
        bpd = last.get('bpd', math.nan)
        fitted = f', {self.best_step} steps, {bpd:.3f} bits/dim' if last else ''
        return f'{self.spec or "flow"}: {self.config.describe()} on {self.dim} dims{fitted}'

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        history = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                    for k, v in h.items()} for h in self.history]
        meta = {'config': self.config.to_dict(), 'dim': self.dim, 'best_step': self.best_step,
                'history': history}
        flat = traverse_util.flatten_dict(jax.device_get(self.params), sep='/')
        return meta, {k: np.asarray(v, np.float32) for k, v in flat.items()}

    @classmethod
    def from_state(cls, meta, arrays) -> 'FlowCalibration':
        try:
            config = FlowConfig.from_dict(meta['config'])
            dim = int(meta['dim'])
            model, _, _ = _jitted(config, dim)
        except FlowError as e:
            raise ValueError(str(e)) from None
        abstract = jax.eval_shape(lambda: model.init(
            jax.random.key(0), np.zeros((1, dim), np.float32), method='forward'))['params']
        want = {k: v.shape for k, v in traverse_util.flatten_dict(abstract, sep='/').items()}
        got = {k: tuple(v.shape) for k, v in arrays.items()}
        if want != got:
            diff = sorted(set(want.items()) ^ set(got.items()))[:4]
            raise ValueError(f'the saved params do not match the flow of its config: {diff}')
        params = traverse_util.unflatten_dict(dict(arrays), sep='/')
        history = tuple({k: (math.nan if v is None else v) for k, v in h.items()}
                        for h in meta.get('history', []))
        return cls(config, dim, params, history, int(meta.get('best_step', 0)))
