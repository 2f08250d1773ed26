"""Device mesh, the logical-axis rules table and the shardings derived from it.

Everything about WHERE arrays live is decided here, in one place:
  - `make_mesh` builds a ('data', 'fsdp', 'tensor') mesh with classic (Auto) propagation.
  - `PARAM_LOGICAL_AXES` names the logical axes of each parameter by path pattern;
    `LOGICAL_AXIS_RULES` maps logical axes to mesh axes. With fsdp=1 and tensor=1 every
    parameter is replicated; with fsdp>1 the 'embed' dimension is split over 'fsdp' (ZeRO-3).
  - The batch dimension is split over ('data', 'fsdp'), so the per-device batch is
    global_batch / (data * fsdp) and the GLOBAL batch (the number of negatives) is fixed by
    the config, whatever the device count.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

import jax
import numpy as np
from flax import traverse_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ('data', 'fsdp', 'tensor')

# logical axis -> mesh axis (or tuple of mesh axes, or None = replicated).
LOGICAL_AXIS_RULES: dict[str, Any] = {
    'batch': ('data', 'fsdp'),
    'embed': 'fsdp',
    'vocab': 'tensor',
    'heads': 'tensor',
    'mlp': 'tensor',
}

# (regex on the '/'-joined param path, logical axes per dimension); first match wins.
# Unmatched params (LayerNorm scales, biases) are replicated: they are tiny.
PARAM_LOGICAL_AXES: tuple[tuple[str, tuple], ...] = (
    (r'word_embeddings/embedding$', ('vocab', 'embed')),
    (r'(position|token_type)_embeddings/embedding$', (None, 'embed')),
    (r'attention/self/(query|key|value)/kernel$', ('embed', 'heads')),
    (r'attention/output/dense/kernel$', ('heads', 'embed')),
    (r'intermediate/dense/kernel$', ('embed', 'mlp')),
    (r'layer_\d+/output/dense/kernel$', ('mlp', 'embed')),
    (r'pooler/dense/kernel$', ('embed', None)),
)


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds the ('data', 'fsdp', 'tensor') mesh.

    Args:
      data: size of the data axis; -1 takes all remaining devices.
      fsdp: size of the fsdp (parameter-sharding) axis.
      tensor: size of the tensor axis.
      devices: devices to use (default: all global devices, in process order, so each process
        owns a contiguous block of the batch).

    Returns:
      A `jax.sharding.Mesh` with Auto axis types.
    """
    devices = list(jax.devices() if devices is None else devices)
    if data == -1:
        if len(devices) % (fsdp * tensor):
            raise ValueError(f'{len(devices)} devices cannot be split into fsdp={fsdp} x '
                             f'tensor={tensor}')
        data = len(devices) // (fsdp * tensor)
    if data * fsdp * tensor != len(devices):
        raise ValueError(f'mesh data={data} x fsdp={fsdp} x tensor={tensor} needs '
                         f'{data * fsdp * tensor} devices, have {len(devices)}')
    grid = np.asarray(devices, dtype=object).reshape(data, fsdp, tensor)
    return Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def logical_to_spec(axes: Sequence[str | None], mesh: Mesh, shape: Sequence[int]) -> P:
    """Maps logical axes to a PartitionSpec; a dimension the mesh cannot divide is replicated."""
    spec = []
    used = set()
    for name, dim in zip(axes, shape):
        mesh_axes = LOGICAL_AXIS_RULES.get(name) if name else None
        if isinstance(mesh_axes, str):
            mesh_axes = (mesh_axes,)
        if mesh_axes:
            # Drop size-1 axes: they shard nothing and keep the spec readable.
            mesh_axes = tuple(a for a in mesh_axes if mesh.shape[a] > 1 and a not in used)
        if mesh_axes:
            size = int(np.prod([mesh.shape[a] for a in mesh_axes]))
            if dim % size == 0:
                used.update(mesh_axes)
                spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
                continue
        spec.append(None)
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def param_specs(params: Any, mesh: Mesh) -> Any:
    """PartitionSpecs for a param tree (arrays or ShapeDtypeStructs), from the rules table."""
    flat = traverse_util.flatten_dict(params, sep='/')
    out = {}
    for path, x in flat.items():
        axes = (None,) * len(x.shape)
        for pattern, logical in PARAM_LOGICAL_AXES:
            if re.search(pattern, path) and len(logical) == len(x.shape):
                axes = logical
                break
        out[path] = logical_to_spec(axes, mesh, x.shape)
    return traverse_util.unflatten_dict(out, sep='/')


def tree_shardings(tree: Any, mesh: Mesh, params_specs: Any = None) -> Any:
    """NamedShardings for any pytree: params by the rules, everything else replicated.

    Optimizer states mirror the param tree (Adam's mu/nu); a leaf whose shape equals a param's
    shape at the same path suffix is sharded like it.
    """
    by_shape_path = {}
    if params_specs is not None:
        for path, spec in traverse_util.flatten_dict(params_specs, sep='/').items():
            by_shape_path[path] = spec

    def leaf_sharding(path, x):
        keys = '/'.join(_key_str(k) for k in path)
        for ppath, spec in by_shape_path.items():
            if (keys == ppath or keys.endswith('/' + ppath)) and len(spec) <= len(x.shape):
                return NamedSharding(mesh, spec)
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(leaf_sharding, tree)


def _key_str(k) -> str:
    for attr in ('key', 'name', 'idx'):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Sharding of a [batch, ...] array: batch over ('data', 'fsdp'), the rest replicated."""
    return NamedSharding(mesh, P(('data', 'fsdp'), *([None] * (ndim - 1))))


def batch_shards(mesh: Mesh) -> int:
    """Number of pieces the batch dimension is split into."""
    return mesh.shape['data'] * mesh.shape['fsdp']


def check_global_batch(global_batch: int, mesh: Mesh, grad_accum_steps: int = 1) -> int:
    """Validates the global batch against the mesh; returns the per-device micro-batch.

    Raises:
      ValueError: when the mesh (times accumulation) cannot split the batch evenly. Refusing,
        instead of rounding, keeps the number of negatives and the schedule device-independent.
    """
    shards = batch_shards(mesh)
    if global_batch % grad_accum_steps:
        raise ValueError(f'batch_size {global_batch} is not divisible by grad_accum_steps '
                         f'{grad_accum_steps}')
    micro = global_batch // grad_accum_steps
    if micro % shards:
        raise ValueError(
            f'global batch {global_batch} (micro-batch {micro} with grad_accum_steps='
            f'{grad_accum_steps}) cannot be split over {shards} batch shards of the mesh '
            f'{dict(mesh.shape)}; choose a batch size divisible by {shards * grad_accum_steps}')
    return micro // shards
