"""SimCSE training: config, optimizer, the sharded train step and the train/eval loop.

Layout (big_vision style, split by banners):
  config     `TrainConfig`, a frozen validated dataclass built from a configs/*.py ConfigDict.
  model      base encoder (pretrained or random), `SimCSEModel`, initial params.
  optimizer  AdamW with warmup + linear decay, clipping, no decay on biases/LayerNorm.
  step       `make_train_step`: jitted with explicit in/out shardings, state donated.
  eval       `make_encode_fn` + STS-B dev/test Spearman.
  loop       `train_and_evaluate(config, workdir)`.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxsim import sharding as sharding_lib
from jaxsim.paths import SENTEVAL_ROOT
from jaxsim.data import pipeline
from jaxsim.models.bert import BertConfig
from jaxsim.models.simcse import SimCSEModel, eval_pooler, init_params
from jaxsim.objectives import simcse as objectives
from jaxsim.train_state import TrainState

# Dropout masks must not depend on how arrays are laid out over devices: with partitionable
# threefry, random bits are a function of (key, global index) only.
jax.config.update('jax_threefry_partitionable', True)

log = logging.getLogger(__name__)

OBJECTIVES = ('unsup', 'sup')
DATA_FORMATS = ('text', 'csv', 'snli', 'senteval_corpus', 'tfds')
BEST_METRIC = 'stsb_dev'


# =============================================================================================
# Config.
# =============================================================================================

@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a SimCSE run needs; `configs/*.py` hold instances as ConfigDicts.

    Model:
      model: base model: HF folder, hub id, or 'bundled' (all-MiniLM-L6-v2 in the wheel).
      random_init: ignore the base weights, initialize randomly (architecture from
        `model_overrides` over the base config); the tokenizer still comes from `model`.
      model_overrides: BertConfig fields to override (e.g. a tiny test architecture).
      dropout: hidden and attention dropout (SimCSE's noise); < 0 keeps the base config's.
      pooler: training pooler; 'cls' adds the MLP head.
      mlp_only_train: drop the head at evaluation (unsupervised SimCSE).
      dtype: 'float32' or 'bfloat16' compute; master params are always float32.
    Objective: objective 'unsup'|'sup', temp, hard_negative_weight.
    Data: train_file, data_format ('text' one sentence per line, 'csv' sent0,sent1,hard_neg,
      'snli' a SentEval SNLI folder, 'senteval_corpus' sentences of the SentEval root's
      plain-text files (no STS), 'tfds' via tfds_*), snli_splits, max_examples (0 = all),
      max_len (fixed padded length).
    Optimization: batch_size is the GLOBAL batch (= negatives x grad_accum_steps), num_epochs
      or max_steps (> 0 wins), learning_rate, warmup_steps, weight_decay, max_grad_norm
      (0 = off), grad_accum_steps, adam_b1/b2/eps, seed.
    Mesh: mesh_data (-1 = all devices), mesh_fsdp, mesh_tensor.
    Eval/logging: senteval_root ('' = no STS-B eval), eval_every (0 = only at the end),
      eval_at_start, eval_max_len, eval_batch_size, eval_test, log_every, checkpoint,
      keep_checkpoints, resume, checkpoint_every (also save every N steps; 0 = only at eval
      steps and the end).
    fast_compile: compile with XLA -O0 (tiny test models: ~4x faster compiles, slower steps).
    """

    model: str = 'bundled'
    random_init: bool = False
    model_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    dropout: float = -1.0
    pooler: str = 'cls'
    mlp_only_train: bool = True
    dtype: str = 'float32'
    objective: str = 'unsup'
    temp: float = 0.05
    hard_negative_weight: float = 0.0
    train_file: str = ''
    data_format: str = 'text'
    snli_splits: Sequence[str] = ('dev', 'test')
    tfds_name: str = ''
    tfds_split: str = 'train'
    tfds_data_dir: str = ''
    tfds_fields: Sequence[str] = ('text',)
    max_examples: int = 0
    max_len: int = 32
    batch_size: int = 64
    num_epochs: float = 1.0
    max_steps: int = 0
    learning_rate: float = 3e-5
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    grad_accum_steps: int = 1
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    seed: int = 42
    mesh_data: int = -1
    mesh_fsdp: int = 1
    mesh_tensor: int = 1
    senteval_root: str = str(SENTEVAL_ROOT)
    eval_every: int = 125
    eval_at_start: bool = True
    eval_max_len: int = 128
    eval_batch_size: int = 128
    eval_test: bool = True
    log_every: int = 10
    checkpoint: bool = True
    keep_checkpoints: int = 2
    resume: bool = True
    checkpoint_every: int = 0
    fast_compile: bool = False

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f'train config: {msg}')
        if self.objective not in OBJECTIVES:
            bad(f'objective {self.objective!r} not in {OBJECTIVES}')
        if self.data_format not in DATA_FORMATS:
            bad(f'data_format {self.data_format!r} not in {DATA_FORMATS}')
        if self.dtype not in ('float32', 'bfloat16'):
            bad(f"dtype {self.dtype!r} must be 'float32' or 'bfloat16'")
        if self.data_format == 'tfds' and not self.tfds_name:
            bad("data_format 'tfds' needs tfds_name")
        if self.data_format != 'tfds' and not self.train_file:
            bad('train_file is empty')
        for name in ('batch_size', 'max_len', 'grad_accum_steps', 'eval_batch_size',
                     'eval_max_len', 'log_every', 'keep_checkpoints'):
            if getattr(self, name) < 1:
                bad(f'{name} must be >= 1, got {getattr(self, name)}')
        if self.batch_size % self.grad_accum_steps:
            bad(f'batch_size {self.batch_size} not divisible by grad_accum_steps '
                f'{self.grad_accum_steps}')
        if self.temp <= 0 or not math.isfinite(self.temp):
            bad(f'temp must be a positive number, got {self.temp}')
        if self.learning_rate < 0 or not math.isfinite(self.learning_rate):
            bad(f'learning_rate must be finite and >= 0, got {self.learning_rate}')
        if self.max_steps <= 0 and self.num_epochs <= 0:
            bad('set num_epochs > 0 or max_steps > 0')

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> 'TrainConfig':
        """Builds from a dict / ConfigDict; unknown keys are an error (catches typos)."""
        if hasattr(d, 'to_dict'):
            d = d.to_dict()
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f'train config: unknown keys {unknown}')
        d = dict(d)
        for k in ('snli_splits', 'tfds_fields'):
            if k in d:
                d[k] = tuple(d[k])
        if 'model_overrides' in d:
            d['model_overrides'] = dict(d['model_overrides'])
        return cls(**d)

    def to_json_dict(self) -> dict:
        d = dataclasses.asdict(self)
        return json.loads(json.dumps(d))

    @property
    def views(self) -> int:
        """Sentences per example in the batch arrays: 1 (unsup) or 3 (sup)."""
        return 1 if self.objective == 'unsup' else 3

    @property
    def eval_pooler(self) -> str:
        return eval_pooler(self.pooler, self.mlp_only_train)


