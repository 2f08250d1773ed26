"""Published figures of the TPU chips a plan is made for (per chip), and the topology names.

Sources (Google Cloud TPU system-architecture pages, cited in docs/pod.md):
  v4   275 TFLOP/s bf16, 32 GiB HBM2 at 1,200 GB/s.
  v5e  197 TFLOP/s bf16, 16 GiB HBM2 at 819 GB/s, 400 GB/s bidirectional ICI per chip,
       2 x 100 Gb/s NICs per host of 8 chips (25 Gb/s of data-center network per chip).
  v5p  459 TFLOP/s bf16, 95 GiB HBM2e at 2,765 GB/s, 1,200 GB/s ICI per chip, 50 Gb/s DCN per
       chip.
  v6e  918 TFLOP/s bf16, 32 GB HBM at 1,638 GB/s, 800 GB/s ICI per chip.
Where a page gives no figure (v4's ICI and DCN, v6e's DCN) the value is marked `assumed` and
docs/pod.md says what was assumed. These are peaks: a plan's times are a roofline, not a
measurement.
"""
from __future__ import annotations

import dataclasses
import math
import re

from jaxsim.errors import JaxsimError

GiB = 2 ** 30


class TopologyError(JaxsimError):
    """A topology name this planner cannot compile for (one line, before any compile)."""


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU chip's published peaks: `peak_flops` of bf16 matrix products, ICI bidirectional
    over all ports, DCN between slices; `assumed`: the fields no published page gives."""

    name: str
    device_kind: str
    hbm_bytes: int
    peak_flops: float
    hbm_bytes_per_s: float
    ici_bytes_per_s: float
    dcn_bytes_per_s: float
    assumed: tuple[str, ...] = ()


CHIPS: dict[str, Chip] = {
    'v4': Chip('v4', 'TPU v4', 32 * GiB, 275e12, 1200e9, ici_bytes_per_s=300e9,
               dcn_bytes_per_s=50e9 / 8, assumed=('ici_bytes_per_s', 'dcn_bytes_per_s')),
    'v5e': Chip('v5e', 'TPU v5 lite', 16 * GiB, 197e12, 819e9, ici_bytes_per_s=400e9,
                dcn_bytes_per_s=25e9 / 8),
    'v5p': Chip('v5p', 'TPU v5', 95 * GiB, 459e12, 2765e9, ici_bytes_per_s=1200e9,
                dcn_bytes_per_s=50e9 / 8),
    'v6e': Chip('v6e', 'TPU v6 lite', 32 * 10 ** 9, 918e12, 1638e9, ici_bytes_per_s=800e9,
                dcn_bytes_per_s=50e9 / 8, assumed=('dcn_bytes_per_s',)),
}

# Accepted spellings: 'v5e:4x4' (chip:grid, as jax's topology descriptions take it) and the
# accelerator types of the Cloud console ('v5e-16', 'v5litepod-16', 'v4-32', 'v5p-128').
_ALIASES = {'v5litepod': 'v5e', 'v5lite': 'v5e', 'v6litepod': 'v6e', 'v6lite': 'v6e'}
# The grid a chip count is laid out as, for the accelerator-type spelling.
_GRIDS_2D = {1: '1x1', 4: '2x2', 8: '2x4', 16: '4x4', 32: '4x8', 64: '8x8', 128: '8x16',
             256: '16x16'}
_GRIDS_3D = {4: '2x2x1', 8: '2x2x2', 16: '2x2x4', 32: '2x4x4', 64: '4x4x4', 128: '4x4x8',
             256: '4x8x8', 512: '8x8x8', 1024: '8x8x16', 2048: '8x16x16', 4096: '16x16x16'}


@dataclasses.dataclass(frozen=True)
class Topology:
    """A named slice: its chip and the `chip:grid` name jax's topology description takes."""

    chip: Chip
    name: str  # e.g. 'v5e:4x4'

    @property
    def grid(self) -> tuple[int, ...]:
        return tuple(int(x) for x in self.name.split(':')[1].split('x'))

    @property
    def chips(self) -> int:
        return math.prod(self.grid)


def parse_topology(text: str) -> Topology:
    """'v5e:4x4', 'v5e-16', 'v5litepod-256', 'v4-32' or 'v5p:4x4x4' -> Topology.

    Raises:
      TopologyError: naming the accepted forms and chips.
    """
    known = ', '.join(CHIPS)
    m = re.fullmatch(r'([a-z0-9]+)(?::(\d+(?:x\d+){1,2})|-(\d+))', text.strip().lower())
    if m is None:
        raise TopologyError(f"--topology {text}: expected CHIP:GRID (e.g. v5e:4x4, v5p:4x4x4) or "
                            f"an accelerator type (e.g. v5e-256, v4-32); chips: {known}")
    chip = _ALIASES.get(m.group(1), m.group(1))
    if chip not in CHIPS:
        raise TopologyError(f'--topology {text}: unknown chip {m.group(1)!r}; known: {known}')
    three_d = chip in ('v4', 'v5p')  # their accelerator types count TensorCores, 2 a chip
    if m.group(2):
        if m.group(2).count('x') != (2 if three_d else 1):
            raise TopologyError(f'--topology {text}: a {chip} slice is '
                                f'{"AxBxC" if three_d else "AxB"}, e.g. '
                                f'{chip}:{"2x2x1" if three_d else "4x4"}')
        return Topology(CHIPS[chip], f'{chip}:{m.group(2)}')
    units = int(m.group(3))
    chips, rest = divmod(units, 2 if three_d else 1)
    grid = (_GRIDS_3D if three_d else _GRIDS_2D).get(chips)
    if rest or grid is None:
        raise TopologyError(f'--topology {text}: no {chip} slice of {units} '
                            f'{"TensorCores" if three_d else "chips"}; '
                            f'give the grid, e.g. {chip}:4x4' + ('x4' if three_d else ''))
    return Topology(CHIPS[chip], f'{chip}:{grid}')
