"""A train config planned for a TPU topology: the real step and the encode program compiled
for it on this machine (no TPU, no weights), and what the compiler says of them.

    plan = make_plan(cfg, parse_topology('v5e:4x4'))
    plan.fits, plan.to_json()['mfu_ceiling']

The step is the one training builds (`jaxsim.train.build.train_program`, on
`jaxsim.sharding.make_mesh`'s mesh). Memory grows with the batch almost linearly, so a second
compile at a smaller batch gives the largest batch that fits; settings that make a batch fit
are planned before they are offered.
"""
from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from jaxsim import sharding as sharding_lib
from jaxsim.data.tokenize import TokenBatch
from jaxsim.encode import make_encode_fn
from jaxsim.errors import ConfigError
from jaxsim.models.encoder import param_shapes
from jaxsim.objectives import check_kwargs, get_objective
from jaxsim.plan import breakdown
from jaxsim.plan import figures as fig
from jaxsim.plan.chips import Topology
from jaxsim.plan.figures import PlanError, ProgramFigures, Roofline
from jaxsim.train import build
from jaxsim.train import state as state_lib
from jaxsim.train import step as step_lib
from jaxsim.train.config import TrainConfig

# A plan fits when the program's peak HBM is at most this share of the capacity: the runtime
# keeps some HBM for itself and the compiler's figure is an estimate.
FIT_SHARE = 0.95
# Operations of the train step listed in the plan's JSON, most estimated cycles first.
BREAKDOWN_ROWS = 25
# Steps the learning-rate schedule is built for when the config gives no max_steps (the
# schedule's length does not change the program).
_PLAN_STEPS = 10_000


@dataclasses.dataclass(frozen=True)
class TrainFigures:
    """The train step's figures for one config."""

    cfg: TrainConfig
    mesh_shape: dict
    program: ProgramFigures
    parameters: int  # bytes per device
    optimizer_state: int
    batch: int
    roofline: Roofline
    # The model's training FLOPs per device (`model_flops`): what MFU is conventionally of.
    model_flops: float = 0.0


