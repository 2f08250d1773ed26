"""Device mesh, the logical-axis rules table and the shardings derived from it.

Everything about WHERE arrays live is decided here, in one place:
  - `make_mesh` builds a ('data', 'fsdp', 'tensor') mesh over the physical topology (and
    across slices), with classic (Auto) propagation.
  - `process_batch_rows` says which rows of each global batch a process feeds.
  - `PARAM_LOGICAL_AXES` names the logical axes of each parameter by path pattern;
    `LOGICAL_AXIS_RULES` maps logical axes to mesh axes. With fsdp=1 and tensor=1 every
    parameter is replicated; with fsdp>1 the 'embed' dimension is split over 'fsdp' (ZeRO-3).
  - The batch dimension is split over ('data', 'fsdp'), so the per-device batch is
    global_batch / (data * fsdp) and the GLOBAL batch (the number of negatives) is fixed by
    the config, whatever the device count.
"""
from __future__ import annotations

import math
import re
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from flax import traverse_util
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsim.errors import JaxsimError

MESH_AXES = ('data', 'fsdp', 'tensor')
BATCH_AXES = ('data', 'fsdp')  # the mesh axes the batch dimension is split over

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


class MeshError(JaxsimError):
    """A mesh the devices cannot form (the message names the config keys)."""


