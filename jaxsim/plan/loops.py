"""How many times each part of a compiled program runs, and its costs counted that many times.

XLA's cost analysis (`compiled.cost_analysis()`, HloCostAnalysis) costs a `while` as one run of
its body: it cannot know a loop's trip count in general. A step with micro-batches (GradCache:
one loop embeds the micro-batches, a second re-runs each with gradients) or with gradient
accumulation runs its loop bodies n times, so the raw figures undercount it: BERT-large at
batch 32,768 in micro-batches of 4,096 (8 runs of each loop) counts 66 TFLOP a v4 chip where
the model alone does 360 (docs/pod.md).

JAX's loops count from 0 to a constant: the condition is `counter < N`. Each computation's
`runs` is, summed over the call paths that reach it, the product of the trip counts of the
loops around it; XLA's totals count it once a call path. The program's cost counts each loop
body `runs` times, from XLA's own cost analysis of the body alone (the body made the module's
entry): per loop body, what it costs beyond the loops nested in it. The analysis runs
on this process's CPU client, which counts FLOPs exactly as the TPU compiler does but bytes by
logical sizes (no TPU tile padding, no memory-space copies), so the TPU figures are scaled by
the ratio the CPU analysis gives (counted / counted once): the TPU's own totals, with the loop
bodies' shares repeated.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Optional

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
    repeated = [x for x in found if x.trips and x.trips > 1]
    if not repeated:
        return LoopScale(loops=tuple(found))
    if client is None:
        import jax
        client = jax.devices('cpu')[0].client
    once = _cost(hlo_text, client)
    inclusive = {x.body: _cost(_as_entry(hlo_text, x.body), client) for x in found}
    extra = {x.body: x.runs - x.paths for x in found}
    # Counted once, the whole holds each body once a call path; each further run adds the
    # body's own part (its cost less the bodies nested in it, which add their own).
    counted = list(once)
    for body, (flops, moved) in inclusive.items():
        nested = [b for b, p in parent.items() if p == body]
        own = (flops - sum(inclusive[b][0] for b in nested),
               moved - sum(inclusive[b][1] for b in nested))
        counted[0] += extra[body] * own[0]
        counted[1] += extra[body] * own[1]
    return LoopScale(flops=counted[0] / once[0] if once[0] else 1.0,
                     bytes=counted[1] / once[1] if once[1] else 1.0, loops=tuple(found))
