"""Typed configuration of a flow (layers by registry name) and of its fitting loop.

A flow is `levels` levels of `depth` steps; a step is a sequence of registered layers
(`FLOW_LAYERS`); between two levels the second half of the channels is factored out to the
standard-normal prior (Glow's multi-scale split). The defaults are BERT-flow as its code
executes it (bohanli/BERT-flow `run_siamese.py` with `flow/config/config_l3_d3_w32.json`); see
configs/flow_bert_flow.py for the reasoning behind each value.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from jaxsim.config_module import run_get_config
from jaxsim.errors import JaxsimError
from jaxsim.flows import couplings  # noqa: F401  (registers the coupling layers)
from jaxsim.flows.layers import FLOW_LAYERS
from jaxsim.registry import IMPORT_HINT

OBJECTIVES = ('bits_per_dim', 'nats')
OPTIMIZERS = ('bert_adamw', 'adam')
_SCALARS = (str, int, float, bool, type(None))


class FlowError(JaxsimError):
    """A flow config, input or fit that cannot work (the message says which and why)."""


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One layer of a flow step: a `FLOW_LAYERS` name and its constructor options."""

    layer: str
    # Sorted (name, value) pairs of JSON scalars (hashable, so configs are too).
    options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        if not isinstance(self.layer, str) or not self.layer:
            raise FlowError(f'flow layer name must be a non-empty string, got {self.layer!r}')
        for item in self.options:
            if (not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], str)
                    or not isinstance(item[1], _SCALARS)):
                raise FlowError(f'flow layer {self.layer!r}: options must be (name, scalar) '
                                f'pairs, got {item!r}')

    def kwargs(self) -> dict[str, Any]:
        return dict(self.options)

    def to_dict(self) -> dict[str, Any]:
        return {'layer': self.layer, 'options': self.kwargs()}


def layer(name: str, **options) -> LayerSpec:
    """`layer('actnorm', initialization='data')` -> LayerSpec: how configs list a step."""
    return LayerSpec(name, tuple(sorted(options.items())))


BERT_FLOW_STEP = (
    layer('actnorm', initialization='tf_default', logscale_factor=3.0, bias='input'),
    layer('reverse'),
    layer('additive_coupling', width=32, hidden_layers=2, net='glow'),
)


