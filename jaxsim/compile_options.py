"""XLA compiler options for programs whose compile time rivals their run time.

A flow fit, a flow's apply and a tiny test model run for a few seconds at most, so on CPU the
XLA compile of their programs is most of their cost. Two XLA:CPU settings trade run time for
compile time (figures: docs/performance.md, "Figures the code relies on"): the classic loop
emitters instead of the MLIR fusion emitters (`xla_cpu_use_fusion_emitters=False`), and LLVM's
-O level (`xla_backend_optimization_level`): 1 for programs run many times, 0 only for programs
run once. Other platforms get the defaults: their compilers are not the bottleneck here.
"""
from __future__ import annotations

from typing import Iterable, Optional

import jax

# How much optimization a program gets, by how often it runs.
EFFORTS = ('default', 'light', 'none')


def for_effort(devices: Iterable[jax.Device], effort: str) -> Optional[dict]:
    """Options for `jax.jit(..., compiler_options=...)` on `devices`.

    Args:
      devices: the devices the program runs on (e.g. `mesh.devices.flat`).
      effort: 'default' (XLA's defaults), 'light' (programs run many times but briefly: -O1,
        classic emitters) or 'none' (programs run once: -O0, classic emitters).

    Returns:
      A dict of XLA options, or None for XLA's defaults (non-CPU devices, effort 'default').
    """
    if effort not in EFFORTS:
        raise ValueError(f'compile effort {effort!r}; expected one of {EFFORTS}')
    if effort == 'default' or any(d.platform != 'cpu' for d in devices):
        return None
    return {'xla_cpu_use_fusion_emitters': False,
            'xla_backend_optimization_level': 1 if effort == 'light' else 0}
