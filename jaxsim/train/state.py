"""The training state (one pytree) and where each of its arrays lives on the mesh."""
from __future__ import annotations

from typing import Any, Callable, Optional

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsim import sharding as sharding_lib
from jaxsim.models import st_head
from jaxsim.models.encoder import SentenceEncoder, param_shapes
from jaxsim.objectives import owned


class TrainState(flax.struct.PyTreeNode):
    """State of a training run.

    Attributes:
      step: scalar int32, number of optimizer updates applied.
      params: the trainable tree (float32 master copy): the SentenceEncoder's parameters, a
        kept sentence-transformers head's Dense weights under 'st_head' and, under 'objective',
        those the objective owns (`jaxsim.objectives.owned`), if any.
      opt_state: the optax optimizer state for `params`.
      rng: raw uint32 PRNG key data (`jax.random.key_data`), so checkpoints hold plain arrays.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array


def param_shardings(encoder: SentenceEncoder, mesh: Mesh, rules: Optional[dict] = None,
                    strict: bool = False) -> Any:
    """NamedShardings of the encoder's parameter tree, by the rules table of `jaxsim.sharding`
    (`rules`: a config's `sharding.axis_rules`; `strict`: see `sharding.param_specs`)."""
    specs = sharding_lib.param_specs(param_shapes(encoder), mesh, rules, strict)
    return sharding_lib.named(mesh, specs)


def state_shardings(state_shape: TrainState, mesh: Mesh, rules: Optional[dict] = None,
                    strict: bool = False, shard_optimizer_state: bool = False) -> TrainState:
    """Shardings of every TrainState leaf: params by the rules, Adam's moments alike, or, with
    `shard_optimizer_state`, also split over the 'data' axis (`sharding.update_specs`)."""
    specs = sharding_lib.param_specs(state_shape.params, mesh, rules, strict)
    replicated = NamedSharding(mesh, P())
    moment_specs = (sharding_lib.update_specs(specs, state_shape.params, mesh)
                    if shard_optimizer_state else specs)
    return TrainState(
        step=replicated,
        params=sharding_lib.named(mesh, specs),
        opt_state=sharding_lib.tree_shardings(state_shape.opt_state, mesh, moment_specs),
        rng=replicated)


def update_shardings(state_shape: TrainState, shardings: TrainState, mesh: Mesh) -> Any:
    """NamedShardings, shaped like the params, of where a ZeRO-1 update runs: the params'
    own shardings (`state_shardings`) with the 'data' axis added by `sharding.update_specs`."""
    specs = jax.tree.map(lambda s: s.spec, shardings.params)
    return sharding_lib.named(mesh, sharding_lib.update_specs(specs, state_shape.params, mesh))


def _init_fn(tx: optax.GradientTransformation, rng: jax.Array) -> Callable:
    rng_data = jax.random.key_data(rng)

    def init(params):
        return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          opt_state=tx.init(params), rng=rng_data)

    return init


def state_shape(encoder: SentenceEncoder, tx: optax.GradientTransformation,
                rng: jax.Array, owned_shapes: Optional[dict] = None,
                head_shapes: Optional[dict] = None) -> TrainState:
    """The TrainState as ShapeDtypeStructs (nothing allocated): a restore target's skeleton.
    `owned_shapes`: the objective's own parameters, `head_shapes`: the Dense weights of a
    kept sentence-transformers head (both as ShapeDtypeStructs), if any."""
    params = param_shapes(encoder)
    if head_shapes:
        params = {**params, st_head.HEAD_KEY: head_shapes}
    params = owned.join(params, owned_shapes or {})
    return jax.eval_shape(_init_fn(tx, rng), params)


def create_state(params: Any, tx: optax.GradientTransformation, rng: jax.Array, mesh: Mesh,
                 compiler_options: Optional[dict] = None,
                 shardings: Optional[TrainState] = None) -> tuple[TrainState, TrainState]:
    """(state, shardings): the TrainState built on the mesh next to `params` (already placed
    there), `rng` (the run's dropout key) stored as raw key data, and the TrainState of
    NamedShardings it lives at (`shardings`, default: `state_shardings` by the default rules).
    """
    init = _init_fn(tx, rng)
    if shardings is None:
        shardings = state_shardings(jax.eval_shape(init, params), mesh)
    state = jax.jit(init, in_shardings=(shardings.params,), out_shardings=shardings,
                    compiler_options=compiler_options)(params)
    return state, shardings


def abstract_state(state: TrainState, shardings: TrainState) -> TrainState:
    """A restore target (ShapeDtypeStructs with shardings) shaped like `state`."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        state, shardings)
