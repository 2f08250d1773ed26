"""benchmarks/remat_memory.py end to end on a tiny random-init model, so it cannot rot: one row
per setting with XLA's memory figures, the ratio recomputed from the rows. Step timing
(--time-batch) compiles every setting a second time; it is left out here to halve the cost, and
the steps compile at -O0 (--fast-compile: the same temp figures for this model, at 40% of the
CPU time)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run_writes_a_consistent_record(tmp_path):
    out = tmp_path / "remat.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "remat_memory.py"), "--shape", "tiny",
         "--batch", "128", "--time-batch", "0", "--max-len", "8", "--fast-compile", "--json",
         str(out)],
        cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
        timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    rows = record["rows"]
    assert [(r["remat"], r["micro_batch_size"]) for r in rows] == [
        ("none", 0), ("full", 0), ("dots", 0), ("none", 64)]
    assert all(r["temp_mb"] > 0 and r["step_s"] is None for r in rows)
    none = rows[0]["temp_mb"]
    assert record["ratio"] == round(min(r["temp_mb"] for r in rows) / none, 3)
    # Micro-batches of 64 of a batch of 128 keep half the activations on every backend.
    assert rows[3]["temp_mb"] < none
