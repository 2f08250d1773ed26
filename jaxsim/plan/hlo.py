"""The collectives of a compiled program, read from its optimized HLO text.

The TPU compiler splits one asynchronous collective over several fusions (start, continuation,
done), each holding a copy of the instruction under the same `channel_id`; counting lines
would count the copies (a data-parallel BERT-base step shows 116 all-gather lines for 3
all-gathers). The channel alone does not name a collective: every collective `shard_map`
emits shares `channel_id=1`. A collective here is one (channel, kind, result shape without
layout, device groups, JAX operation, async chain or name) found in any number of
computations, a copy in each; two in one computation are two collectives. Without an async
chain or name to tie its copies together, a collective also belongs to the computation that
runs it (the entry, a loop body, a branch: the fusions it calls are its own), so the same
`psum` in two loops is two collectives. Each has its kind, its bytes, the device groups it
runs over, and from those the mesh axes it spans and whether it crosses slices (DCN).

Compiled for several slices, a collective over slices is split: the in-slice part stays an
HLO collective (groups within a slice), the cross-slice part becomes host-transfer
`send`/`recv` pairs for the multislice runtime (`_xla_megascale_transfer_type`), one
rendezvous per transfer; each rendezvous is a DCN collective here.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import re
from typing import Optional, Sequence

import numpy as np

KINDS = ('all-gather', 'all-reduce', 'reduce-scatter', 'all-to-all', 'collective-permute')

_DTYPE_BYTES = {'pred': 1, 's4': 0.5, 'u4': 0.5, 's8': 1, 'u8': 1, 'bf16': 2, 'f16': 2,
                's16': 2, 'u16': 2, 'f32': 4, 's32': 4, 'u32': 4, 'f64': 8, 's64': 8, 'u64': 8,
                'c64': 8, 'c128': 16}  # and every f8 type (f8e4m3fn, f8e5m2fnuz, ...): 1
_DCN_SEND = re.compile(
    r'%[\w.\-]+ = \((?P<shape>[a-z0-9]+\[[\d,]*\]).*? send\('
    r'.*_xla_host_transfer_rendezvous="(?P<name>[^"]+)"'
    r'.*_xla_megascale_transfer_type="(?P<kind>[A-Z_]+)"')
_CALLED = re.compile(
    r'\b(?P<attr>calls|to_apply|true_computation|false_computation|condition|body)'
    r'=%(?P<callee>[\w.\-]+)')
_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')
_COMPUTATION = re.compile(r'^(?:ENTRY )?%?(?P<name>[\w.\-]+) .*\{\s*$')
_INSTRUCTION = re.compile(
    r'%[\w.\-]+ = (?P<shape>.*?) (?P<kind>' + '|'.join(KINDS) + r')(?P<start>-start)?\('
    r'(?P<rest>.*)$')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the program: `bytes` is the size of its result per chip (all-gather:
    the gathered array; reduce-scatter: the scattered piece; all-reduce: the reduced arrays,
    all of a combined one); `axes` the mesh axes its groups span; `dcn` whether a group spans
    slices; `runs` how many times it runs a step (inside a loop: the loop's trip count)."""

    kind: str
    bytes: int
    group_size: int
    axes: tuple[str, ...]
    dcn: bool
    op_name: str = ''
    runs: int = 1

    @property
    def traffic_bytes(self) -> float:
        """Bytes each chip sends over its links in a ring algorithm: (n-1)/n of the gathered /
        scattered array, twice that for an all-reduce (a reduce-scatter then an all-gather);
        a permute sends its array once."""
        n = self.group_size
        if n <= 1:
            return 0.0
        share = (n - 1) / n
        if self.kind == 'all-reduce':
            return 2.0 * share * self.bytes
        if self.kind == 'reduce-scatter':
            return share * self.bytes * n  # its result is the 1/n piece of the summed array
        if self.kind == 'collective-permute':
            return float(self.bytes)
        return share * self.bytes


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string: 'f32[64,32]{1,0:T(8,128)}' or a tuple of them."""
    total = 0.0
    for dtype, dims in re.findall(r'\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]', shape):
        size = 1 if dtype.startswith('f8') else _DTYPE_BYTES.get(dtype)
        if size:
            total += size * int(np.prod([int(d) for d in dims.split(',') if d]))
    return int(total)


def tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape '(a, (b, c), d)'; [shape] for an array."""
    if not shape.startswith('('):
        return [shape]
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(shape[:-1]):
        depth += ch in '([{'
        depth -= ch in ')]}'
        if ch == ',' and depth == 1:
            parts.append(shape[start:i].strip())
            start = i + 1
    return parts + [shape[start:-1].strip()]


