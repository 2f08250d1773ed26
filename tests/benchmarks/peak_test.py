"""benchmarks/peak.py: the matrix-product peak record (GFLOP/s from the best time of each
framework and dtype) and the fraction-of-peak arithmetic every benchmark uses."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import peak  # noqa: E402


def test_tiny_run_writes_a_consistent_record(tmp_path):
    out = tmp_path / "peak.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "peak.py"), "--size", "64", "--repeats", "2",
         "--threads", "1", "--json", str(out)], cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
        timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["size"] == 64 and record["repeats"] == 2 and record["threads"] == 1
    assert record["flops_per_product"] == 2 * 64 ** 3
    assert record["sizes"] == {fw: {"float32": 64, "bfloat16": 64} for fw in ("jax", "torch")}
    assert record["torch_device"] == "cpu" and record["cpus_used"] == 1
    for framework in ("jax", "torch"):
        for dtype in ("float32", "bfloat16"):
            best = record["best_s"][framework][dtype]
            assert best > 0
            assert record[framework][dtype] == pytest.approx(2 * 64 ** 3 / best / 1e9)
    assert record["ratio"] == pytest.approx(record["jax"]["float32"] / record["torch"]["float32"])
    assert "load_average_1min" in record  # written through common.write_json
    assert "matrix-product peak (64x64, best of 2, GFLOP/s): jax float32" in proc.stdout


def test_a_slow_product_is_timed_at_a_smaller_size(monkeypatch):
    """The probe is timed on a clock the test advances by the product's FLOPs at a given rate:
    the sizes chosen are a function of that rate alone, not of this machine's load."""
    made, now = [], [0.0]

    def make(rate_flops_per_s):
        def make_at(n):
            made.append(n)

            def run():
                now[0] += 2 * n ** 3 / rate_flops_per_s
            return run
        return make_at

    def clock():
        return now[0]

    monkeypatch.setattr(peak, "SLOW_PRODUCT_S", 0.05)
    # 2 * 256^3 = 33.6 MFLOP at 1 GFLOP/s: 34 ms at 256, so 2048^3 would take 17 s and 512^3
    # 0.27 s; 256 is the largest size within 0.05 s.
    assert peak.timed_size(make(1e9), 2048, clock) == 256
    assert made == [256]  # only the probe was run
    assert peak.timed_size(make(1e11), 2048, clock) == 1024  # 2048^3: 0.17 s, 1024^3: 21 ms
    assert peak.timed_size(make(1e13), 2048, clock) == 2048  # a fast kernel keeps the asked size
    assert peak.timed_size(make(1e9), 64, clock) == 64  # below the probe: the size itself


def test_fraction_of_peak():
    # 2 GFLOP a step at 3 steps/s on a 12 GFLOP/s peak: half the peak.
    assert peak.fraction_of_peak(2e9, 3.0, 12.0) == pytest.approx(0.5)
    assert peak.fraction_of_peak(2e9, 3.0, None) is None  # no peak measured
    assert peak.fraction_of_peak(0.0, 3.0, 12.0) is None  # no FLOP count from the backend


def test_importing_loads_no_framework():
    # A fresh interpreter: this test process has long imported jax and torch.
    probe = ("import sys; import peak; "
             "print(sorted(m for m in ('jax', 'jaxsim', 'torch') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT / "benchmarks",
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"


def test_refuses_a_non_positive_size(capsys):
    with pytest.raises(SystemExit):
        peak.main(["--size", "0"])
    assert "--size and --repeats must be positive" in capsys.readouterr().err



def test_a_benchmark_prints_no_libtpu_start_up_lines_without_a_tpu(tmp_path, monkeypatch):
    """Benchmarks apply the commands' process set-up: in the test venv (libtpu installed for
    the plan) on a TPU-less host they printed libtpu's start-up errors before their figures."""
    from jaxsim.cli import environment

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    if not environment.skips_absent_tpu():  # a TPU or GPU host, or no libtpu: not this case
        pytest.skip("this host has a TPU, a GPU plugin or no libtpu")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "peak.py"), "--size", "32", "--repeats", "1",
         "--threads", "1", "--json", str(tmp_path / "p.json")],
        cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == "", proc.stderr[-3000:]
