"""benchmarks/encode_speed.py end to end on a tiny random-init model (saved as a
sentence-transformers folder both sides load): jaxsim float32 / bf16 beside sentence-transformers
float32 / bf16 autocast (and jaxsim in the layers' plain form, `--compare-forms`), every ratio
recomputed from the record's per-round rates, the pass's FLOP count from XLA against the
model's product count, the fraction of the measured peak."""
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
from common import SHAPES  # noqa: E402

DTYPES = ("float32", "bfloat16")
TEXTS, BATCH = 20, 8


def test_tiny_run_writes_a_consistent_record(tmp_path):
    out = tmp_path / "encode.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "encode_speed.py"), "--shape", "tiny",
         "--limit", str(TEXTS), "--batch-size", str(BATCH), "--repeats", "2", "--peak-size",
         "64", "--peak-repeats", "2", "--threads", "1", "--compare-forms", "--json", str(out)],
        cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
        timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["shape"] == "tiny" and record["threads"] == 1
    peaks = record["peak_gflops"]
    assert set(record["sets"]) == {"stsb_test", "long_64_128"}
    for name, entry in record["sets"].items():
        assert entry["texts"] == TEXTS
        assert entry["max_abs_diff"] < 1e-4  # same random weights on both sides
        rates = entry["rates"]
        assert set(rates) == {f"{side}_{d}" for side in ("jaxsim", "st") for d in DTYPES} | {
            f"jaxsim_{d}_xla_forms" for d in DTYPES}
        for key, values in rates.items():
            check_rate(entry[f"{key}_per_s"], values)
        for dtype in DTYPES:
            for ref in DTYPES:
                check_ratio(entry["ratios"][f"{dtype}_vs_st_{ref}"], rates[f"jaxsim_{dtype}"],
                            rates[f"st_{ref}"])
            check_ratio(entry["ratios"][f"{dtype}_cpu_vs_xla_forms"], rates[f"jaxsim_{dtype}"],
                        rates[f"jaxsim_{dtype}_xla_forms"])
            flops = entry[f"jaxsim_{dtype}_flops_per_pass"]
            # At least the products of TEXTS texts of 2+ tokens, padded batches of BATCH rows
            # (3 of them) of at most 128 tokens.
            assert products_flops(SHAPES["tiny"], TEXTS * 2, 2, passes=1) <= flops
            assert flops <= 2 * products_flops(SHAPES["tiny"], 3 * BATCH * 128, 128, passes=1)
            assert entry[f"jaxsim_{dtype}_peak_gflops"] == peaks["jax"][dtype]
            assert entry[f"jaxsim_{dtype}_fraction_of_peak"] == pytest.approx(
                flops * entry[f"jaxsim_{dtype}_per_s"] / TEXTS / 1e9 / peaks["jax"][dtype])
            assert entry[f"st_{dtype}_fraction_of_peak"] == pytest.approx(
                flops * entry[f"st_{dtype}_per_s"] / TEXTS / 1e9 / peaks["torch"][dtype])
        # Each side's fastest configuration by its median rate, ratios per round.
        best = entry["best_vs_best"]
        assert best["ours"] == max((f"jaxsim_{d}" for d in DTYPES),
                                   key=lambda k: entry[f"{k}_per_s"])
        assert best["reference"] == max((f"st_{d}" for d in DTYPES),
                                        key=lambda k: entry[f"{k}_per_s"])
        check_ratio(best, rates[best["ours"]], rates[best["reference"]])
    # Headline: each at its best on STS-B.
    assert record["ratio"] == record["sets"]["stsb_test"]["best_vs_best"]["ratio"]
    assert set(record["cpu"]) >= {"model", "avx2", "avx512_bf16", "amx_bf16"}
    assert "load_average_1min" in record
    assert "vs ST bfloat16" in proc.stdout and "plain (xla) forms" in proc.stdout


def test_refuses_an_unknown_set():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "encode_speed.py"), "--sets", "stsb_test,news",
         "--threads", "1"], cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 2
    assert "--sets: unknown news; known: stsb_test, long_64_128" in proc.stderr
    assert "Traceback" not in proc.stderr
