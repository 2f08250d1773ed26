"""benchmarks/train_speed.py end to end on a tiny random-init model, so it cannot rot: jaxsim
beside PyTorch float32 and PyTorch bf16 autocast, every ratio recomputed from the record's own
per-round rates, XLA's FLOP count against the model's product count, the fraction of the
measured peak; and the PyTorch side's peak-RSS child under autocast."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.benchmarks.records import check_rate, check_ratio, parameter_count, products_flops
from tests.conftest import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import SHAPES  # noqa: E402

BATCH, LENGTH = 4, 8


def test_tiny_run_writes_a_consistent_record(tmp_path):
    out = tmp_path / "train.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "train_speed.py"), "--shape", "tiny",
         "--rows", "unsup:bfloat16", "--batch", str(BATCH), "--max-len", str(LENGTH),
         "--repeats", "2", "--steps", "1", "--peak-size", "64", "--peak-repeats", "2",
         "--threads", "1", "--no-rss", "--json", str(out)],
        cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
        timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["shape"] == "tiny" and record["threads"] == 1
    assert record["pack_length"] == LENGTH  # the default: rows of max_len
    peaks = record["peak_gflops"]
    assert peaks["size"] == 64 and all(
        peaks[fw][dt] > 0 for fw in ("jax", "torch") for dt in ("float32", "bfloat16"))
    assert set(record["rows"]) == {"unsup:bfloat16"}
    row = record["rows"]["unsup:bfloat16"]
    rates = row["rates"]
    assert set(rates) == {"jaxsim", "jaxsim_packed", "pytorch_float32", "pytorch_bfloat16"}
    for side in rates:
        check_rate(row[f"{side}_steps_per_s"], rates[side])
        assert row[f"{side}_sentences_per_s"] == pytest.approx(
            row[f"{side}_steps_per_s"] * BATCH * 2)  # two dropout views
    for ref in ("float32", "bfloat16"):
        check_ratio(row[f"vs_pytorch_{ref}"], rates["jaxsim"], rates[f"pytorch_{ref}"])
        assert row[f"pytorch_{ref}_fraction_of_peak"] == pytest.approx(
            row["flops_per_step"] * row[f"pytorch_{ref}_steps_per_s"] / 1e9 / peaks["torch"][ref])
    # The row's ratio is against PyTorch's same compute dtype: bf16 autocast.
    assert row["reference_dtype"] == "bfloat16"
    assert row["ratio"] == row["vs_pytorch_bfloat16"]["ratio"]
    # Against the faster PyTorch of the rounds; the headline: the only unsup row, so far.
    faster = max(("pytorch_float32", "pytorch_bfloat16"), key=lambda k: row[f"{k}_steps_per_s"])
    assert row["vs_pytorch_best"]["reference"] == faster
    check_ratio(row["vs_pytorch_best"], rates["jaxsim"], rates[faster])
    assert record["ratio"] == row["vs_pytorch_best"]["ratio"]
    assert record["ratio_row"] == "unsup:bfloat16" and record["ratio_reference"] == faster
    arch = SHAPES["tiny"]
    products = products_flops(arch, tokens=BATCH * 2 * LENGTH, length=LENGTH)
    # XLA also counts the elementwise work, the embedding gradient and AdamW over every weight.
    assert products <= row["flops_per_step"] <= 4 * products + 40 * parameter_count(arch)
    assert row["peak_gflops"] == peaks["jax"]["bfloat16"]
    assert row["jaxsim_gflops"] == pytest.approx(
        row["flops_per_step"] * row["jaxsim_steps_per_s"] / 1e9)
    assert row["fraction_of_peak"] == pytest.approx(row["jaxsim_gflops"] / row["peak_gflops"])
    # The packed contender: the same rounds, its ratios and peak share from its own rates.
    for ref in ("float32", "bfloat16"):
        check_ratio(row[f"packed_vs_pytorch_{ref}"], rates["jaxsim_packed"],
                    rates[f"pytorch_{ref}"])
    check_ratio(row["packed_vs_pytorch_best"], rates["jaxsim_packed"], rates[faster])
    assert record["packed_ratio"] == row["packed_vs_pytorch_best"]["ratio"]
    assert row["packed_fraction_of_peak"] == pytest.approx(
        row["packed_flops_per_step"] * row["jaxsim_packed_steps_per_s"] / 1e9
        / row["peak_gflops"])
    assert "load_average_1min" in record  # written through common.write_json
    assert "vs bf16" in proc.stdout and "of peak" in proc.stdout


def test_pytorch_memory_child_under_autocast(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"input_ids": rng.integers(5, 1000, (BATCH, 1, LENGTH), dtype=np.int32),
              "attention_mask": np.ones((BATCH, 1, LENGTH), np.int32),
              "token_type_ids": np.zeros((BATCH, 1, LENGTH), np.int32)}
    np.savez(tmp_path / "unsup.npz", **arrays)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "torch_reference.py"), "--arrays",
         str(tmp_path / "unsup.npz"), "--shape", "tiny", "--autocast", "bfloat16",
         "--steps", "1"], cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    memory = json.loads([x for x in proc.stdout.splitlines() if x.startswith("RSS ")][-1][4:])
    assert memory["peak_rss_mb"] >= memory["after_imports_rss_mb"] > 0
    assert memory["step_rss_mb"] == pytest.approx(
        memory["peak_rss_mb"] - memory["after_imports_rss_mb"], abs=0.11)