@dataclasses.dataclass
class Plan:
    """A config planned for a topology (figures per device, estimates of the compiler)."""

    topology: Topology
    num_slices: int
    devices: int
    per_chip: int  # devices per chip (2 on v4: one per TensorCore)
    train: TrainFigures
    encode: Optional[ProgramFigures] = None
    encode_shape: tuple[int, int] = (0, 0)
    max_batch: Optional[int] = None
    max_batch_note: str = ''
    suggestion: Optional[dict] = None

    @property
    def capacity(self) -> int:
        return self.topology.chip.hbm_bytes // self.per_chip

    @property
    def fits(self) -> bool:
        return self.train.program.hbm_bytes <= FIT_SHARE * self.capacity

    def to_json(self) -> dict[str, Any]:
        t, p, chip = self.train, self.train.program, self.topology.chip
        other = p.argument_bytes - t.parameters - t.optimizer_state - t.batch
        roof = t.roofline
        out = {
            'topology': self.topology.name, 'num_slices': self.num_slices, 'chip': chip.name,
            'devices': self.devices, 'devices_per_chip': self.per_chip, 'mesh': t.mesh_shape,
            'config': {k: t.cfg.to_dict()[k] for k in (
                'model', 'objective', 'batch_size', 'max_len', 'dtype', 'remat',
                'micro_batch_size', 'grad_accum_steps', 'prng_impl', 'mesh_data', 'mesh_fsdp',
                'mesh_tensor', 'mesh_dcn_data', 'mesh_dcn_fsdp', 'mesh_dcn_tensor',
                'shard_optimizer_state')},
            'fits': self.fits,
            'hbm_gib': {'parameters': fig.gib(t.parameters),
                        'optimizer_state': fig.gib(t.optimizer_state),
                        'batch': fig.gib(t.batch), 'other_arguments': fig.gib(max(other, 0)),
                        'temporaries': fig.gib(p.temp_bytes),
                        'outputs_not_aliased': fig.gib(p.output_bytes - p.alias_bytes),
                        'program': fig.gib(p.code_bytes), 'total': fig.gib(p.hbm_bytes),
                        'capacity': fig.gib(self.capacity)},
            'flops_per_chip': p.flops * self.per_chip,
            'model_flops_per_chip': t.model_flops * self.per_chip,
            'bytes_per_chip': p.bytes_accessed * self.per_chip,
            # XLA's totals as its cost analysis gives them, each loop body counted once, and
            # the loops whose bodies the two figures above count as often as they run.
            'xla_cost_analysis_per_chip': {'flops': p.xla_flops * self.per_chip,
                                           'bytes accessed': p.xla_bytes_accessed * self.per_chip},
            'loops': [{'trips': x.trips, 'runs': x.runs} for x in p.loops],
            'collectives': p.collective_counts(),
            'collective_list': [
                {'kind': c.kind, 'axes': list(c.axes), 'network': 'DCN' if c.dcn else 'ICI',
                 'mib': round(c.bytes / 2 ** 20, 3), 'group_size': c.group_size,
                 'runs': c.runs, 'op': c.op_name[-120:]} for c in p.collectives],
            'compute_s': fig.round_sig(roof.compute_s), 'hbm_s': fig.round_sig(roof.memory_s),
            'ici_s': fig.round_sig(roof.ici_s), 'dcn_s': fig.round_sig(roof.dcn_s),
            'step_s_estimate': fig.round_sig(roof.step_s),
            'mfu_ceiling': round(roof.mfu_ceiling(), 4),
            'mfu_ceiling_model_flops': round(
                t.model_flops * self.per_chip / chip.peak_flops / roof.step_s, 4)
            if roof.step_s > 0 else None,
            'bound': roof.bound,
            'max_global_batch': self.max_batch, 'max_global_batch_note': self.max_batch_note,
            'suggestion': self.suggestion, 'compile_s': p.compile_s,
            'peaks': {'flops': chip.peak_flops, 'hbm_bytes_per_s': chip.hbm_bytes_per_s,
                      'ici_bytes_per_s': chip.ici_bytes_per_s,
                      'dcn_bytes_per_s': chip.dcn_bytes_per_s, 'assumed': list(chip.assumed)},
            'note': "XLA's own figures for the compiled programs and a roofline from the chip's "
                    "published peaks: estimates, not measurements",
            'compiled': p.compiled,
            # Where the step's time goes by the TPU compiler's cost model (jaxsim.plan.breakdown).
            'breakdown': breakdown.summary(breakdown.op_costs(p.hlo_text, p.computation_runs),
                                           BREAKDOWN_ROWS),
        }
        if not p.compiled:  # refused for want of HBM: its memory is known, its cost is not
            out.update(dict.fromkeys((
                'flops_per_chip', 'bytes_per_chip', 'xla_cost_analysis_per_chip', 'compute_s',
                'hbm_s', 'ici_s', 'dcn_s', 'step_s_estimate', 'mfu_ceiling',
                'mfu_ceiling_model_flops', 'bound')), note='the compiler refused the step: its '
                'temporaries exceed the chip\'s HBM (the figure is the one its refusal gives)')
        if self.encode is not None:
            e = self.encode
            out['encode'] = {'batch': self.encode_shape[0], 'max_len': self.encode_shape[1],
                             'hbm_gib': fig.gib(e.hbm_bytes),
                             'fits': e.hbm_bytes <= FIT_SHARE * self.capacity,
                             'flops_per_chip': e.flops * self.per_chip,
                             'bytes_per_chip': e.bytes_accessed * self.per_chip,
                             'collectives': e.collective_counts(),
                             'step_s_estimate': fig.round_sig(fig.roofline(
                                 e, self.topology.chip, self.per_chip).step_s)}
        return out


def with_slices(cfg: TrainConfig, num_slices: int) -> TrainConfig:
    """The config for `num_slices` slices: the cross-slice axis is data-parallel unless the
    config names one (only the gradient reduction then crosses the data-center network)."""
    dcn = cfg.mesh_dcn_data * cfg.mesh_dcn_fsdp * cfg.mesh_dcn_tensor
    if num_slices > 1 and dcn == 1:
        return cfg.replace(mesh_dcn_data=num_slices)
    if dcn != num_slices:
        raise ConfigError(f'train config: mesh_dcn_data x mesh_dcn_fsdp x mesh_dcn_tensor = '
                          f'{dcn}, but --num-slices is {num_slices}')
    return cfg


def _mesh(cfg: TrainConfig, devices: list):
    return sharding_lib.make_mesh(cfg.mesh_data, cfg.mesh_fsdp, cfg.mesh_tensor,
                                  devices=devices, dcn_data=cfg.mesh_dcn_data,
                                  dcn_fsdp=cfg.mesh_dcn_fsdp, dcn_tensor=cfg.mesh_dcn_tensor)


def model_flops(encoder, config, sequences: int, length: int) -> float:
    """A training step's FLOPs over `sequences` of `length` tokens, by the usual convention
    (Kaplan et al. 2020; PaLM, appendix B): 6 per non-embedding parameter per token (forward 2,
    backward 4) plus the attention products' 12 x layers x length x hidden per token. What the
    model needs, not what the program does: recomputation (`remat`), element-wise work and
    embedding lookups are not counted, so an MFU of these FLOPs compares across settings."""
    shapes = jax.tree_util.tree_flatten_with_path(param_shapes(encoder))[0]
    dense = sum(math.prod(x.shape) for path, x in shapes
                if 'embeddings' not in jax.tree_util.keystr(path))
    per_token = 6 * dense + 12 * config.num_hidden_layers * length * config.hidden_size
    return float(sequences * length) * per_token


