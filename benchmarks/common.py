"""Shared benchmark plumbing: thread counts, timing, ratio statistics, the --json record."""
from __future__ import annotations

import json
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Callable, Mapping, Optional


def available_cpus() -> int:
    """CPUs this process may run on (its affinity; os.cpu_count() where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def set_threads(n: int) -> None:
    """Gives XLA:CPU and torch the same `n` cores; call before either starts its thread pool.

    XLA:CPU (jaxlib 0.10) has no XLA_FLAGS entry for its intra-op pool: a bare
    `intra_op_parallelism_threads=N` is not a flag (alone it aborts the process, after a flag it
    is ignored) and `--xla_cpu_multi_thread_eigen=false` still leaves every core busy. The pool
    is sized and run on the CPUs the process may use, so this pins the process (and, by
    inheritance, its children) to the first `n` of them; torch and MKL are told `n` threads.
    Idempotent: a child that calls it again with the same `n` changes nothing.
    """
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    count = len(allowed) if allowed is not None else (os.cpu_count() or 1)
    if not 1 <= n <= count:
        raise SystemExit(f"error: --threads {n}: this process may use 1 to {count} CPUs")
    if n < count:
        if allowed is None:
            raise SystemExit(f"error: --threads {n} needs os.sched_setaffinity (Linux) to keep "
                             f"XLA:CPU to {n} of the {count} CPUs")
        os.sched_setaffinity(0, allowed[:n])
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(n)


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def alternating_rates(ours: Callable[[], object], theirs: Callable[[], object], work: float,
                      repeats: int) -> dict:
    """Runs the two sides alternately `repeats` times; returns both rates and the ratio spread.

    Alternating (A B A B ...) spreads slow drifts of the machine (thermal, other processes) over
    both sides, so the per-pair ratio is steadier than the ratio of two separate bests.
    """
    ours_rates, theirs_rates, ratios = [], [], []
    for _ in range(repeats):
        a = work / seconds(ours)
        b = work / seconds(theirs)
        ours_rates.append(a)
        theirs_rates.append(b)
        ratios.append(a / b)
    return {"ours_per_s": statistics.median(ours_rates),
            "reference_per_s": statistics.median(theirs_rates),
            "ratio": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "repeats": repeats}


def status_mb(field: str) -> float:
    """VmRSS (now) or VmHWM (peak) of this process, from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def print_peak_memory(run: Callable[[], object], steps: int, baseline_mb: float) -> None:
    """Runs `steps` steps, then prints this process's memory figures as one 'RSS {json}' line
    (each benchmark side measures itself in its own process, read back by the parent)."""
    for _ in range(steps):
        run()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: kilobytes
    print("RSS " + json.dumps({"peak_rss_mb": round(peak, 1),
                               "peak_vmhwm_mb": round(status_mb("VmHWM"), 1),
                               "after_imports_rss_mb": round(baseline_mb, 1),
                               "step_rss_mb": round(peak - baseline_mb, 1)}), flush=True)


def load_average() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def write_json(path: Optional[Path], record: Mapping) -> None:
    """Writes the benchmark record (must hold a top-level 'ratio')."""
    if path is None:
        return
    if "ratio" not in record:
        raise ValueError("a benchmark record needs a top-level 'ratio'")
    record = {**record, "load_average_1min": load_average(), "cpu_count": os.cpu_count(),
              "cpus_used": available_cpus()}
    Path(path).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
