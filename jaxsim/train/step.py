"""The train step: one pure, jitted, sharded update for any registered objective.

`train_step(state, batch) -> (state, metrics)` is compiled with explicit in/out shardings and
the state donated. The batch arrays are [batch, sentences per example, len] and sharded over
the mesh's batch axes; the objective's loss sees the vectors of the GLOBAL batch (XLA gathers
them), so in-batch negatives come from every device.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsim import compile_options
from jaxsim import sharding as sharding_lib
from jaxsim.data.batching import FIELDS
from jaxsim.data.packing import PACK_INDEX, PACKED_FIELDS, UNPACK_INDEX
from jaxsim.errors import ConfigError
from jaxsim.models import st_head
from jaxsim.models.bert import BertLayer
from jaxsim.models.encoder import SentenceEncoder
from jaxsim.objectives import owned
from jaxsim.objectives.base import LossFn, ObjectiveError, with_context
from jaxsim.objectives.mlm import MlmSettings, mlm_term
from jaxsim.train.config import PRNG_IMPLS
from jaxsim.train.grad_cache import make_cached_grad_fn
from jaxsim.train.sharded_update import make_sharded_update
from jaxsim.train.state import TrainState

Batch = Mapping[str, jax.Array]


def configure_jax() -> None:
    """Process-wide JAX settings training relies on; entry points call it first.

    With partitionable threefry, random bits are a function of (key, global index) only, so
    dropout masks do not depend on how arrays are laid out over devices: a run gives the same
    numbers on 1 device and on any mesh, and resumes exactly onto another mesh.
    """
    jax.config.update('jax_threefry_partitionable', True)


def check_jax_configured() -> None:
    if not jax.config.jax_threefry_partitionable:
        raise RuntimeError('jax_threefry_partitionable is off: dropout masks would depend on the '
                           'device mesh; call jaxsim.train.step.configure_jax() first')


def dropout_key(root_key: jax.Array, prng_impl: str = 'threefry2x32') -> jax.Array:
    """The run's dropout key (the root key's 'dropout' use), of the PRNG implementation
    `prng_impl`: threefry2x32 (masks independent of the mesh, see `configure_jax`), or rbg /
    unsafe_rbg, XLA's RngBitGenerator: faster on TPU, slower on XLA:CPU, and masks that depend
    on the mesh, so a run is reproducible on the same mesh only.
    """
    if prng_impl not in PRNG_IMPLS:
        raise ValueError(f'unknown prng_impl {prng_impl!r}; known: {", ".join(PRNG_IMPLS)}')
    key = jax.random.fold_in(root_key, 2)
    if prng_impl == 'threefry2x32':
        return key
    # An rbg key holds 4 words: two threefry draws of the root key.
    data = jnp.concatenate([jax.random.key_data(key),
                            jax.random.key_data(jax.random.fold_in(root_key, 3))])
    return jax.random.wrap_key_data(data, impl=prng_impl)


def compiler_options(fast_compile: bool) -> Optional[dict]:
    """The cheapest compile on CPU for tiny test models (compile time dominates their runs),
    else XLA's defaults."""
    return compile_options.for_effort(jax.local_devices(), 'none' if fast_compile else 'default')