def _data_views(cfg: TrainConfig, objective) -> int:
    """Sentences per example the config's data gives: one a line for text corpora (repeated
    into views by the step), else as many as the objective takes."""
    if objective.from_single and cfg.data_format in ('text', 'senteval_corpus'):
        return 1
    return objective.views


def check_plannable(cfg: TrainConfig, devices: list):
    """The mesh and batch checks training makes, before any compile; returns the mesh."""
    if cfg.pack_length:
        raise ConfigError('train config: pack_length cannot be planned: a packed step\'s shape '
                          'depends on the data (plan the padded step, pack_length=0)')
    mesh = _mesh(cfg, devices)
    build.check_loss_batch(cfg, get_objective(cfg.objective))
    build.check_batch_split(cfg, mesh, build.architecture(cfg))
    return mesh


def plan_train_step(cfg: TrainConfig, devices: list, chip_of: tuple, say) -> TrainFigures:
    """Compiles the train step of `cfg` for `devices` and reads its figures; `chip_of`: (the
    chip, devices per chip)."""
    mesh = check_plannable(cfg, devices)
    config = build.architecture(cfg)
    encoder = build.make_encoder(cfg, config)
    objective = get_objective(cfg.objective)
    kwargs = check_kwargs(objective, cfg.objective_kwargs)
    program = build.train_program(cfg, encoder, objective, kwargs, mesh,
                                  cfg.max_steps or _PLAN_STEPS,
                                  mlm=build.mlm_settings(cfg, config))
    state = state_lib.abstract_state(program.state_shape, program.shardings)
    views = _data_views(cfg, objective)
    batch = {k: jax.ShapeDtypeStruct((cfg.batch_size, views, cfg.max_len), jnp.int32,
                                     sharding=s)
             for k, s in step_lib.batch_shardings(mesh).items()}
    say(f'compiling the train step (batch {cfg.batch_size}, mesh {dict(mesh.shape)}, '
        f'remat {cfg.remat}, micro_batch_size {cfg.micro_batch_size}) ...')
    figures = fig.compile_program('train step', program.train_step, (state, batch), mesh, say)
    return TrainFigures(cfg=cfg, mesh_shape={k: int(v) for k, v in mesh.shape.items()},
                        program=figures, parameters=fig.per_device_bytes(state.params),
                        optimizer_state=fig.per_device_bytes(state.opt_state),
                        batch=fig.per_device_bytes(batch),
                        roofline=fig.roofline(figures, *chip_of),
                        model_flops=model_flops(encoder, config, cfg.batch_size * objective.views,
                                                min(cfg.max_len, config.max_length))
                        / len(devices))


def plan_encode(cfg: TrainConfig, devices: list, say) -> tuple[ProgramFigures, tuple[int, int]]:
    """Compiles the encode program (evaluation's batches: `eval_batch_size` x `eval_max_len`,
    float32, as training's evaluation encodes) on the config's mesh."""
    mesh = _mesh(cfg, devices)
    config = build.architecture(cfg)
    encoder = build.make_encoder(cfg.replace(dtype='float32', remat='none'), config)
    params = state_lib.param_shardings(encoder, mesh, *build.param_rules(cfg))
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            param_shapes(encoder), params)
    shards = sharding_lib.batch_shards(mesh)
    rows = math.ceil(cfg.eval_batch_size / shards) * shards
    length = min(cfg.eval_max_len, config.max_length)
    spec = sharding_lib.batch_sharding(mesh, 2)
    tokens = TokenBatch(*(jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=spec)
                          for _ in range(3)))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=replicated)
    say(f'compiling the encode program (batch {rows} x {length} tokens) ...')
    return fig.compile_program('encode', make_encode_fn(encoder, False, False, mesh),
                               (abstract, tokens, key), mesh, say), (rows, length)


