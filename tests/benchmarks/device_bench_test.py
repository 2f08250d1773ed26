"""benchmarks/device_bench.py end to end on the CPU with its tiny model, so it cannot rot:
the JSON record, XLA's FLOP count against the model's own product count, TFLOP/s, MFU and
fraction-of-peak arithmetic, and PyTorch float32 and bf16 autocast on the same device, every
ratio recomputed from the record's per-round rates."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.records import check_rate, check_ratio, products_flops
from tests.conftest import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import device_bench  # noqa: E402


def test_tiny_run_writes_a_consistent_record(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "device_bench.py"), "--tiny", "--dtype",
         "float32", "--steps", "1", "--repeats", "2", "--warmup", "1", "--peak-tflops", "0.5",
         "--peak-size", "64", "--peak-repeats", "2", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["model"] == "tiny" and record["platform"] == "cpu"
    assert record["peak_tflops"] == 0.5 and record["peak_source"] == "--peak-tflops"
    assert record["torch_device"] == "cpu"
    peaks = record["peak_gflops"]
    assert peaks["size"] == 64 and peaks["torch_device"] == "cpu"
    assert set(record["settings"]) == {"unsup", "sup"}
    arch, length = record["architecture"], record["length"]
    for name, row in record["settings"].items():
        tokens = row["batch"] * row["views"] * length
        products = products_flops(arch, tokens, length)
        # XLA counts every op (elementwise, softmax, the optimizer) on top of the products.
        assert products <= row["flops_per_step"] <= 4 * products, (name, row, products)
        rates = row["rates"]
        assert set(rates) == {"jaxsim", "jaxsim_packed", "pytorch_float32", "pytorch_bfloat16"}
        for side, values in rates.items():
            check_rate(row[f"{side}_steps_per_s"], values)
        for side in ("jaxsim", "pytorch_float32", "pytorch_bfloat16"):
            assert row[f"{side}_tflops"] == pytest.approx(
                row["flops_per_step"] * row[f"{side}_steps_per_s"] / 1e12)
        # The packed contender (rows of the length): its own FLOPs, ratios from its rounds.
        assert row["packed_tflops"] == pytest.approx(
            row["packed_flops_per_step"] * row["jaxsim_packed_steps_per_s"] / 1e12)
        assert row["packed_mfu"] == pytest.approx(row["packed_tflops"] / 0.5)
        assert row["packed_fraction_of_peak"] == pytest.approx(
            row["packed_tflops"] * 1e3 / peaks["jax"]["float32"])
        assert row["jaxsim_mfu"] == pytest.approx(row["jaxsim_tflops"] / 0.5)
        assert row["peak_gflops"] == peaks["jax"]["float32"]
        assert row["fraction_of_peak"] == pytest.approx(
            row["jaxsim_tflops"] * 1e3 / peaks["jax"]["float32"])
        for ref in ("float32", "bfloat16"):
            check_ratio(row[f"vs_pytorch_{ref}"], rates["jaxsim"], rates[f"pytorch_{ref}"])
            check_ratio(row[f"packed_vs_pytorch_{ref}"], rates["jaxsim_packed"],
                        rates[f"pytorch_{ref}"])
            assert row[f"pytorch_{ref}_fraction_of_peak"] == pytest.approx(
                row[f"pytorch_{ref}_tflops"] * 1e3 / peaks["torch"][ref])
        assert row["ratio"] == row["vs_pytorch_float32"]["ratio"]  # jaxsim's dtype: float32
    assert record["ratio"] == record["settings"]["unsup"]["ratio"]
    assert "load_average_1min" in record  # written through common.write_json
    assert "bfloat16 autocast" in proc.stdout


@pytest.mark.parametrize("kind, dtype, matmul, expected", [
    ("NVIDIA H200", "bfloat16", "highest", 989.4),
    ("NVIDIA H100 80GB HBM3", "float32", "highest", 66.9),
    ("NVIDIA A100-SXM4-80GB", "float32", "tf32", 156.0),
    ("TPU v4", "bfloat16", "highest", 275.0),
    ("TPU v4", "float32", "highest", None),
    ("cpu", "bfloat16", "highest", None),
])
def test_peak_table(kind, dtype, matmul, expected):
    assert device_bench.peak_tflops(kind, dtype, matmul) == expected