def base_config():
    """A ConfigDict holding every TrainConfig field at its default: configs/*.py start here, so
    any field can be overridden with `--config.key=value` (and typos are rejected)."""
    import ml_collections
    d = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
         for f in dataclasses.fields(TrainConfig)}
    d['snli_splits'], d['tfds_fields'] = list(d['snli_splits']), list(d['tfds_fields'])
    # An empty dict would freeze as an empty ConfigDict; hold the BertConfig override keys.
    d['model_overrides'] = {}
    return ml_collections.ConfigDict(d)


# =============================================================================================
# Model.
# =============================================================================================

@dataclasses.dataclass(frozen=True)
class ModelBundle:
    """The module, its initial params (host) and the tokenizer."""

    module: SimCSEModel
    params: Any
    tokenizer: Any
    bert_config: BertConfig
    base_path: str


def _resolve_model(name: str) -> str:
    if name == 'bundled':
        from jaxsim.pretrained import bundled_model_path
        return str(bundled_model_path())
    return name


def build_model(cfg: TrainConfig) -> ModelBundle:
    """Loads the base encoder (or a random one) and builds the SimCSE module and params."""
    from jaxsim import pretrained as pretrained_lib
    base_path = _resolve_model(cfg.model)
    encoder_params = None
    if cfg.random_init:
        folder = Path(base_path)
        bert_config = BertConfig.from_json(folder / 'config.json')
        tokenizer = pretrained_lib.load_tokenizer(folder)
    else:
        pre = pretrained_lib.load_pretrained(base_path)
        bert_config, tokenizer, encoder_params = pre.config, pre.tokenizer, pre.params
    overrides = dict(cfg.model_overrides)
    if cfg.dropout >= 0:
        overrides.update(hidden_dropout_prob=cfg.dropout,
                         attention_probs_dropout_prob=cfg.dropout)
    if overrides:
        if not cfg.random_init and any(k not in ('hidden_dropout_prob',
                                                 'attention_probs_dropout_prob')
                                       for k in overrides):
            raise ValueError('model_overrides may change the architecture only with '
                             'random_init=True')
        bert_config = dataclasses.replace(bert_config, **overrides)
    dtype = jnp.bfloat16 if cfg.dtype == 'bfloat16' else jnp.float32
    module = SimCSEModel(bert_config, pooler=cfg.pooler, mlp_only_train=cfg.mlp_only_train,
                         dtype=dtype)
    key = jax.random.fold_in(jax.random.key(cfg.seed), 1)  # the 'init' use of the root key
    params = init_params(module, key, encoder_params)
    return ModelBundle(module, params, tokenizer, bert_config, base_path)


