"""benchmarks/search_speed.py end to end at tiny sizes: the record's ratios follow from its
timings, the exact search finds faiss's rows, and the fraction of JAX's measured float32 peak."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run_writes_a_consistent_record(tmp_path):
    out = tmp_path / "search.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "search_speed.py"), "--rows", "3000",
         "--dims", "16,32", "--queries", "8", "--top-k", "5", "--repeats", "2",
         "--faiss-threads", "1", "--peak-size", "64", "--peak-repeats", "2", "--json",
         str(out)], cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
        text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    peak = record["peak_gflops"]["jax"]["float32"]
    assert peak > 0 and record["peak_gflops"]["size"] == 64
    assert [(c["rows"], c["dim"]) for c in record["configs"]] == [(3000, 16), (3000, 32)]
    for config in record["configs"]:
        assert config["ratio"] == pytest.approx(config["faiss_s"] / config["jaxsim_s"])
        assert config["jaxsim_qps"] == pytest.approx(8 / config["jaxsim_s"])
        assert config["faiss_qps"] == pytest.approx(8 / config["faiss_s"])
        assert config["overlap_with_faiss"] == pytest.approx(1.0)  # both exact
        cpu = config["cpu_s"]
        assert config["bf16_ratio_cpu"] == pytest.approx(cpu["faiss_1"] / cpu["jaxsim_bf16"])
        assert config["ratio_cpu"] == pytest.approx(cpu["faiss_1"] / cpu["jaxsim"])
        assert config["bf16_same_top_k_as_float32"] == 1.0
        assert config["flops"] == 2 * 8 * 3000 * config["dim"]
        assert config["peak_gflops"] == peak
        assert config["fraction_of_peak"] == pytest.approx(
            config["flops"] / config["jaxsim_s"] / 1e9 / peak)
        # Approximate indexes: more probed cells see a superset of rows, so recall never falls.
        recalls = [v["recall"] for v in config["ivf"]["by_nprobe"].values()]
        assert recalls == sorted(recalls) and 0 <= recalls[0] and recalls[-1] <= 1
        for v in [*config["ivf"]["by_nprobe"].values(), *config["hnsw"]["by_ef_search"].values()]:
            assert v["speedup_vs_exact"] == pytest.approx(v["qps"] / config["jaxsim_qps"])
    assert record["ratio"] == pytest.approx(
        math.exp(sum(math.log(c["ratio"]) for c in record["configs"]) / 2))
