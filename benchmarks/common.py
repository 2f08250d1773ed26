"""Shared benchmark plumbing: thread counts, timing, ratio statistics, the --json record."""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Mapping, Optional


def set_threads(n: int) -> None:
    """Same thread count for XLA:CPU and torch; call before either starts its pool."""
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
    record = {**record, "load_average_1min": load_average(), "cpu_count": os.cpu_count()}
    Path(path).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
