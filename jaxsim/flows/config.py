"""Typed configuration of a normalizing flow and of its fitting loop.

The defaults are the BERT-flow reference (bohanli/BERT-flow, `flow/config/config_l2_d3_w32.json`):
Glow with 2 levels of depth 3, additive coupling, shift nets of width 32, Adam at lr 1e-3.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

ARCHITECTURES = ('glow', 'realnvp')
COUPLINGS = ('additive', 'affine')


@dataclasses.dataclass(frozen=True)
class FlowConfig:
    """Architecture and optimisation settings of a flow.

    Attributes:
      arch: 'glow' (multi-level, actnorm + invertible linear + coupling, split between levels) or
        'realnvp' (one level of affine couplings with alternating parity masks).
      levels: Glow levels; between two levels half of the channels go to the prior.
      depth: flow steps per Glow level.
      coupling: 'additive' (volume preserving, the reference) or 'affine'.
      width: hidden width of the coupling nets.
      hidden_layers: hidden Dense+ReLU layers in each coupling net.
      lu: parameterize the invertible linear map by an LU decomposition (Glow's O(D) logdet).
      num_couplings: number of affine couplings of the RealNVP (alternating masks).
      actnorm_in_realnvp: put an actnorm before each RealNVP coupling (RealNVP's batch-norm role).
      learning_rate: Adam learning rate.
      batch_size: examples per optimizer step.
      max_epochs: upper bound on passes over the training split.
      val_fraction: fraction of the rows held out for the early-stopping NLL.
      patience: stop after this many evaluations without a held-out improvement.
      evals_per_epoch: held-out evaluations per epoch (early stopping granularity).
      init_batch_size: rows used by the data-dependent actnorm initialisation.
    """

    arch: str = 'glow'
    levels: int = 2
    depth: int = 3
    coupling: str = 'additive'
    width: int = 32
    hidden_layers: int = 2
    lu: bool = True
    num_couplings: int = 6
    actnorm_in_realnvp: bool = True
    learning_rate: float = 1e-3
    batch_size: int = 64
    max_epochs: int = 1
    val_fraction: float = 0.1
    patience: int = 2
    evals_per_epoch: int = 4
    init_batch_size: int = 512

    def __post_init__(self):
        def check(ok: bool, msg: str):
            if not ok:
                raise ValueError(f'FlowConfig: {msg}')

        check(self.arch in ARCHITECTURES, f'arch={self.arch!r}, expected one of {ARCHITECTURES}')
        check(self.coupling in COUPLINGS,
              f'coupling={self.coupling!r}, expected one of {COUPLINGS}')
        check(self.levels >= 1, f'levels={self.levels} must be >= 1')
        check(self.depth >= 1, f'depth={self.depth} must be >= 1')
        check(self.width >= 1, f'width={self.width} must be >= 1')
        check(self.hidden_layers >= 1, f'hidden_layers={self.hidden_layers} must be >= 1')
        check(self.num_couplings >= 1, f'num_couplings={self.num_couplings} must be >= 1')
        check(self.learning_rate > 0, f'learning_rate={self.learning_rate} must be > 0')
        check(self.batch_size >= 1, f'batch_size={self.batch_size} must be >= 1')
        check(self.max_epochs >= 1, f'max_epochs={self.max_epochs} must be >= 1')
        check(0.0 <= self.val_fraction < 1.0,
              f'val_fraction={self.val_fraction} must be in [0, 1)')
        check(self.patience >= 1, f'patience={self.patience} must be >= 1')
        check(self.evals_per_epoch >= 1, f'evals_per_epoch={self.evals_per_epoch} must be >= 1')
        check(self.init_batch_size >= 2, f'init_batch_size={self.init_batch_size} must be >= 2')

    def min_dim(self) -> int:
        """Smallest embedding size the architecture accepts (every coupling needs 2 channels)."""
        return 2 ** (self.levels - 1) * 2 if self.arch == 'glow' else 2

    def check_dim(self, dim: int) -> None:
        """Raises ValueError if `dim` channels cannot go through this architecture."""
        if self.arch == 'glow':
            factor = 2 ** (self.levels - 1)
            # Each split halves the channels exactly, so D must divide by 2^(levels-1) and the
            # last level still needs two channels for its couplings.
            if dim % factor != 0 or dim // factor < 2:
                raise ValueError(
                    f'FlowConfig: a Glow with levels={self.levels} halves the channels '
                    f'{self.levels - 1} time(s), so the embedding size must be a multiple of '
                    f'{factor} and at least {2 * factor}; got {dim}.')
        elif dim < 2:
            raise ValueError(f'FlowConfig: a coupling needs at least 2 channels; got {dim}.')

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> 'FlowConfig':
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f'FlowConfig: unknown field(s) {unknown}')
        return cls(**d)

    def replace(self, **kw) -> 'FlowConfig':
        return dataclasses.replace(self, **kw)


def load_config_file(path) -> FlowConfig:
    """Runs `get_config()` of a config file such as `configs/flow_realnvp.py`."""
    import importlib.util
    import pathlib

    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f'{path}: flow config file not found')
    spec = importlib.util.spec_from_file_location(f'flow_config_{path.stem}', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    if not isinstance(config, FlowConfig):
        raise ValueError(f'{path}: get_config() must return a FlowConfig, got {type(config).__name__}')
    return config