def op_name(line: str, default: str = '') -> str:
    """The JAX operation an HLO instruction came from (its metadata `op_name`)."""
    m = re.search(r'op_name="([^"]*)"', line)
    return m.group(1) if m else default


def computations(hlo_text: str) -> dict[str, list[str]]:
    """The instruction lines of each computation of an HLO module's text, by name."""
    out, current = {}, None
    for line in hlo_text.splitlines():
        if not line.startswith(' '):
            m = _COMPUTATION.match(line)
            current = m.group('name') if m else None
            if current:
                out[current] = []
        elif current is not None:
            out[current].append(line)
    return out


@dataclasses.dataclass(frozen=True)
class Call:
    """One computation called from an instruction of another.

    kind: 'inner' (a fusion's or an async operation's computation: part of the instruction
      that calls it), 'combiner' (a reduction's, sort's or scatter's scalar function: part of
      its instruction too), 'call' (a `call`: runs once a run of its caller), 'branch' (one
      of a conditional's distinct branches: at most one runs) or 'loop' (a `while`'s body,
      with its `condition`).
    """

    kind: str
    callee: str
    condition: str = ''


def call_graph(comps: dict[str, list[str]]) -> dict[str, list[Call]]:
    """Every computation's calls, in the order of its instructions (`comps`: `computations`).
    Each computation of the module has an entry; one that calls nothing has none."""
    graph: dict[str, list[Call]] = {}
    for name, lines in comps.items():
        graph[name] = []
        for line in lines:
            attrs = {m.group('attr'): m.group('callee') for m in _CALLED.finditer(line)}
            if 'body' in attrs:
                graph[name].append(Call('loop', attrs['body'], attrs.get('condition', '')))
            if 'calls' in attrs:
                graph[name].append(Call('inner', attrs['calls']))
            if 'to_apply' in attrs:
                kind = 'call' if re.search(r' call\(', line) else 'combiner'
                graph[name].append(Call(kind, attrs['to_apply']))
            branches = [attrs[a] for a in ('true_computation', 'false_computation') if a in attrs]
            listed = _BRANCHES.search(line)
            if listed:
                branches += re.findall(r'%([\w.\-]+)', listed.group(1))
            graph[name] += [Call('branch', b) for b in dict.fromkeys(branches)]
    return graph


def replica_groups(attributes: str, num_devices: int) -> list[list[int]]:
    """The device groups of a collective's attribute text, in any of XLA's three spellings:
    explicit `{{0,1},{2,3}}`, iota `[2,2]<=[4]` (optionally `<=[a,b]T(1,0)`), or named
    `mesh['axis_0'=4,'axis_1'=2] {'axis_0'}` (devices row-major over the named axes, a group
    for each index of the axes not listed). No groups (`{}`) means one group of all devices."""
    m = re.search(r'replica_groups=', attributes)
    if not m:
        pairs = re.search(r'source_target_pairs=(\{.*?\}\})', attributes)
        if pairs:
            return [[int(a), int(b)] for a, b in re.findall(r'\{(\d+),(\d+)\}', pairs.group(1))]
        return [list(range(num_devices))]
    text = attributes[m.end():]
    if text.startswith('mesh['):
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", text[:text.index(']')]))
        listed = set(re.findall(r"'([^']+)'", text[text.index('{'):text.index('}')]))
        shape = [int(size) for size in sizes.values()]
        group_axes = [i for i, name in enumerate(sizes) if name in listed]
        other = [i for i in range(len(shape)) if i not in group_axes]
        ids = np.arange(math.prod(shape)).reshape(shape).transpose(other + group_axes)
        return ids.reshape(-1, math.prod(shape[i] for i in group_axes)).tolist()
    if text.startswith('['):
        m = re.match(r'\[(\d+)[\d,]*\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?', text)
        dims = [int(x) for x in m.group(2).split(',')]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = np.transpose(ids, [int(x) for x in m.group(3).split(',')])
        return ids.reshape(int(m.group(1)), -1).tolist()
    groups = re.findall(r'\{([\d,]*)\}', re.match(r'\{(?:\{[\d,]*\},?)*\}', text).group())
    groups = [[int(x) for x in g.split(',') if x] for g in groups]
    return [g for g in groups if g] or [list(range(num_devices))]