def encode_views(encoder: SentenceEncoder, params: Any, batch: Batch, key: jax.Array,
                 views: int, head: Sequence = ()) -> jax.Array:
    """Sentence vectors [B, V, H] float32 of every view of every example, in training mode.

    `batch` holds [B, D, L] int32 arrays; D is `views`, or 1 (each sentence then repeated
    `views` times, the views differing only by their dropout masks: unsupervised SimCSE).
    `head`: a sentence-transformers folder's modules after pooling (`jaxsim.models.st_head`),
    applied to the pooled vectors, their Dense weights under params['st_head'].
    """
    if head:  # its Dense weights ride in params beside the encoder's; a plain step has none
        params, weights = st_head.split_weights(params)
    ids = batch['input_ids']
    b, d, length = ids.shape
    if d not in (1, views):
        raise ObjectiveError(f'batch has {d} sentences per example, the objective takes {views}')
    arrays = [batch[k] for k in FIELDS]
    if d == 1 and views > 1:
        # Copies of a sentence sit in adjacent rows (2i, 2i+1 for V=2), so each device keeps
        # its own rows: no resharding. ONE forward pass with ONE key gives the copies different
        # dropout masks, since the bits differ by row.
        arrays = [jnp.repeat(x, views, axis=1) for x in arrays]
    ids, mask, types = (x.reshape(b * views, length) for x in arrays)  # [B * V, L]
    packing = None
    if PACK_INDEX in batch:  # the padded rows' packed layout (jaxsim.data.packing)
        packing = (batch[PACK_INDEX], batch[UNPACK_INDEX].reshape(b * views, length))
    z = encoder.apply({'params': params}, ids, mask, types, train=True,
                      rngs={'dropout': key}, packing=packing)
    if head:
        z = st_head.apply_jax(head, weights, z)
    return z.reshape(b, views, -1).astype(jnp.float32)  # [B, V, H]


def rows_stay_on_their_devices(mesh: Mesh):
    """A context in which each transformer layer's input and output keep the batch's sharding
    (rows over ('data', 'fsdp'), as the batch arrives).

    Without it the partitioner may follow the parameters' sharding instead: with fsdp it
    contracted over the sharded 'embed' dimension and all-reduced the whole global batch's
    activations on every device, where gathering each layer's weights moves far less. Meshes
    with a tensor axis are left to the partitioner: there the layers' products are split by
    heads and columns, and forcing rows clashes with a vocabulary-split embedding table.
    """
    rows = lambda x: jax.lax.with_sharding_constraint(  # noqa: E731
        x, sharding_lib.batch_sharding(mesh, x.ndim))

    def keep_rows(next_fun, args, kwargs, context):
        if (context.method_name != '__call__' or sharding_lib.tensor_parallel(mesh)
                or not isinstance(context.module, BertLayer)):
            return next_fun(*args, **kwargs)
        return rows(next_fun(rows(args[0]), *args[1:], **kwargs))

    return nn.intercept_methods(keep_rows)