@dataclasses.dataclass(frozen=True)
class FlowConfig:
    """Architecture and fitting settings of a flow.

    Attributes:
      name: short label used in descriptions.
      levels: multi-scale levels; between two levels half of the channels go to the prior.
      depth: steps per level.
      step: the layers of one step, applied in order (each `features=` the level's width).
      data_init: before training, run `init_from_batch` of the layers that have one (actnorm
        init='data') on `init_batch_size` rows.
      init_batch_size: rows of the data-dependent initialisation.
      objective: 'bits_per_dim' (NLL / (D ln 2), BERT-flow) or 'nats' (NLL per row).
      loss_scale: the loss is loss_scale * the batch mean of the objective (BERT-flow adds the
        means of the two sentences of its pairs: 2).
      optimizer: 'bert_adamw' (BERT's AdamWeightDecayOptimizer: no bias correction, decoupled
        weight decay) or 'adam' (optax.adam; weight_decay > 0 makes it AdamW).
      learning_rate: constant learning rate.
      weight_decay: decoupled weight-decay rate.
      weight_decay_exclude: regexes on '/'-joined param paths exempt from weight decay.
      adam_eps: epsilon added to sqrt(v).
      clip_norm: clip gradients to this global norm (0: no clipping).
      batch_size: rows per optimizer step (the global batch, split over the mesh).
      max_epochs: passes over the rows.
      val_fraction: rows held out for early stopping (0: none, fit on everything).
      patience: stop after this many held-out evaluations without improvement.
      evals_per_epoch: held-out evaluations per epoch.
      dropout_noise: fit on dropout-noised embeddings, fresh each epoch, from the `embed`
        callable the caller passes (the encoder in train mode, as BERT-flow trains).
    """

    name: str = 'bert_flow'
    levels: int = 3
    depth: int = 3
    step: tuple[LayerSpec, ...] = BERT_FLOW_STEP
    data_init: bool = False
    init_batch_size: int = 512
    objective: str = 'bits_per_dim'
    loss_scale: float = 2.0
    optimizer: str = 'bert_adamw'
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    weight_decay_exclude: tuple[str, ...] = ()
    adam_eps: float = 1e-6
    clip_norm: float = 1.0
    batch_size: int = 64
    max_epochs: int = 1
    val_fraction: float = 0.0
    patience: int = 2
    evals_per_epoch: int = 1
    dropout_noise: bool = False

    def __post_init__(self):
        def check(ok: bool, msg: str):
            if not ok:
                raise FlowError(f'FlowConfig: {msg}')

        check(isinstance(self.step, tuple) and len(self.step) > 0
              and all(isinstance(s, LayerSpec) for s in self.step),
              'step must be a non-empty tuple of LayerSpec (use flows.layer(name, **options))')
        for s in self.step:
            check(s.layer in FLOW_LAYERS, f'unknown flow layer {s.layer!r}; registered: '
                  f'{", ".join(FLOW_LAYERS.names())} (register yours with '
                  f'@FLOW_LAYERS.register before building the config; {IMPORT_HINT})')
        check(self.levels >= 1, f'levels={self.levels} must be >= 1')
        check(self.depth >= 1, f'depth={self.depth} must be >= 1')
        check(self.objective in OBJECTIVES, f'objective={self.objective!r}, expected one of '
              f'{OBJECTIVES}')
        check(self.optimizer in OPTIMIZERS, f'optimizer={self.optimizer!r}, expected one of '
              f'{OPTIMIZERS}')
        check(self.loss_scale > 0, f'loss_scale={self.loss_scale} must be > 0')
        check(self.learning_rate > 0, f'learning_rate={self.learning_rate} must be > 0')
        check(self.weight_decay >= 0, f'weight_decay={self.weight_decay} must be >= 0')
        check(self.adam_eps > 0, f'adam_eps={self.adam_eps} must be > 0')
        check(self.clip_norm >= 0, f'clip_norm={self.clip_norm} must be >= 0 (0: off)')
        check(self.batch_size >= 2, f'batch_size={self.batch_size} must be >= 2')
        check(self.max_epochs >= 1, f'max_epochs={self.max_epochs} must be >= 1')
        check(0.0 <= self.val_fraction < 1.0,
              f'val_fraction={self.val_fraction} must be in [0, 1)')
        check(self.patience >= 1, f'patience={self.patience} must be >= 1')
        check(self.evals_per_epoch >= 1, f'evals_per_epoch={self.evals_per_epoch} must be >= 1')
        check(self.init_batch_size >= 2, f'init_batch_size={self.init_batch_size} must be >= 2')

    def level_dims(self, dim: int) -> list[int]:
        """Channels at each level: dim, dim/2, ..., dim/2^(levels-1)."""
        return [dim // 2 ** level for level in range(self.levels)]

    def check_dim(self, dim: int) -> None:
        """Raises FlowError if `dim` channels cannot go through the levels' splits."""
        factor = 2 ** (self.levels - 1)
        # Each split halves the channels exactly, and the last level's couplings still need
        # two channels.
        if dim % factor != 0 or dim // factor < 2:
            raise FlowError(
                f'FlowConfig {self.name!r}: {self.levels} level(s) halve the channels '
                f'{self.levels - 1} time(s), so the embedding size must be a multiple of '
                f'{factor} and at least {2 * factor}; got {dim}.')

    def describe(self) -> str:
        layers = '+'.join(s.layer for s in self.step)
        return f'{self.name} ({self.levels}x{self.depth} steps of {layers})'

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), 'step': [s.to_dict() for s in self.step],
                'weight_decay_exclude': list(self.weight_decay_exclude)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> 'FlowConfig':
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise FlowError(f'FlowConfig: unknown field(s) {unknown}')
        d = dict(d)
        try:
            if 'step' in d:
                d['step'] = tuple(layer(s['layer'], **s.get('options', {})) for s in d['step'])
            if 'weight_decay_exclude' in d:
                d['weight_decay_exclude'] = tuple(d['weight_decay_exclude'])
        except (TypeError, KeyError) as e:
            raise FlowError(f'FlowConfig: malformed step list ({e!r})') from None
        return cls(**d)

    def replace(self, **kw) -> 'FlowConfig':
        return dataclasses.replace(self, **kw)


def load_config_file(path) -> FlowConfig:
    """Runs `get_config()` of a config file such as `configs/flow_glow.py`."""
    path = pathlib.Path(path)
    config = run_get_config(path, FlowError, 'flow config')
    if not isinstance(config, FlowConfig):
        raise FlowError(f'{path}: get_config() must return a FlowConfig, got '
                        f'{type(config).__name__}')
    return config
