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
import re

from jaxsim.errors import JaxsimError

GiB = 2 ** 30


class TopologyError(JaxsimError):
    """A topology name this planner cannot compile for (one line, before any compile)."""


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU chip's published peaks.

    Attributes:
      name: the topology prefix ('v5e').
      device_kind: what JAX's devices of this chip report.
      hbm_bytes: HBM capacity.
      peak_flops: bf16 matrix FLOP/s.
      hbm_bytes_per_s: HBM bandwidth.
      ici_bytes_per_s: inter-chip interconnect bandwidth per chip (bidirectional, all ports).
      dcn_bytes_per_s: data-center network bandwidth per chip (between slices).
      assumed: the fields above that no published page gives (see the module docstring).
    """

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
# Chips per accelerator-type unit: v4 and v5p count TensorCores (2 a chip), v5e/v6e chips.
_CORES_PER_CHIP = {'v4': 2, 'v5p': 2, 'v5e': 1, 'v6e': 1}
# The grid a chip count is laid out as, for the accelerator-type spelling.
_GRIDS_2D = {1: '1x1', 4: '2x2', 8: '2x4', 16: '4x4', 32: '4x8', 64: '8x8', 128: '8x16',
             256: '16x16'}


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
        n = 1
        for x in self.grid:
            n *= x
        return n


def parse_topology(text: str) -> Topology:
    """'v5e:4x4', 'v5e-16', 'v5litepod-256', 'v4-32' or 'v5p:4x4x4' -> Topology.

    Raises:
      TopologyError: naming the accepted forms and chips.
    """
    known = ', '.join(CHIPS)
    spelled = text.strip().lower()
    m = re.fullmatch(r'([a-z0-9]+):(\d+(?:x\d+){1,2})', spelled)
    if m:
        chip = _ALIASES.get(m.group(1), m.group(1))
        if chip not in CHIPS:
            raise TopologyError(f'--topology {text}: unknown chip {m.group(1)!r}; known: {known}')
        dims = m.group(2).split('x')
        if len(dims) != (3 if chip in ('v4', 'v5p') else 2):
            want = 'AxBxC' if chip in ('v4', 'v5p') else 'AxB'
            raise TopologyError(f'--topology {text}: a {chip} slice is {want}, e.g. '
                                f'{chip}:{"2x2x1" if want == "AxBxC" else "4x4"}')
        return Topology(CHIPS[chip], f'{chip}:{m.group(2)}')
    m = re.fullmatch(r'([a-z0-9]+)-(\d+)', spelled)
    if m:
        chip = _ALIASES.get(m.group(1), m.group(1))
        if chip not in CHIPS:
            raise TopologyError(f'--topology {text}: unknown chip {m.group(1)!r}; known: {known}')
        units = int(m.group(2))
        chips, rest = divmod(units, _CORES_PER_CHIP[chip])
        grid = _grid_3d(chips) if chip in ('v4', 'v5p') else _GRIDS_2D.get(chips)
        if rest or grid is None:
            raise TopologyError(f'--topology {text}: no {chip} slice of {units} '
                                f'{"TensorCores" if _CORES_PER_CHIP[chip] > 1 else "chips"}; '
                                f'give the grid, e.g. {chip}:4x4' +
                                ('x4' if chip in ('v4', 'v5p') else ''))
        return Topology(CHIPS[chip], f'{chip}:{grid}')
    raise TopologyError(f"--topology {text}: expected CHIP:GRID (e.g. v5e:4x4, v5p:4x4x4) or an "
                        f"accelerator type (e.g. v5e-256, v4-32); chips: {known}")


def _grid_3d(chips: int):
    """The usual 3-D slice of a chip count (2x2x1 up to 8x8x8 and cube multiples)."""
    small = {4: '2x2x1', 8: '2x2x2', 16: '2x2x4', 32: '2x4x4', 64: '4x4x4', 128: '4x4x8',
             256: '4x8x8', 512: '8x8x8', 1024: '8x8x16', 2048: '8x16x16', 4096: '16x16x16'}
    return small.get(chips)
