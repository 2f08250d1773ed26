"""benchmarks/device_bench.py end to end on the CPU with its tiny model, so it cannot rot:
the JSON record, XLA's FLOP count against the model's own product count, TFLOP/s and MFU
arithmetic, and the PyTorch side on the same device."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import device_bench  # noqa: E402


def _matmul_flops(arch: dict, tokens: int, length: int) -> float:
    """Forward + backward (3x forward) FLOPs of the encoder's products alone."""
    h, inner, layers = arch["hidden_size"], arch["intermediate_size"], arch["num_hidden_layers"]
    per_token = 2 * (4 * h * h + 2 * h * inner)  # q, k, v, attention output; the two FFN dense
    attention = 2 * 2 * length * h  # scores and weighted sum, per token
    return 3 * layers * tokens * (per_token + attention)


def test_tiny_run_writes_a_consistent_record(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "device_bench.py"), "--tiny", "--dtype",
         "float32", "--steps", "2", "--warmup", "1", "--peak-tflops", "0.5", "--json",
         str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["model"] == "tiny" and record["platform"] == "cpu"
    assert record["peak_tflops"] == 0.5 and record["peak_source"] == "--peak-tflops"
    assert record["torch_device"] == "cpu"
    assert set(record["settings"]) == {"unsup", "sup"}
    arch, length = record["architecture"], record["length"]
    for name, row in record["settings"].items():
        tokens = row["batch"] * row["views"] * length
        products = _matmul_flops(arch, tokens, length)
        # XLA counts every op (elementwise, softmax, the optimizer) on top of the products.
        assert products <= row["flops_per_step"] <= 4 * products, (name, row, products)
        assert row["jaxsim_steps_per_s"] > 0 and row["pytorch_steps_per_s"] > 0
        assert row["jaxsim_tflops"] == pytest.approx(
            row["flops_per_step"] * row["jaxsim_steps_per_s"] / 1e12)
        assert row["jaxsim_mfu"] == pytest.approx(row["jaxsim_tflops"] / 0.5)
        assert row["ratio"] == pytest.approx(
            row["jaxsim_steps_per_s"] / row["pytorch_steps_per_s"])
    assert record["ratio"] == record["settings"]["unsup"]["ratio"]
    assert "load_average_1min" in record  # written through common.write_json


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
