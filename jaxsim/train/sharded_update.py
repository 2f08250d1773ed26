"""The optimizer update split over the 'data' axis (ZeRO-1, `shard_optimizer_state`).

Each device keeps 1/data of Adam's moments and updates 1/data of every parameter
(`sharding.update_specs` says which slice), then the updated slices are all-gathered
(docs/pod.md). The update runs under `shard_map`, the slice taken by the device's index: the
gradients arrive whole, so the partitioner never re-plans the backward pass's products around
a split gradient (which, left to itself, it did: dozens of collective-permutes).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

_AXIS = 'data'


def _split_dim(param_spec: P, update_spec: P) -> Optional[int]:
    """The dimension `update_spec` splits over 'data' that `param_spec` does not (None: the
    parameter is updated whole on every device)."""
    for dim, entry in enumerate(update_spec):
        entries = entry if isinstance(entry, tuple) else (entry,)
        if _AXIS in entries and (dim >= len(param_spec) or param_spec[dim] != entry):
            return dim
    return None


def _specs(shardings: Any) -> Any:
    return jax.tree.map(lambda s: s.spec, shardings)


def make_sharded_update(tx: optax.GradientTransformation, mesh: Mesh, param_shardings: Any,
                        update_shardings: Any, opt_state_shardings: Any) -> Callable:
    """`update(params, opt_state, grads, grad_norm) -> (params, opt_state)`, the result equal to
    `tx.update` + `optax.apply_updates` on the whole trees, each device updating its slice."""
    param_specs = _specs(param_shardings)
    dims = jax.tree.map(_split_dim, param_specs, _specs(update_shardings),
                        is_leaf=lambda x: isinstance(x, P))
    opt_specs = _specs(opt_state_shardings)
    size = mesh.shape[_AXIS]

    def local(params, opt_state, grads, grad_norm):
        index = lax.axis_index(_AXIS)

        def take(x, dim):
            if dim is None:
                return x
            n = x.shape[dim] // size
            return lax.dynamic_slice_in_dim(x, index * n, n, dim)

        def gather(x, dim):
            return x if dim is None else lax.all_gather(x, _AXIS, axis=dim, tiled=True)

        mine = jax.tree.map(take, params, dims)
        updates, opt_state = optax.with_extra_args_support(tx).update(
            jax.tree.map(take, grads, dims), opt_state, mine, grad_norm=grad_norm)
        return jax.tree.map(gather, optax.apply_updates(mine, updates), dims), opt_state

    return jax.shard_map(local, mesh=mesh,
                         in_specs=(param_specs, opt_specs, param_specs, P()),
                         out_specs=(param_specs, opt_specs), check_vma=False)