def make_loss_fn(encoder: SentenceEncoder, loss: LossFn, views: int,
                 mlm: Optional[MlmSettings] = None, head: Sequence = ()) -> Callable:
    """`loss_fn(params, batch, key, step=None) -> (loss, aux)`: encode the views, apply the
    objective, plus `mlm.weight` x the masked-LM term on masked copies of the same sentences
    (aux 'mlm'). An objective that names `ids`, `step` or `key` also gets the batch's token ids,
    the step and a key of its own (`jaxsim.objectives.with_context`). `params` is the trainable
    tree: the encoder's parameters, the weights of `head` (see `encode_views`) under 'st_head'
    and, under 'objective', those the objective owns (its `params=`;
    `jaxsim.objectives.owned`)."""
    objective = with_context(loss)

    def loss_fn(params, batch: Batch, key, step=None):
        params, mine = owned.split(params)
        value, aux = objective(encode_views(encoder, params, batch, key, views, head),
                               ids=batch['input_ids'], step=step, key=key, params=mine or None)
        value, aux = value.astype(jnp.float32), dict(aux)
        if mlm is not None:
            ids = batch['input_ids']
            b, d, length = ids.shape
            # Every view is masked on its own, as the reference's collator masks each copy.
            rows = {k: jnp.repeat(batch[k], views // d, axis=1).reshape(-1, length)
                    for k in FIELDS}
            aux['mlm'] = mlm_term(encoder, params, rows, jax.random.fold_in(key, 1), mlm)
            value = value + mlm.weight * aux['mlm']
        return value, aux

    return loss_fn


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """What the step minimizes (`make_loss_fn` of these fields): the encoder (its dtype is the
    compute dtype), the objective's loss with its hyperparameters bound (e.g.
    `functools.partial(get_objective('unsup').loss, temp=0.05)`), the V views it takes, the
    masked-LM term (encoder built with `mlm=True`) and the head (see `encode_views`).
    """

    encoder: SentenceEncoder
    objective: LossFn
    views: int
    mlm: Optional[MlmSettings] = None
    head: Sequence = ()


@dataclasses.dataclass(frozen=True)
class UpdateSpec:
    """How the step turns the gradient into an update.

    Attributes:
      tx: the optimizer (of the trainable tree: the state's params, the objective's own
        parameters included).
      grad_divisor: the gradient is divided by this before clipping and the update (see the
        config's `grad_reduction`); 1 is the gradient of the loss.
      schedule: the learning-rate schedule, reported as metrics['lr'].
    """

    tx: optax.GradientTransformation
    grad_divisor: float = 1.0
    schedule: Optional[optax.Schedule] = None


@dataclasses.dataclass(frozen=True)
class CompileTarget:
    """What the step is compiled for: the mesh (the batch split over its ('data', 'fsdp')
    axes), the TrainState of NamedShardings (`create_state`), XLA options, the implementation
    of `state.rng` (`dropout_key`) and, for a ZeRO-1 update, where it runs
    (`state.update_shardings`)."""

    mesh: Mesh
    state_shardings: TrainState
    compiler_options: Optional[dict] = None
    prng_impl: str = 'threefry2x32'
    update_shardings: Any = None


SPLIT_MODES = ('whole', 'packed', 'accumulate', 'cached')


@dataclasses.dataclass(frozen=True)
class BatchSplit:
    """How the step takes its global batch: exactly one `mode`.

      'whole': one pass over the batch.
      'packed': one pass over the batch's packed layout (`jaxsim.data.packing.pack_batch`):
        the encoder runs on the packed rows.
      'accumulate': `grad_accum_steps` A micro-batches (rows i, i+A, ... form micro-batch i, so
        every device keeps its share); gradients and aux are averaged, one update is applied.
        Negatives then come from the micro-batch.
      'cached': the same gradient as 'whole', in micro-batches of `micro_batch_size` M examples
        with cached vector gradients (`jaxsim.train.grad_cache`): every negative kept,
        activations of M examples at a time. Not with the masked-LM term.
    """

    mode: str = 'whole'
    grad_accum_steps: int = 1
    micro_batch_size: int = 0

    def __post_init__(self):
        if self.mode not in SPLIT_MODES:
            raise ConfigError(f'batch split: unknown mode {self.mode!r}; known: '
                              f'{", ".join(SPLIT_MODES)}')
        accumulates, cached = self.mode == 'accumulate', self.mode == 'cached'
        if (self.grad_accum_steps < 1 or (self.grad_accum_steps > 1) != accumulates
                or self.micro_batch_size < 0 or (self.micro_batch_size > 0) != cached):
            # What the mode needs of the two sizes; anything else contradicts it.
            raise ConfigError(f'batch split {self.mode!r} takes grad_accum_steps '
                              f'{">= 2" if accumulates else 1} and micro_batch_size '
                              f'{">= 1" if cached else 0}, got grad_accum_steps '
                              f'{self.grad_accum_steps} and micro_batch_size '
                              f'{self.micro_batch_size}')


def make_train_step(*, loss: LossSpec, update: UpdateSpec, target: CompileTarget,
                    split: BatchSplit = BatchSplit()) -> Callable:
    """The jitted `train_step(state, batch) -> (state, metrics)` of what it minimizes (`loss`),
    how it updates (`update`), what it compiles for (`target`) and how it takes the batch.

    The step's dropout key is `fold_in(state.rng, state.step)` (and `fold_in(., i)` for
    micro-batch i), so a run is a pure function of (config, seed, data order), whatever the mesh.
    A non-finite loss or gradient leaves the state unchanged (step included): the host stops
    with the last good state intact. Metrics hold 'loss', 'grad_norm' (of the divided
    gradient, before clipping), 'lr' (with a schedule) and every aux entry of the objective.
    """
    if split.mode == 'cached':
        if loss.mlm is not None:
            raise ConfigError('batch split \'cached\' (micro_batch_size) does not combine with '
                              'the masked-LM term')
        grad_fn = make_cached_grad_fn(
            loss.encoder, loss.objective, views=loss.views,
            micro_batch_size=split.micro_batch_size, mesh=target.mesh,
            encode_views=functools.partial(encode_views, head=tuple(loss.head)))
    else:
        grad_fn = jax.value_and_grad(make_loss_fn(loss.encoder, loss.objective, loss.views,
                                                  loss.mlm, loss.head), has_aux=True)
    mesh, accum, grad_divisor = target.mesh, split.grad_accum_steps, update.grad_divisor
    sharded_update = None
    if target.update_shardings is not None:
        sharded_update = make_sharded_update(
            update.tx, mesh, target.state_shardings.params, target.update_shardings,
            target.state_shardings.opt_state)

    @rows_stay_on_their_devices(mesh)
    def train_step(state: TrainState, batch: Batch):
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng, impl=target.prng_impl),
                                 state.step)
        if accum == 1:
            (value, aux), grads = grad_fn(state.params, batch, key, state.step)
        else:
            def split(x):  # [B, ...] -> [A, B/A, ...]; micro-batch i = rows i::A
                x = x.reshape((x.shape[0] // accum, accum) + x.shape[1:]).swapaxes(0, 1)
                spec = P(None, sharding_lib.BATCH_AXES, *([None] * (x.ndim - 2)))
                return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

            micro = jax.tree.map(split, dict(batch))

            def micro_grad(i, mb):
                return grad_fn(state.params, mb, jax.random.fold_in(key, i), state.step)

            # The aux structure is whatever the objective returns: sums start at zeros like it.
            shapes = jax.eval_shape(micro_grad, 0, jax.tree.map(lambda x: x[0], micro))
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

            def body(acc, xs):
                return jax.tree.map(jnp.add, acc, micro_grad(*xs)), None

            total, _ = jax.lax.scan(body, zeros, (jnp.arange(accum), micro))
            (value, aux), grads = jax.tree.map(lambda x: x / accum, total)
        if grad_divisor != 1.0:
            grads = jax.tree.map(lambda g: g / grad_divisor, grads)
        grad_norm = optax.tree.norm(grads)
        ok = jnp.isfinite(value) & jnp.isfinite(grad_norm)

        def apply_update(operands):
            params, opt_state, grads = operands
            if sharded_update is not None:
                return sharded_update(params, opt_state, grads, grad_norm)
            # The clipping reuses grad_norm instead of reading every gradient again.
            updates, opt_state = optax.with_extra_args_support(update.tx).update(
                grads, opt_state, params, grad_norm=grad_norm)
            return optax.apply_updates(params, updates), opt_state

        # Only the taken branch runs: a good step updates the donated state in place, a bad
        # one hands it back untouched. (A `where(ok, new, old)` over the whole state would
        # keep both copies alive and read params and both Adam moments once more.)
        params, opt_state = jax.lax.cond(ok, apply_update, lambda operands: operands[:2],
                                         (state.params, state.opt_state, grads))
        new = state.replace(step=state.step + ok.astype(state.step.dtype), params=params,
                            opt_state=opt_state)
        metrics = {'loss': value, 'grad_norm': grad_norm, **aux}
        if update.schedule is not None:
            metrics['lr'] = jnp.asarray(update.schedule(state.step), jnp.float32)
        return new, metrics

    shardings = target.state_shardings
    return jax.jit(train_step,
                   in_shardings=(shardings, batch_shardings(mesh, split.mode == 'packed')),
                   out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=0,
                   compiler_options=target.compiler_options)


def batch_shardings(mesh: Mesh, packed: bool = False) -> dict[str, NamedSharding]:
    """Shardings of the [batch, views, len] training arrays (and, `packed`, of the packed
    layout's [shards, rows, pack_length] and [batch, views, len] indices)."""
    shardings = {k: sharding_lib.batch_sharding(mesh, 3) for k in FIELDS}
    if packed:
        shardings.update({k: sharding_lib.batch_sharding(mesh, 3) for k in PACKED_FIELDS})
    return shardings