def collectives(hlo_text: str, mesh_shape: Sequence[int], axis_names: Sequence[str],
                slice_of: Sequence[int], runs: Optional[dict[str, int]] = None
                ) -> list[Collective]:
    """Every collective of an optimized HLO module, once however many copies the compiler made
    (see the module docstring for what makes two instructions one collective).

    Args:
      hlo_text: `compiled.as_text()`.
      mesh_shape, axis_names: the mesh the program was compiled on; device id i of the HLO is
        the i-th device of the mesh in row-major order (the jit's device assignment).
      slice_of: the slice index of each of those devices.
      runs: how many times each computation runs a step (`loops.loops`); 1 where absent.
      A collective copied into computations that run different numbers of times (a start
      before a loop, a continuation inside it) counts the fewest runs of its copies.
    """
    found: dict[tuple, Collective] = {}
    held_in: dict[tuple, set[str]] = {}  # the computations holding a copy of each collective
    unnumbered = itertools.count()
    num_devices = int(np.prod(mesh_shape))
    # The text split once, for both kinds; a bare list of instructions is one computation.
    comps = computations(hlo_text) or {'': hlo_text.splitlines()}
    lines = [(comp, line) for comp, body in comps.items() for line in body]
    callers: dict[str, str] = {}  # a fusion -> the computation using it (the first in the text)
    for comp, calls in call_graph(comps).items():
        for call in calls:
            if call.kind == 'inner':
                callers.setdefault(call.callee, comp)
    for comp, line in lines:
        m = _INSTRUCTION.search(line)
        if not m:
            continue
        kind = m.group('kind')
        shape = m.group('shape')  # what it produces (a combined collective: all its results)
        paired = m.group('start') and kind in ('all-gather', 'collective-permute')
        if paired and shape.startswith('('):  # an async start holds (operand, result, ...)
            shape = tuple_elements(shape)[1]
        groups = replica_groups(m.group('rest'), num_devices)
        channel = re.search(r'channel_id=(\d+)', line)
        chain = tuple(re.findall(r'(?:async_collective_name|chain_id)="[^"]*"', line))
        identity = (channel.group(1) if channel else f'local-{next(unnumbered)}', kind,
                    chain or _runner(comp, callers), re.sub(r'\{[^}]*\}', '', shape),
                    tuple(map(tuple, groups)), op_name(line))
        copy = 0  # two alike in one computation are two collectives
        while identity + (copy,) in found and comp in held_in[identity + (copy,)]:
            copy += 1
        key, times = identity + (copy,), (runs or {}).get(comp, 1)
        if key in found:  # another copy of a collective already counted
            held_in[key].add(comp)
            found[key] = dataclasses.replace(found[key], runs=min(found[key].runs, times))
            continue
        coords = [np.unravel_index(np.asarray(g), tuple(mesh_shape)) for g in groups]
        axes = tuple(name for i, name in enumerate(axis_names)
                     if any(len(set(c[i].tolist())) > 1 for c in coords))
        dcn = any(len({slice_of[d] for d in g}) > 1 for g in groups)
        found[key] = Collective(kind=kind, bytes=shape_bytes(shape),
                                group_size=max(len(g) for g in groups), axes=axes, dcn=dcn,
                                op_name=identity[-1], runs=times)
        held_in[key] = {comp}
    return list(found.values()) + _dcn_transfers(lines, mesh_shape, axis_names, slice_of,
                                                 runs or {})


def _runner(comp: str, callers: dict[str, str]) -> str:
    """The computation that runs `comp`: itself, or for a fusion (or an async wrapper) the
    entry, loop body or branch it is called from."""
    seen = {comp}
    while comp in callers and callers[comp] not in seen:
        comp = callers[comp]
        seen.add(comp)
    return comp


def _dcn_transfers(lines: list[tuple[str, str]], mesh_shape: Sequence[int],
                   axis_names: Sequence[str], slice_of: Sequence[int],
                   runs: dict[str, int]) -> list[Collective]:
    """The cross-slice parts of collectives: one per rendezvous of the multislice runtime's
    sends, sized by the array each slice sends, over the mesh axes that change slice.
    `lines`: (computation, instruction line) pairs, as `collectives` splits the text."""
    slices = np.asarray(slice_of).reshape(tuple(mesh_shape))
    axes = tuple(name for i, name in enumerate(axis_names)
                 if np.any(np.diff(slices, axis=i) != 0))
    n = len(set(slice_of))
    found: dict[str, Collective] = {}
    for comp, line in lines:
        m = _DCN_SEND.search(line)
        if not m or m.group('name') in found:
            continue
        kind = m.group('kind').lower().replace('_', '-')  # ALL_GATHER: all-gather
        sent = shape_bytes(m.group('shape'))  # one slice's piece (all-gather) or array
        found[m.group('name')] = Collective(
            kind=kind, bytes=sent * n if kind == 'all-gather' else sent, group_size=n,
            axes=axes, dcn=True, op_name=op_name(line, m.group('name')),
            runs=runs.get(comp, 1))
    return list(found.values())