# =============================================================================================
# Optimizer.
# =============================================================================================

def make_schedule(cfg: TrainConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to `learning_rate`, then linear decay to 0 at `total_steps` (HF default)."""
    warmup = min(cfg.warmup_steps, total_steps)
    decay = optax.linear_schedule(cfg.learning_rate, 0.0, max(total_steps - warmup, 1))
    if warmup == 0:
        return decay
    return optax.join_schedules(
        [optax.linear_schedule(0.0, cfg.learning_rate, warmup), decay], [warmup])


def _decay_mask(params):
    """No weight decay on biases and LayerNorm scales (HF Trainer's rule)."""
    flat = traverse_util.flatten_dict(params, sep='/')
    return traverse_util.unflatten_dict(
        {k: not (k.endswith('bias') or 'LayerNorm' in k) for k in flat}, sep='/')


def make_optimizer(cfg: TrainConfig, total_steps: int) -> optax.GradientTransformation:
    """AdamW (+ optional global-norm clipping) with the warmup/linear-decay schedule."""
    parts = []
    if cfg.max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.max_grad_norm))
    parts.append(optax.adamw(make_schedule(cfg, total_steps), b1=cfg.adam_b1, b2=cfg.adam_b2,
                             eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                             mask=_decay_mask))
    return optax.chain(*parts)


# =============================================================================================
# State and shardings.
# =============================================================================================

def state_shardings(state_shape: TrainState, mesh) -> TrainState:
    """Shardings of every TrainState leaf: params by the rules table, opt state alike."""
    specs = sharding_lib.param_specs(state_shape.params, mesh)
    return TrainState(
        step=NamedSharding(mesh, P()),
        params=jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                            is_leaf=lambda x: isinstance(x, P)),
        opt_state=sharding_lib.tree_shardings(state_shape.opt_state, mesh, specs),
        rng=NamedSharding(mesh, P()))


def create_state(params, tx, cfg: TrainConfig, mesh) -> tuple[TrainState, TrainState]:
    """Places params on the mesh and builds the optimizer state there.

    Returns:
      (state, shardings) where shardings is a TrainState of NamedShardings.
    """
    rng = jax.random.key_data(jax.random.fold_in(jax.random.key(cfg.seed), 2))  # 'dropout' use

    def init(p):
        return TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=tx.init(p),
                          rng=rng)

    shape = jax.eval_shape(init, params)
    shardings = state_shardings(shape, mesh)
    params = jax.tree.map(lambda x, s: _put(np.asarray(x), s), params, shardings.params)
    state = jax.jit(init, out_shardings=shardings, compiler_options=compiler_options(cfg))(params)
    return state, shardings