def _slices(devices: Sequence[jax.Device]) -> tuple[int, bool]:
    """(number of slices, whether they are processes): TPU devices carry their `slice_index`;
    on other platforms each process (host) is a slice."""
    if all(d.platform == 'tpu' and hasattr(d, 'slice_index') for d in devices):
        return len({d.slice_index for d in devices}), False
    return len({d.process_index for d in devices}), True


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None, *, dcn_data: int = 1,
              dcn_fsdp: int = 1, dcn_tensor: int = 1) -> Mesh:
    """Builds the ('data', 'fsdp', 'tensor') mesh over the physical topology.

    Args:
      data: size of the data axis within a slice; -1 takes all remaining devices of a slice.
      fsdp: size of the fsdp (parameter-sharding) axis within a slice.
      tensor: size of the tensor axis within a slice.
      devices: devices to use (default: all global devices).
      dcn_data, dcn_fsdp, dcn_tensor: the axes across slices (TPU slices, or processes where
        devices have no slice); each mesh axis is the product of its two sizes, and the
        product of these must equal the number of slices.

    Within a slice, `mesh_utils.create_device_mesh` places the axes on the physical links
    (the last axis, 'tensor', on the fastest), with each process's devices a contiguous block
    where the topology allows. Across slices, `create_hybrid_device_mesh`. Axis types: Auto.
    Devices that cannot form the mesh are a MeshError.
    """
    devices = list(jax.devices() if devices is None else devices)
    dcn = (dcn_data, dcn_fsdp, dcn_tensor)
    slices = math.prod(dcn)
    have, by_process = _slices(devices)
    if slices > 1 and have != slices:
        unit = 'processes' if by_process else 'slices'
        raise MeshError(f'mesh_dcn_data x mesh_dcn_fsdp x mesh_dcn_tensor = {slices} must '
                        f'equal the number of {unit}, {have}')
    per_slice = len(devices) // slices
    if data == -1:
        if per_slice % (fsdp * tensor):
            raise MeshError(f'{per_slice} devices per slice cannot be split into mesh_fsdp='
                            f'{fsdp} x mesh_tensor={tensor}')
        data = per_slice // (fsdp * tensor)
    if data * fsdp * tensor * slices != len(devices):
        need = data * fsdp * tensor * slices
        # A CPU mesh is tried out on one host: XLA splits each process's CPU into devices.
        processes = len({d.process_index for d in devices})
        hint = ''
        if need > len(devices) and all(d.platform == 'cpu' for d in devices):
            each = -(-need // processes)
            hint = (f' (on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count={each} gives '
                    + (f'{each}' if processes == 1 else f'{each} a process') + ')')
        raise MeshError(f'mesh data={data} x fsdp={fsdp} x tensor={tensor} (x {slices} slices) '
                        f'needs {need} devices, have {len(devices)}{hint}')
    shape = (data, fsdp, tensor)
    if slices > 1:
        grid = mesh_utils.create_hybrid_device_mesh(shape, dcn, devices,
                                                    process_is_granule=by_process,
                                                    allow_split_physical_axes=True)
    else:
        grid = _device_grid(shape, devices)
    return Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def config_mesh(cfg) -> Mesh:
    """`make_mesh` from a TrainConfig's mesh_* keys."""
    return make_mesh(cfg.mesh_data, cfg.mesh_fsdp, cfg.mesh_tensor, dcn_data=cfg.mesh_dcn_data,
                     dcn_fsdp=cfg.mesh_dcn_fsdp, dcn_tensor=cfg.mesh_dcn_tensor)


def _device_grid(shape: tuple[int, ...], devices: list) -> np.ndarray:
    """`create_device_mesh`, preferring each process's devices in one contiguous block (so
    each process feeds contiguous batch rows); the plain device order where the topology
    has no such layout (e.g. a subset of a TPU slice)."""
    multi = len({d.process_index for d in devices}) > 1
    for contiguous in ((True, False) if multi else (False,)):
        try:
            return mesh_utils.create_device_mesh(shape, devices,
                                                 contiguous_submeshes=contiguous,
                                                 allow_split_physical_axes=True)
        except (ValueError, NotImplementedError, AssertionError):
            continue
    return np.asarray(devices, dtype=object).reshape(shape)


class ShardingError(JaxsimError):
    """A parameter dimension the rules shard but the mesh cannot divide (names the parameter)."""


def axis_rules(overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """LOGICAL_AXIS_RULES with a config's `logical_axis_rules` over it: logical axis -> a mesh
    axis, a list of mesh axes, or None / '' (replicated). Unknown names are errors."""
    rules = dict(LOGICAL_AXIS_RULES)
    for logical, target in (overrides or {}).items():
        if logical not in LOGICAL_AXIS_RULES:
            raise ShardingError(f'logical_axis_rules: unknown logical axis {logical!r}; known: '
                                f'{", ".join(LOGICAL_AXIS_RULES)}')
        names = [n for n in ([target] if isinstance(target, str) else target or []) if n]
        unknown = [n for n in names if n not in MESH_AXES]
        if unknown:
            raise ShardingError(f'logical_axis_rules: {logical!r} -> unknown mesh axis '
                                f'{unknown[0]!r}; mesh axes: {", ".join(MESH_AXES)}')
        rules[logical] = tuple(names) or None
    return rules


def logical_to_spec(axes: Sequence[str | None], mesh: Mesh, shape: Sequence[int],
                    rules: Mapping[str, Any] | None = None, strict: bool = False,
                    name: str = '') -> P:
    """Maps logical axes to a PartitionSpec by `rules` (default LOGICAL_AXIS_RULES).

    A dimension the mesh cannot divide is replicated, or, `strict`, a ShardingError naming
    the parameter `name`.
    """
    rules = LOGICAL_AXIS_RULES if rules is None else rules
    spec, used = [], set()
    for logical, dim in zip(axes, shape):
        mesh_axes = rules.get(logical) if logical else None
        mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes or ()
        # Drop size-1 axes: they shard nothing and keep the spec readable.
        mesh_axes = tuple(a for a in mesh_axes if mesh.shape[a] > 1 and a not in used)
        if mesh_axes:
            size = math.prod(mesh.shape[a] for a in mesh_axes)
            if dim % size == 0:
                used.update(mesh_axes)
                spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
                continue
            if strict:
                raise ShardingError(
                    f'{name or "a parameter"} {tuple(shape)}: its {logical!r} dimension {dim} '
                    f'cannot be split over mesh axes {"x".join(mesh_axes)} of size {size}; '
                    f'change the mesh or logical_axis_rules, or set '
                    f'replicate_indivisible=True to replicate it')
        spec.append(None)
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def param_specs(params: Any, mesh: Mesh, rules: Mapping[str, Any] | None = None,
                strict: bool = False) -> Any:
    """PartitionSpecs for a param tree (arrays or ShapeDtypeStructs), from the rules table
    (`rules`, default LOGICAL_AXIS_RULES); `strict`: an indivisible sharded dimension is a
    ShardingError naming the parameter instead of replicated."""
    out = {}
    for path, x in traverse_util.flatten_dict(params, sep='/').items():
        axes = next((logical for pattern, logical in PARAM_LOGICAL_AXES
                     if re.search(pattern, path) and len(logical) == len(x.shape)),
                    (None,) * len(x.shape))
        out[path] = logical_to_spec(axes, mesh, x.shape, rules, strict, path)
    return traverse_util.unflatten_dict(out, sep='/')


def update_specs(param_specs_tree: Any, params: Any, mesh: Mesh) -> Any:
    """Where the optimizer update runs (ZeRO-1): each parameter's spec with the 'data' axis
    added on its first dimension, other than the last, that is not split yet and that the
    axis divides. Adam's moments live there and each device updates its share of every
    parameter. The last dimension is never split: a slice of it is not a whole number of
    TPU lane tiles (768 / 16 = 48 of 128), and the compiled update then transposes the whole
    tensor (BERT's word embeddings: three [30522, 768] copies). Parameters with no such
    dimension (biases, layer norms, a vocabulary of 30522 rows), or whose spec already uses
    'data' (by `logical_axis_rules`), are updated as the rules split them."""
    size = mesh.shape['data']
    flat_specs = traverse_util.flatten_dict(param_specs_tree, sep='/')
    out = {}
    for path, x in traverse_util.flatten_dict(params, sep='/').items():
        entries = list(flat_specs[path]) + [None] * (len(x.shape) - len(flat_specs[path]))
        named = {a for e in entries if e for a in ((e,) if isinstance(e, str) else e)}
        if size > 1 and 'data' not in named:  # a mesh axis may split one dimension only
            for dim, (n, entry) in enumerate(zip(x.shape[:-1], entries)):
                if entry is None and n % size == 0:
                    entries[dim] = 'data'
                    break
        while entries and entries[-1] is None:
            entries.pop()
        out[path] = P(*entries)
    return traverse_util.unflatten_dict(out, sep='/')


def named(mesh: Mesh, specs: Any) -> Any:
    """The NamedShardings on `mesh` of a tree of PartitionSpecs."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def tree_shardings(tree: Any, mesh: Mesh, params_specs: Any = None) -> Any:
    """NamedShardings for any pytree: params by the rules, everything else replicated.

    Optimizer states mirror the param tree (Adam's mu/nu); a leaf whose shape equals a param's
    shape at the same path suffix is sharded like it.
    """
    by_shape_path = traverse_util.flatten_dict(params_specs or {}, sep='/')

    def leaf_sharding(path, x):
        keys = jax.tree_util.keystr(path, simple=True, separator='/')
        for ppath, spec in by_shape_path.items():
            if (keys == ppath or keys.endswith('/' + ppath)) and len(spec) <= len(x.shape):
                return NamedSharding(mesh, spec)
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(leaf_sharding, tree)


def tensor_parallel(mesh: Mesh) -> bool:
    """Whether the mesh splits the layers' products (its tensor axis has more than one device)."""
    return mesh.shape['tensor'] > 1


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Sharding of a [batch, ...] array: batch over ('data', 'fsdp'), the rest replicated."""
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def process_batch_rows(mesh: Mesh, global_batch: int) -> np.ndarray:
    """The rows of a global batch of `global_batch` examples that this process feeds (sorted).

    A process supplies exactly the rows its own devices hold: its share of the ('data',
    'fsdp') split. Processes whose devices differ only along 'tensor' (an axis spanning
    processes) hold the same rows and both feed them; with one batch shard every process
    feeds the whole batch. `assemble_batch` (`jax.make_array_from_process_local_data`) takes
    these rows, in this order.
    """
    rows = set()
    for index in batch_sharding(mesh, 1).addressable_devices_indices_map(
            (global_batch,)).values():
        rows.update(range(*index[0].indices(global_batch)))
    return np.asarray(sorted(rows), np.int64)


def assemble_batch(local: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Global [batch, ...] arrays sharded over the batch axes, from this process's rows of
    them (`process_batch_rows`, in order)."""
    shards = batch_shards(mesh)
    blocks = shards // len(process_batch_rows(mesh, shards))  # global rows per local row
    return {k: jax.make_array_from_process_local_data(
        batch_sharding(mesh, v.ndim), v, (v.shape[0] * blocks,) + v.shape[1:])
        for k, v in local.items()}


def batch_shards(mesh: Mesh) -> int:
    """Number of pieces the batch dimension is split into."""
    return mesh.shape['data'] * mesh.shape['fsdp']


def batch_granularity(mesh: Mesh, cfg) -> int:
    """A batch size must be a multiple of this to split evenly over the batch shards, the
    accumulation steps and the micro-batches of a TrainConfig."""
    return math.lcm(batch_shards(mesh) * cfg.grad_accum_steps, cfg.micro_batch_size or 1)


def check_global_batch(global_batch: int, mesh: Mesh, grad_accum_steps: int = 1,
                       micro_batch_size: int = 0) -> int:
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
    if micro_batch_size and micro_batch_size % shards:
        raise ValueError(f'micro_batch_size {micro_batch_size} cannot be split over {shards} '
                         f'batch shards of the mesh {dict(mesh.shape)}; choose a multiple of '
                         f'{shards}')
    return micro // shards
