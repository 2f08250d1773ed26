"""Where a compiled program's time and bytes go, by the JAX operation each instruction came from.

Each top-level instruction of the optimized HLO (a fusion, a copy, a collective; not those
inside a fusion) is charged its `cycles` (the TPU compiler's cost-model estimate,
`estimated_cycles` in its backend config; 0 without one) and its `bytes` (its operands' and
result's sizes: at most what it reads and writes; the cost analysis also counts inside fusions,
so the totals differ), as often as its loop runs (`jaxsim.plan.loops`), grouped by JAX
operation path (`op_name`, layer indices merged as `layer_N`). Control-flow instructions are
left out (their operands are a branch's whole state, not traffic); every branch of a
conditional counts, though one runs: an upper bound.
"""
from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from typing import Optional

from jaxsim.plan.hlo import call_graph, computations, op_name, shape_bytes
from jaxsim.plan.loops import loops

# Bookkeeping and control flow: no data moved by the instruction itself.
_NOT_WORK = frozenset({
    'parameter', 'constant', 'get-tuple-element', 'tuple', 'bitcast', 'after-all',
    'partition-id', 'replica-id', 'conditional', 'while', 'call', 'copy-done', 'slice-done',
    'all-gather-done', 'all-reduce-done', 'collective-permute-done', 'async-done',
    'async-update'})
_INSTRUCTION = re.compile(
    r'^\s+(?:ROOT )?%(?P<name>[\w.\-]+) = (?P<shape>\(.*?\)|\w+\[[^\]]*\](?:\{[^}]*\})?) '
    r'(?P<op>[\w\-]+)\((?P<operands>[^)]*)\)')
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')


@dataclasses.dataclass(frozen=True)
class OpCost:
    """One JAX operation's share of a program (all its top-level instructions)."""

    op: str
    instructions: int
    cycles: int
    bytes: int


def operation_name(op_name: str) -> str:
    """The grouping key of an HLO `op_name`: `jit(f)/` dropped, layer indices merged."""
    name = re.sub(r'^jit\([^)]*\)/', '', op_name)
    return re.sub(r'layer_\d+', 'layer_N', name) or '(no JAX operation)'


def op_costs(hlo_text: str, runs: Optional[dict[str, int]] = None) -> list[OpCost]:
    """The program's operations, most cycles first (then most bytes). An instruction in a loop
    body counts each run: `runs` per computation (`loops.loops`; read from the text if None)."""
    comps = computations(hlo_text)
    if runs is None:
        runs, _, _ = loops(hlo_text)
    # A fusion's inside and a reduction's combiner are charged to the instruction that calls
    # them; a `call`'s computation is a body of its own, counted.
    graph = call_graph(comps).values()
    inner = ({c.callee for calls in graph for c in calls if c.kind in ('inner', 'combiner')}
             - {c.callee for calls in graph for c in calls if c.kind == 'call'})
    shapes: dict[str, str] = {}
    rows: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for name, lines in comps.items():
        if name in inner:
            continue
        for line in lines:
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            shapes[m.group('name')] = m.group('shape')
            if m.group('op') in _NOT_WORK:
                continue
            operands = re.findall(r'%([\w.\-]+)', m.group('operands'))
            moved = shape_bytes(m.group('shape')) + sum(
                shape_bytes(shapes[o]) for o in operands if o in shapes)
            cycles = _CYCLES.search(line)
            row = rows[operation_name(op_name(line))]
            times = runs.get(name, 1)
            row[0] += 1
            row[1] += times * int(cycles.group(1)) if cycles else 0
            row[2] += times * moved
    costs = [OpCost(op, n, c, b) for op, (n, c, b) in rows.items()]
    return sorted(costs, key=lambda r: (-r.cycles, -r.bytes, r.op))


def summary(costs: list[OpCost], top: int) -> dict:
    """The `top` operations with their shares of the totals, for the plan's JSON."""
    cycles = sum(r.cycles for r in costs) or 1
    moved = sum(r.bytes for r in costs) or 1
    return {
        'estimated_cycles': sum(r.cycles for r in costs),
        'operations': [{'op': r.op[-160:], 'instructions': r.instructions,
                        'cycles': r.cycles, 'cycles_share': round(r.cycles / cycles, 4),
                        'mib': round(r.bytes / 2 ** 20, 3),
                        'bytes_share': round(r.bytes / moved, 4)} for r in costs[:top]],
    }
