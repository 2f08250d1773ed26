"""What the host CPU can compute fast: its bf16 instructions.

XLA:CPU runs bf16 products on bf16 hardware (AVX512_BF16, AMX) where the CPU has it; elsewhere
(e.g. an AVX2-only AMD EPYC) it converts to float32 and back around float32 kernels, so bf16
compute is slower than float32 there (docs/performance.md, "Figures the code relies on"), and
choosing bf16 there logs a warning.
"""
from __future__ import annotations

import functools
import logging
import platform
from pathlib import Path
from typing import Iterable, Optional

log = logging.getLogger(__name__)

BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def _cpuinfo() -> dict:
    """The first CPU's fields in /proc/cpuinfo (Linux); empty where it cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the end of the first CPU's block
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_flags() -> Optional[frozenset]:
    """The CPU's feature flags (Linux); None where they cannot be read."""
    flags = _cpuinfo().get("flags")
    return None if flags is None else frozenset(flags.split())


def cpu_model() -> Optional[str]:
    return _cpuinfo().get("model name")


def bf16_emulated(platforms: Iterable[str]) -> bool:
    """True when bf16 compute on devices of these platforms runs on an x86 CPU without bf16
    instructions (known only on Linux x86_64; False where it cannot be told)."""
    if "cpu" not in platforms or platform.machine() not in ("x86_64", "AMD64"):
        return False
    flags = cpu_flags()
    return flags is not None and not any(flag in flags for flag in BF16_FLAGS)


_warned = False


def warn_if_bf16_emulated(dtype, platforms: Iterable[str]) -> bool:
    """Logs once per process that bf16 `dtype` is slower than float32 on this CPU; returns
    whether the warning applies."""
    global _warned
    name = getattr(dtype, "name", None) or getattr(dtype, "__name__", None) or str(dtype)
    if name != "bfloat16" or not bf16_emulated(platforms):
        return False
    if not _warned:
        _warned = True
        log.warning("bf16 compute is emulated on this CPU (no AVX512_BF16 or AMX): float32 "
                    "runs faster here")
    return True