def _round_down(n: float, unit: int) -> int:
    return int(n // unit) * unit


def make_plan(cfg: TrainConfig, topology: Topology, num_slices: int = 1, *,
              encode: bool = True, search: bool = True,
              say: Optional[Callable[[str], None]] = None) -> Plan:
    """Plans `cfg` on `num_slices` slices of `topology` (`parse_topology`), joined over the
    data-center network. `encode`: also compile the encode program; `search`: a second compile
    at a smaller batch for the largest batch that fits and, when the batch does not fit,
    settings that make it fit (each planned before it is offered); `say`: progress lines
    (default: stderr).

    Raises:
      TopologyError, PlanError, ConfigError, MeshError: one line each, before any compile
      where the problem is in the inputs.
    """
    say = say or (lambda m: print(m, file=sys.stderr, flush=True))
    cfg = with_slices(cfg, num_slices)
    if cfg.kernels == 'auto':  # 'auto' means the forms of the backend the step runs on: TPU
        cfg = cfg.replace(kernels='xla')
    devices = fig.compile_only_devices(topology, num_slices)
    per_chip = fig.devices_per_chip(topology, devices, num_slices)
    check_plannable(cfg, devices)  # every input error before the first (minutes-long) compile
    say(f'planning {cfg.model} for {topology.name}'
        f'{f" x {num_slices} slices" if num_slices > 1 else ""} ({len(devices)} devices)')
    chip_of = (topology.chip, per_chip)
    train = plan_train_step(cfg, devices, chip_of, say)
    plan = Plan(topology=topology, num_slices=num_slices, devices=len(devices),
                per_chip=per_chip, train=train)
    if encode:
        plan.encode, plan.encode_shape = plan_encode(cfg, devices, say)
    if search:
        _search(plan, devices, chip_of, say)
    return plan


def _search(plan: Plan, devices: list, chip_of, say) -> None:
    """The largest batch that fits (a line through two compiles) and, for a batch that does
    not fit, planned settings that do."""
    cfg = plan.train.cfg
    mesh = _mesh(cfg, devices)
    unit = sharding_lib.batch_granularity(mesh, cfg)
    small = max(unit, _round_down(cfg.batch_size // 4, unit))
    if small >= cfg.batch_size:
        plan.max_batch_note = 'the batch is already the smallest the mesh takes'
        return
    try:
        other = plan_train_step(cfg.replace(batch_size=small), devices, chip_of, say)
    except (PlanError, ValueError) as e:
        plan.max_batch_note = f'not estimated: {e}'
        return
    slope = ((plan.train.program.hbm_bytes - other.program.hbm_bytes)
             / (cfg.batch_size - small))
    budget = FIT_SHARE * plan.capacity
    fixed = plan.train.program.hbm_bytes - slope * cfg.batch_size
    if slope <= 0:
        plan.max_batch_note = 'memory does not grow with the batch here'
    elif fixed > budget:
        plan.max_batch = 0
        plan.max_batch_note = (f'the batch-independent part alone ({fig.gib(fixed)} GiB: '
                               f'parameters, optimizer state, gradients) exceeds the chip')
    else:
        plan.max_batch = _round_down((budget - fixed) / slope, unit)
        plan.max_batch_note = (f'a line through batches {small} and {cfg.batch_size}: '
                               f'{fig.gib(fixed)} GiB + {fig.gib(slope)} GiB per example')
    if not plan.fits:
        plan.suggestion = _suggest(plan, devices, chip_of, say, fixed, slope, unit)


def _suggest(plan: Plan, devices, chip_of, say, fixed: float, slope: float,
             unit: int) -> dict:
    """Settings that make the batch fit, each planned before it is offered: cached-gradient
    micro-batches (same gradient, activations of M examples), then with full recomputation,
    then Adam's moments split over the data axis (ZeRO-1), then a mesh that shards the
    parameters and optimizer state (fsdp)."""
    cfg = plan.train.cfg
    budget = FIT_SHARE * plan.capacity
    candidates = []
    if fixed < budget and slope > 0 and not cfg.grad_accum_steps > 1 and cfg.mlm_weight == 0:
        micro = max(unit, _round_down(min((budget - fixed) / slope * 0.8, cfg.batch_size // 2),
                                      unit))
        while cfg.batch_size % micro:
            micro -= unit
        if micro >= unit:
            candidates.append({'micro_batch_size': micro})
            candidates.append({'micro_batch_size': micro, 'remat': 'full'})
    within = len(devices) // (cfg.mesh_dcn_data * cfg.mesh_dcn_fsdp * cfg.mesh_dcn_tensor)
    if not cfg.shard_optimizer_state and plan.train.mesh_shape['data'] > 1:
        candidates.append({'shard_optimizer_state': True})
    if cfg.mesh_fsdp == 1 and cfg.mesh_tensor == 1:
        candidates.append({'mesh_data': 1, 'mesh_fsdp': within})
    for changes in candidates:
        say(f'planning a setting that may fit: {changes}')
        try:
            figures = plan_train_step(cfg.replace(**changes), devices, chip_of, say)
        except (PlanError, ValueError) as e:
            say(f'  {changes}: {e}')
            continue
        if figures.program.hbm_bytes <= budget:
            return {'changes': changes, 'fits': True,
                    'hbm_gib': fig.gib(figures.program.hbm_bytes),
                    'step_s_estimate': fig.round_sig(figures.roofline.step_s),
                    'mfu_ceiling': round(figures.roofline.mfu_ceiling(), 4),
                    'flags': ' '.join(f'--config.{k}={v}' for k, v in changes.items())}
    return {'changes': None, 'fits': False,
            'note': 'no planned setting fits; a smaller batch or a larger slice is needed'}
