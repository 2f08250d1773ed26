"""How many times each part of a compiled program runs, and its costs counted that many times.

XLA's cost analysis costs a `while` as one run of its body, so a step with micro-batches or
gradient accumulation is undercounted (docs/pod.md). JAX's loops count `counter < N`: each
computation's `runs` is, summed over the call paths reaching it, the product of the trip counts
of the loops around it (XLA's totals count it once a call path). Each loop body's own cost
(beyond the loops nested in it) comes from XLA's analysis of the body alone, on this process's
CPU client: it counts FLOPs as the TPU compiler does but bytes by logical sizes (no tile
padding), so the TPU's totals are scaled by the ratio it gives (counted / counted once).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Optional

import numpy as np

from jaxsim.plan.hlo import call_graph, computations

_HEADER = re.compile(r'^HloModule [^\n]*\n')
_TRIP_CONSTANT = re.compile(r'= s32\[\]\S* constant\((\d+)\)')
_LESS_THAN = re.compile(r'compare\(.*direction=LT')


@dataclasses.dataclass(frozen=True)
class Loop:
    """One `while` of the program."""

    body: str
    trips: Optional[int]  # None: the condition is not `counter < constant` (counted once)
    runs: int  # how many times the body runs in one run of the program
    paths: int = 1  # how many times XLA's totals count it: once a call path reaching it


def trip_count(condition: list[str]) -> Optional[int]:
    """N of a condition `counter < N` (JAX's scan / fori_loop), else None."""
    constants = [int(m.group(1)) for line in condition for m in [_TRIP_CONSTANT.search(line)] if m]
    if len(constants) == 1 and any(_LESS_THAN.search(line) for line in condition):
        return constants[0]
    return None


def loops(hlo_text: str) -> tuple[dict[str, int], list[Loop], dict[str, str]]:
    """(runs of every computation reached from the entry, its loops in program order, the
    loop body each body is nested in directly ('' for the entry)).

    A computation called from several places runs once for each run of each call site: its
    runs are the sum over the call sites (XLA usually clones such callees, not always)."""
    comps = computations(hlo_text)
    entry = re.search(r'^ENTRY %?([\w.\-]+)', hlo_text, re.M)
    if not entry:  # a fragment of a module: no loops to see
        return {}, [], {}
    graph = call_graph(comps)
    calls: dict[str, list[tuple[str, int]]] = {}  # caller -> (callee, runs per caller run)
    trips: dict[str, Optional[int]] = {}  # loop body -> trip count, in program order
    parent: dict[str, str] = {}
    order: list[str] = []  # callers after their callees (depth-first post-order)

    def visit(name: str, owner: str) -> None:
        calls[name] = []
        for call in graph.get(name, ()):
            if call.kind == 'loop':
                trips.setdefault(call.callee, trip_count(comps.get(call.condition, [])))
                parent.setdefault(call.callee, owner)
                times = trips[call.callee] or 1
                calls[name] += [(call.condition, times), (call.callee, times)]
            else:  # once a run of the caller (a conditional runs one branch of its distinct ones)
                calls[name].append((call.callee, 1))
        for callee, _ in calls[name]:
            if callee not in calls:
                visit(callee, callee if callee in trips else owner)
        order.append(name)

    visit(entry.group(1), '')

    def propagate(loop_factor) -> dict[str, int]:
        counts = dict.fromkeys(order, 0)
        counts[entry.group(1)] = 1
        for caller in reversed(order):  # every caller's count is final before its callees'
            for callee, times in calls[caller]:
                counts[callee] += counts[caller] * loop_factor(times)
        return counts

    runs = propagate(lambda times: times)
    paths = propagate(lambda times: 1)  # each loop taken once: as XLA's totals count
    found = [Loop(body=b, trips=t, runs=runs[b], paths=paths[b]) for b, t in trips.items()]
    return runs, found, parent


def _as_entry(hlo_text: str, body: str) -> str:
    """The module with `body` as its entry computation (the old entry left uncalled)."""
    text = 'HloModule body\n' + _HEADER.sub('', hlo_text, count=1).replace('\nENTRY ', '\n', 1)
    return re.sub(r'^%' + re.escape(body) + ' ', 'ENTRY %' + body + ' ', text, count=1,
                  flags=re.M)


def _cost(text: str, client) -> tuple[float, float]:
    import jaxlib._hlo as hlo_ir
    from jax._src.lib import _jax
    cost = _jax.hlo_module_cost_analysis(client, hlo_ir.hlo_module_from_text(text))
    return float(cost.get('flops', 0.0)), float(cost.get('bytes accessed', 0.0))


@dataclasses.dataclass(frozen=True)
class LoopScale:
    """What XLA's once-per-loop totals are multiplied by to count every run of each body."""

    flops: float = 1.0
    bytes: float = 1.0
    loops: tuple[Loop, ...] = ()


def loop_scale(hlo_text: str, found: list[Loop], parent: dict[str, str],
               client=None) -> LoopScale:
    """The factors for a program whose loops run more than once (1.0 without loops);
    `found` and `parent` are what `loops(hlo_text)` gives."""
    if not any(x.trips and x.trips > 1 for x in found):
        return LoopScale(loops=tuple(found))
    if client is None:
        import jax
        client = jax.devices('cpu')[0].client
    once = np.array(_cost(hlo_text, client))
    inclusive = {x.body: np.array(_cost(_as_entry(hlo_text, x.body), client)) for x in found}
    # Counted once, the whole holds each body once a call path; each further run adds the
    # body's own part (its cost less the bodies nested in it, which add their own).
    counted = once.copy()
    for x in found:
        nested = sum((inclusive[b] for b, p in parent.items() if p == x.body), np.zeros(2))
        counted += (x.runs - x.paths) * (inclusive[x.body] - nested)
    flops, moved = (float(c / o) if o else 1.0 for c, o in zip(counted, once))
    return LoopScale(flops=flops, bytes=moved, loops=tuple(found))