def _put(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """Places a host array that every process holds in full (works multi-process)."""
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def batch_shardings(mesh, views: int) -> dict[str, NamedSharding]:
    return {k: sharding_lib.batch_sharding(mesh, 3)
            for k in ('input_ids', 'attention_mask', 'token_type_ids')}


# =============================================================================================
# Train step.
# =============================================================================================

def make_loss_fn(module: SimCSEModel, cfg: TrainConfig) -> Callable:
    """loss_fn(params, batch, key) -> (loss, aux) for one (micro-)batch.

    batch arrays are [B, views, L]. Unsupervised: each sentence is duplicated into rows 2i and
    2i+1 of ONE [2B, L] forward pass with ONE dropout key, so the two views get different
    masks (different rows) while each device's rows stay local (no resharding).
    """

    def loss_fn(params, batch, key):
        ids, mask, types = (batch['input_ids'], batch['attention_mask'],
                            batch['token_type_ids'])
        b, v, length = ids.shape
        if cfg.objective == 'unsup':
            ids, mask, types = (jnp.repeat(x, 2, axis=1) for x in (ids, mask, types))
            v = 2
        flat = lambda x: x.reshape(b * v, length)  # noqa: E731  [B * views, L]
        z = module.apply({'params': params}, flat(ids), flat(mask), flat(types), train=True,
                         rngs={'dropout': key})
        z = z.reshape(b, v, -1)  # [B, views, H]
        if cfg.objective == 'unsup':
            loss = objectives.unsup_simcse_loss(z[:, 0], z[:, 1], cfg.temp)
        else:
            loss = objectives.sup_simcse_loss(z[:, 0], z[:, 1], z[:, 2], cfg.temp,
                                              cfg.hard_negative_weight)
        zs = jax.lax.stop_gradient(z)
        aux = {'align': objectives.alignment(zs[:, 0], zs[:, 1]),
               'uniform': objectives.uniformity(zs[:, 0])}
        return loss, aux

    return loss_fn


def compiler_options(cfg: TrainConfig) -> dict | None:
    return {'xla_backend_optimization_level': 0} if cfg.fast_compile else None


def make_train_step(module: SimCSEModel, tx: optax.GradientTransformation, cfg: TrainConfig,
                    mesh, shardings: TrainState, total_steps: int) -> Callable:
    """The jitted `train_step(state, batch) -> (state, metrics)`.

    The step's dropout key is `fold_in(state.rng, state.step)`, so a run is a pure function of
    (config, seed, data order), whatever the mesh. With `grad_accum_steps` A > 1 the global batch
    is split into A micro-batches (rows i, i+A, ... form micro-batch i, so every device keeps
    its share); gradients are averaged, one optimizer update is applied, and negatives come
    from the micro-batch. A non-finite loss or gradient leaves the state unchanged (step
    included), so the host can stop with the last good state intact.
    """
    loss_fn = make_loss_fn(module, cfg)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    schedule = make_schedule(cfg, total_steps)
    accum = cfg.grad_accum_steps

    def train_step(state: TrainState, batch):
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        if accum == 1:
            (loss, aux), grads = grad_fn(state.params, batch, key)
        else:
            def split(x):  # [B, ...] -> [A, B/A, ...], micro-batch i = rows i::A
                x = x.reshape((x.shape[0] // accum, accum) + x.shape[1:]).swapaxes(0, 1)
                return jax.lax.with_sharding_constraint(
                    x, NamedSharding(mesh, P(None, ('data', 'fsdp'), *([None] * (x.ndim - 2)))))
            micro = jax.tree.map(split, batch)

            def body(carry, xs):
                i, mb = xs
                (l, a), g = grad_fn(state.params, mb, jax.random.fold_in(key, i))
                acc_g, acc_l, acc_a = carry
                return (jax.tree.map(jnp.add, acc_g, g), acc_l + l,
                        jax.tree.map(jnp.add, acc_a, a)), None

            zeros = jax.tree.map(jnp.zeros_like, state.params)
            init = (zeros, jnp.zeros((), jnp.float32),
                    {'align': jnp.zeros((), jnp.float32), 'uniform': jnp.zeros((), jnp.float32)})
            (grads, loss, aux), _ = jax.lax.scan(body, init, (jnp.arange(accum), micro))
            grads = jax.tree.map(lambda g: g / accum, grads)
            loss = loss / accum
            aux = jax.tree.map(lambda a: a / accum, aux)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        new = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        new = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, state)
        metrics = {'loss': loss, 'grad_norm': grad_norm, 'lr': schedule(state.step),
                   **aux}
        return new, metrics

    bs = batch_shardings(mesh, cfg.views)
    return jax.jit(train_step, in_shardings=(shardings, bs),
                   out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=0,
                   compiler_options=compiler_options(cfg))


# =============================================================================================
# Evaluation.
# =============================================================================================

def make_encode_fn(module: SimCSEModel, tokenizer, mesh, max_len: int = 128,
                   batch_size: int = 128, options: dict | None = None) -> Callable:
    """encode(params, sentences) -> [N, H] float32 numpy, in input order, deterministic.

    Sentences are sorted by length and padded per batch to a multiple of 16 (few compiled
    shapes, little padding); every batch has `batch_size` rows (fixed shape; padding rows are
    dropped). Every process must call it with the same sentences.
    """
    shards = sharding_lib.batch_shards(mesh)
    if batch_size % shards:
        raise ValueError(f'eval_batch_size {batch_size} not divisible by {shards} batch shards')
    in_sh = NamedSharding(mesh, P(('data', 'fsdp'), None))

    @functools.partial(jax.jit, compiler_options=options)
    def apply(params, ids, mask):
        z = module.apply({'params': params}, ids, mask, jnp.zeros_like(ids), train=False)
        return jax.lax.with_sharding_constraint(z, NamedSharding(mesh, P()))

    def encode(params, sentences: Sequence[str]) -> np.ndarray:
        for i, s in enumerate(sentences):
            if not isinstance(s, str) or not s.strip():
                raise ValueError(f'encode: sentence {i} is empty')
        enc = tokenizer(list(sentences), max_length=max_len, truncation=True)
        ids_list = enc['input_ids']
        order = np.argsort([len(x) for x in ids_list], kind='stable')
        out = np.zeros((len(sentences), module.config.hidden_size), np.float32)
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            longest = max(len(ids_list[i]) for i in idx)
            length = min(max_len, -(-longest // 16) * 16)
            ids = np.full((batch_size, length), module.config.pad_token_id, np.int32)
            mask = np.zeros((batch_size, length), np.int32)
            for r, i in enumerate(idx):
                ids[r, :len(ids_list[i])] = ids_list[i]
                mask[r, :len(ids_list[i])] = 1
            z = apply(params, _put(ids, in_sh), _put(mask, in_sh))
            out[idx] = np.asarray(z)[:len(idx)]
        return out

    return encode


def spearman_x100(emb1: np.ndarray, emb2: np.ndarray, gold: np.ndarray) -> float:
    """Cosine then Spearman x100 (the EVAL engineer's jaxsim.eval.sts when present)."""
    try:
        from jaxsim.eval.sts import spearman_x100 as fn
    except ImportError:
        import scipy.stats
        a = emb1 / np.maximum(np.linalg.norm(emb1, axis=1, keepdims=True), 1e-12)
        b = emb2 / np.maximum(np.linalg.norm(emb2, axis=1, keepdims=True), 1e-12)
        return float(scipy.stats.spearmanr(np.sum(a * b, axis=1), gold).correlation * 100)
    return float(fn(emb1, emb2, gold))


def stsb_score(encode: Callable, params, pairs) -> float:
    """STS-B Spearman x100 of one split (sentences encoded once, deduplicated)."""
    unique = sorted(set(pairs.sent1) | set(pairs.sent2))
    emb = encode(params, unique)
    pos = {s: i for i, s in enumerate(unique)}
    e1 = emb[[pos[s] for s in pairs.sent1]]
    e2 = emb[[pos[s] for s in pairs.sent2]]
    return spearman_x100(e1, e2, np.asarray(pairs.gold))


# =============================================================================================
# Data.
# =============================================================================================

def load_examples(cfg: TrainConfig) -> tuple[list, str]:
    """Reads the training examples named by the config (strings, or 3-tuples for sup)."""
    if cfg.data_format == 'tfds':
        rows = pipeline.read_tfds(cfg.tfds_name, cfg.tfds_split, cfg.tfds_data_dir or None,
                                  cfg.tfds_fields)
        source = f'tfds:{cfg.tfds_name}/{cfg.tfds_split}'
        if cfg.views == 1:
            rows = [r[0] for r in rows]
    elif cfg.data_format == 'text':
        rows, source = pipeline.read_corpus(cfg.train_file), cfg.train_file
    elif cfg.data_format == 'csv':
        rows, source = pipeline.read_nli_csv(cfg.train_file), cfg.train_file
    elif cfg.data_format == 'senteval_corpus':
        rows = pipeline.collect_corpus(cfg.train_file)
        source = f'{cfg.train_file} ({len(pipeline.CORPUS_FILES)} SentEval text files)'
    else:
        rows = pipeline.build_snli_triplets(cfg.train_file, cfg.snli_splits)
        source = f'{cfg.train_file} ({",".join(cfg.snli_splits)})'
    want_views = cfg.views
    got_views = 1 if isinstance(rows[0], str) else len(rows[0])
    if got_views != want_views:
        raise pipeline.DataError(f'{source}: objective {cfg.objective!r} needs {want_views} '
                                 f'sentence(s) per example, the data has {got_views}')
    if cfg.max_examples > 0:
        rows = rows[:cfg.max_examples]
    return rows, source


def total_steps_for(cfg: TrainConfig, num_examples: int) -> int:
    if cfg.max_steps > 0:
        return cfg.max_steps
    return max(1, int(num_examples // cfg.batch_size * cfg.num_epochs))


# =============================================================================================
# Checkpoint seam (jaxsim.checkpoint by the checkpoint engineer).
# =============================================================================================

def _open_checkpointer(workdir: Path, cfg: TrainConfig, has_eval: bool):
    from jaxsim import checkpoint as ckpt_lib
    options = ckpt_lib.CheckpointOptions(
        max_to_keep=cfg.keep_checkpoints, best_metric=BEST_METRIC if has_eval else None,
        keep_best=1 if has_eval else 0)
    return ckpt_lib.Checkpointer(workdir / ckpt_lib.CHECKPOINT_DIR, options)


# =============================================================================================
# Loop.
# =============================================================================================

@dataclasses.dataclass
class TrainResult:
    """Summary of a run (also written to WORKDIR/result.json)."""

    steps: int
    final_loss: float
    best_step: int | None
    best_dev: float | None
    test_at_best: float | None
    dev_curve: list
    wall_s: float
    stopped: str | None = None


class _Writers:
    """metrics.jsonl + TensorBoard, on the main process only."""

    def __init__(self, workdir: Path, enabled: bool):
        self.enabled = enabled
        self.jsonl = (workdir / 'metrics.jsonl').open('a') if enabled else None
        self.tb = None
        if enabled:
            try:
                from tensorboardX import SummaryWriter
                self.tb = SummaryWriter(str(workdir / 'tb'))
            except ImportError:  # optional: metrics.jsonl is the record
                log.warning('tensorboardX not installed; TensorBoard logging off')

    def write(self, step: int, metrics: Mapping[str, float]):
        if not self.enabled:
            return
        self.jsonl.write(json.dumps({'step': int(step), **{k: float(v) for k, v in
                                                          metrics.items()}}) + '\n')
        self.jsonl.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, float(v), int(step))

    def close(self):
        if self.enabled:
            self.jsonl.close()
            if self.tb is not None:
                self.tb.close()


def _save_base_model(bundle: ModelBundle, workdir: Path) -> str:
    """For random-init runs: write the initial encoder as an HF folder so the workdir is
    self-describing (`load_pretrained_from_workdir` needs a base architecture + tokenizer)."""
    from safetensors.numpy import save_file

    from jaxsim.convert.hf_bert import params_to_hf
    from jaxsim.models.simcse import to_bert_params
    folder = workdir / 'base_model'
    folder.mkdir(parents=True, exist_ok=True)
    (folder / 'config.json').write_text(json.dumps(bundle.bert_config.to_hf_dict(), indent=1))
    tensors = params_to_hf(to_bert_params(bundle.params), bundle.bert_config)
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()},
              str(folder / 'model.safetensors'))
    bundle.tokenizer.save_pretrained(str(folder))
    return str(folder.absolute())


def train_and_evaluate(config: TrainConfig | Mapping, workdir: str | Path,
                       progress: bool = True) -> TrainResult:
    """Trains SimCSE as configured, evaluating STS-B dev every `eval_every` steps.

    Writes WORKDIR/config.json, metrics.jsonl, tb/, checkpoints/ (last K + best by STS-B dev)
    and result.json. Resumes from the latest checkpoint in WORKDIR when `resume`. All inputs
    are validated (and data read/tokenized) before anything is traced.
    """
    t0 = time.time()
    cfg = config if isinstance(config, TrainConfig) else TrainConfig.from_dict(config)
    workdir = Path(workdir)
    main = jax.process_index() == 0
    if main:
        workdir.mkdir(parents=True, exist_ok=True)

    # --- data (host, before any tracing) ---
    rows, source = load_examples(cfg)
    bundle = build_model(cfg)
    arrays = pipeline.tokenize_examples(bundle.tokenizer, rows, cfg.max_len, source)
    mesh = sharding_lib.make_mesh(cfg.mesh_data, cfg.mesh_fsdp, cfg.mesh_tensor)
    sharding_lib.check_global_batch(cfg.batch_size, mesh, cfg.grad_accum_steps)
    it = pipeline.BatchIterator(arrays, cfg.batch_size, seed=cfg.seed,
                                process_index=jax.process_index(),
                                process_count=jax.process_count())
    total = total_steps_for(cfg, it.num_examples)
    has_eval = cfg.eval_every >= 0 and bool(cfg.senteval_root)
    dev = test = None
    if has_eval:
        from jaxsim.data.senteval import load_stsb
        dev = load_stsb(cfg.senteval_root, 'dev')
        test = load_stsb(cfg.senteval_root, 'test') if cfg.eval_test else None

    record = cfg.to_json_dict()
    record['model'] = (_save_base_model(bundle, workdir) if cfg.random_init and main
                       else bundle.base_path)
    record.update(total_steps=total, num_examples=it.num_examples, data_source=source,
                  devices=jax.device_count(), processes=jax.process_count(),
                  mesh=dict(mesh.shape))
    if main:
        (workdir / 'config.json').write_text(json.dumps(record, indent=1))

    tx = make_optimizer(cfg, total)
    state, shardings = create_state(bundle.params, tx, cfg, mesh)
    train_step = make_train_step(bundle.module, tx, cfg, mesh, shardings, total)
    bs = batch_shardings(mesh, cfg.views)
    encode = make_encode_fn(bundle.module, bundle.tokenizer, mesh, cfg.eval_max_len,
                            cfg.eval_batch_size, compiler_options(cfg)) if has_eval else None

    ckpt = _open_checkpointer(workdir, cfg, has_eval) if cfg.checkpoint else None
    dev_curve, best = [], (None, -math.inf, None)  # (step, dev, host params)
    if ckpt is not None and cfg.resume and ckpt.latest_step() is not None:
        from jaxsim.checkpoint import abstract_target
        target = abstract_target(jax.eval_shape(lambda s: s, state), shardings)
        restored = ckpt.restore('latest', target)
        state = restored.state
        it.set_state(restored.data['iterator'])
        log.info('resumed from step %d', restored.step)
        if ckpt.best_step() is not None and has_eval:
            m = ckpt.metrics(ckpt.best_step()) or {}
            if BEST_METRIC in m:
                b = ckpt.restore(ckpt.best_step(), target)
                best = (b.step, m[BEST_METRIC], jax.tree.map(np.asarray, b.state.params))
    writers = _Writers(workdir, main)

    def evaluate(step):
        nonlocal best
        score = stsb_score(encode, state.params, dev)
        dev_curve.append((int(step), score))
        writers.write(step, {BEST_METRIC: score})
        if score > best[1]:
            best = (int(step), score, jax.tree.map(np.asarray, state.params))
        return score

    def save(step, metrics=None):
        if ckpt is not None:
            ckpt.save(int(step), state, data={'iterator': it.get_state()}, config=record,
                      metrics=metrics)

    step = int(state.step)
    if has_eval and cfg.eval_at_start and step == 0:
        # Checkpointed too: selection on dev may pick "no training" (e.g. an already strong
        # base model), and `eval.py --model WORKDIR` must then get the base weights.
        save(0, {BEST_METRIC: evaluate(0)})
    bar = None
    if progress and main:
        from tqdm import tqdm
        bar = tqdm(total=total, initial=step, desc='train', dynamic_ncols=True)
    pending, last_loss, stopped = [], float('nan'), None
    while step < total:
        batch = pipeline.to_global(next(it), bs, cfg.batch_size)
        state, metrics = train_step(state, batch)
        step += 1
        pending.append((step, metrics))
        is_eval = has_eval and ((cfg.eval_every > 0 and step % cfg.eval_every == 0)
                                or step == total)
        # A checkpoint must follow the log of its own step, or a resume would lose that loss.
        will_save = is_eval or step == total or (
            cfg.checkpoint_every > 0 and step % cfg.checkpoint_every == 0)
        # Host reads lag one step behind dispatch, so the device never idles on logging.
        while len(pending) > 1 or (pending and will_save):
            s, m = pending.pop(0)
            m = {k: float(v) for k, v in jax.device_get(m).items()}
            if not math.isfinite(m['loss']) or not math.isfinite(m['grad_norm']):
                stopped = (f'non-finite loss/grad at step {s} (loss={m["loss"]}, grad_norm='
                           f'{m["grad_norm"]}); stopped, last good checkpoint kept')
                break
            last_loss = m['loss']
            if s % cfg.log_every == 0 or s == total:
                writers.write(s, m)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f'{m["loss"]:.4f}')
        if stopped:
            log.error(stopped)
            break
        if is_eval:
            score = evaluate(step)
            save(step, {BEST_METRIC: score})
        elif will_save:
            save(step)
    if bar is not None:
        bar.close()
    if ckpt is not None:
        ckpt.close()
    test_at_best = None
    if has_eval and test is not None and best[2] is not None and not stopped:
        test_at_best = stsb_score(encode, best[2], test)
        writers.write(best[0], {'stsb_test_at_best': test_at_best})
    writers.close()
    result = TrainResult(steps=step, final_loss=last_loss, best_step=best[0],
                         best_dev=None if best[0] is None else best[1],
                         test_at_best=test_at_best, dev_curve=dev_curve,
                         wall_s=time.time() - t0, stopped=stopped)
    if main:
        (workdir / 'result.json').write_text(json.dumps(dataclasses.asdict(result), indent=1))
    return result


def run_seeds(config: TrainConfig | Mapping, workdir: str | Path, seeds: Sequence[int],
              progress: bool = True) -> dict:
    """Runs the config once per seed (WORKDIR/seed_N) and reports mean and std of the scores.

    Seed variance (about 2 points for SimCSE) is the usual reproduction complaint, so the
    summary gives mean, sample std and every run's best STS-B dev and test-at-best.
    Writes WORKDIR/seeds_summary.json.
    """
    cfg = config if isinstance(config, TrainConfig) else TrainConfig.from_dict(config)
    workdir = Path(workdir)
    runs = {}
    for seed in seeds:
        r = train_and_evaluate(dataclasses.replace(cfg, seed=int(seed)),
                               workdir / f'seed_{seed}', progress=progress)
        runs[int(seed)] = dataclasses.asdict(r)

    def stats(key):
        vals = [r[key] for r in runs.values() if r[key] is not None]
        if not vals:
            return None
        return {'mean': float(np.mean(vals)),
                'std': float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0, 'n': len(vals),
                'values': vals}

    summary = {'seeds': [int(s) for s in seeds], 'stsb_dev_best': stats('best_dev'),
               'stsb_test_at_best': stats('test_at_best'), 'final_loss': stats('final_loss'),
               'runs': runs}
    if jax.process_index() == 0:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / 'seeds_summary.json').write_text(json.dumps(summary, indent=1))
    return summary


def format_seed_summary(summary: Mapping) -> str:
    lines = [f"seeds {summary['seeds']}"]
    for key in ('stsb_dev_best', 'stsb_test_at_best', 'final_loss'):
        s = summary.get(key)
        if s:
            lines.append(f"  {key:18s} {s['mean']:.2f} +- {s['std']:.2f}  "
                         f"({', '.join(f'{v:.2f}' for v in s['values'])})")
    return '\n'.join(lines)
