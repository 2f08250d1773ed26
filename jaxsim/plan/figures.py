"""One program compiled for a TPU topology, and what the compiler says of it.

Everything here is XLA's own account of the compiled program: `memory_analysis()` (bytes per
device by kind), `cost_analysis()` (`flops`, `bytes accessed`) and the optimized HLO
(collectives). The roofline turns them into a step time from the chip's published peaks; it
is an estimate, never a measurement.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import sys
import threading
import time
from collections import Counter
from typing import Any, Callable, Optional

import jax
import numpy as np

from jaxsim import runtime
from jaxsim.errors import JaxsimError
from jaxsim.plan import hlo, loops
from jaxsim.plan.chips import Chip, GiB, Topology, TopologyError


class PlanError(JaxsimError):
    """A plan that cannot be made here (no libtpu, a program that does not compile)."""


def compile_only_devices(topology: Topology, num_slices: int = 1) -> list:
    """The devices of `num_slices` slices of `topology`, for compiling only (no TPU needed).

    Raises:
      PlanError: libtpu is not installed.
      TopologyError: libtpu does not know the topology.
    """
    if importlib.util.find_spec('libtpu') is None:
        raise PlanError(f'planning for {topology.name} needs the TPU compiler: pip install '
                        f'"jax[tpu]=={jax.__version__}" (it runs on this CPU; no TPU needed)')
    os.environ.setdefault('TPU_SKIP_MDS_QUERY', '1')  # no metadata server off Google Cloud
    from jax.experimental import topologies
    runtime.leave_hard_at_exit("libtpu's compiler is loaded (its teardown can hang the exit)")
    try:
        desc = topologies.get_topology_desc(topology_name=topology.name, platform='tpu',
                                            **({'num_slices': num_slices}
                                               if num_slices > 1 else {}))
    except Exception as e:  # libtpu's errors are RuntimeErrors with a status prefix
        text = ' '.join(str(e).split())
        raise TopologyError(f'--topology {topology.name}: the TPU compiler refuses it: '
                            f'{text[:200]}') from None
    return list(desc.devices)


def devices_per_chip(topology: Topology, devices: list, num_slices: int) -> int:
    """Devices JAX shows per chip: 2 on v4 (one per TensorCore), else 1."""
    return max(1, len(devices) // (topology.chips * num_slices))


@dataclasses.dataclass(frozen=True)
class ProgramFigures:
    """A compiled program's figures per device (XLA's own)."""

    name: str
    flops: float  # XLA's cost analysis, each loop body counted as often as it runs
    bytes_accessed: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    collectives: tuple[hlo.Collective, ...]
    compile_s: float
    hlo_text: str = dataclasses.field(default='', repr=False)  # the compiled, partitioned HLO
    # False when the compiler refused the program for want of HBM: then only the memory
    # figures are known (the refusal's total; temporaries: all of it beyond the arguments,
    # outputs included), no cost.
    compiled: bool = True
    # XLA's totals as it gives them (each loop body once) and the loops (`jaxsim.plan.loops`).
    xla_flops: float = 0.0
    xla_bytes_accessed: float = 0.0
    loops: tuple = ()
    # How many times each computation runs a step (`loops.loops`), for the breakdown.
    computation_runs: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def hbm_bytes(self) -> int:
        """What the program holds in HBM at its peak: its arguments, outputs not written over
        donated arguments, temporaries and its code."""
        return (self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
                + self.code_bytes)

    def collective_counts(self) -> dict[str, int]:
        return {**dict.fromkeys(hlo.KINDS, 0), **Counter(c.kind for c in self.collectives)}


def _ticker(label: str, say: Callable[[str], None], every_s: float = 20.0):
    """A background thread saying `label` is still compiling every `every_s` seconds."""
    done = threading.Event()
    start = time.perf_counter()

    def run():
        while not done.wait(every_s):
            say(f'  ... still compiling {label} ({time.perf_counter() - start:.0f} s)')

    threading.Thread(target=run, daemon=True).start()
    return done


# XLA:TPU's refusal of a program whose memory exceeds the chip's HBM.
_OUT_OF_HBM = re.compile(
    r'memory required for HLO temporaries \(([0-9.]+)([KMGTP]?)\) exceeds')


def refusal_bytes(message: str) -> Optional[int]:
    """What XLA:TPU's refusal for want of HBM says the program needs (its arguments and
    outputs included, binary units: '18.00G' for two 9 GiB arguments), or None."""
    m = _OUT_OF_HBM.search(message)
    if m is None:
        return None
    return int(float(m.group(1)) * 1024 ** ' KMGTP'.index(m.group(2) or ' '))


def compile_program(name: str, jitted: Any, args: tuple, mesh,
                    say: Optional[Callable[[str], None]] = None) -> ProgramFigures:
    """Lowers and compiles `jitted` for abstract `args` (ShapeDtypeStructs with shardings on
    `mesh`) and reads its figures."""
    say = say or (lambda message: print(message, file=sys.stderr, flush=True))
    start = time.perf_counter()
    done = _ticker(name, say)
    try:
        compiled = jitted.lower(*args).compile()
    except Exception as e:  # a program XLA cannot compile for this topology
        message = ' '.join(str(e).split())
        needed = refusal_bytes(message)
        if needed is None:
            raise PlanError(f'{name} does not compile for this topology: {message[:300]}') \
                from None
        # Too large for the chip: what it would need is the answer, not an error.
        # The refusal's figure holds the arguments: the temporaries are the rest of it.
        arguments = per_device_bytes(args)
        return ProgramFigures(
            name=name, flops=0.0, bytes_accessed=0.0, argument_bytes=arguments,
            output_bytes=0, alias_bytes=0, temp_bytes=max(0, needed - arguments),
            code_bytes=0, collectives=(), compile_s=round(time.perf_counter() - start, 1),
            compiled=False)
    finally:
        done.set()
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    slices = [getattr(d, 'slice_index', 0) for d in mesh.devices.flat]
    text = compiled.as_text()
    runs, found, parent = loops.loops(text)
    collectives = hlo.collectives(text, mesh.devices.shape, mesh.axis_names, slices, runs)
    flops, moved = float(cost.get('flops', 0.0)), float(cost.get('bytes accessed', 0.0))
    try:
        scale = loops.loop_scale(text, found, parent)
    except Exception as e:  # XLA's HLO parser refused a body: the raw totals, said so
        say(f'warning: {name}: its FLOPs and bytes have each loop body counted '
            f'once, as XLA\'s totals do (a loop body could not be costed alone: '
            f'{" ".join(str(e).split())[:160]})')
        scale = loops.LoopScale()
    return ProgramFigures(
        name=name, flops=flops * scale.flops, bytes_accessed=moved * scale.bytes,
        xla_flops=flops, xla_bytes_accessed=moved, loops=scale.loops, computation_runs=runs,
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes),
        code_bytes=int(memory.generated_code_size_in_bytes),
        collectives=tuple(collectives), compile_s=round(time.perf_counter() - start, 1),
        hlo_text=text)


def per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs with shardings (its shard of
    each leaf)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.shape if leaf.sharding is None else leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


@dataclasses.dataclass(frozen=True)
class Roofline:
    """Step time from the chip's peaks: the larger of compute and HBM time, plus the
    collectives' link time (not assumed hidden behind compute)."""

    compute_s: float
    memory_s: float
    ici_s: float
    dcn_s: float

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.ici_s + self.dcn_s

    def mfu_ceiling(self) -> float:
        return self.compute_s / self.step_s if self.step_s > 0 else 0.0

    @property
    def bound(self) -> str:
        parts = {'compute': self.compute_s, 'HBM': self.memory_s,
                 'ICI': self.ici_s, 'DCN': self.dcn_s}
        return max(parts, key=parts.get)


def roofline(figures: ProgramFigures, chip: Chip, per_chip: int = 1) -> Roofline:
    """The roofline of a program on `chip`, whose peaks are shared by `per_chip` devices."""
    ici = sum(c.traffic_bytes * c.runs for c in figures.collectives if not c.dcn)
    dcn = sum(c.traffic_bytes * c.runs for c in figures.collectives if c.dcn)
    return Roofline(compute_s=figures.flops * per_chip / chip.peak_flops,
                    memory_s=figures.bytes_accessed * per_chip / chip.hbm_bytes_per_s,
                    ici_s=ici * per_chip / chip.ici_bytes_per_s,
                    dcn_s=dcn * per_chip / chip.dcn_bytes_per_s)


def gib(n: float) -> float:
    return round(n / GiB, 3)


def round_sig(x: float, digits: int = 4) -> float:
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))
