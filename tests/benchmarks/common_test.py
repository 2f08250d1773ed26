"""benchmarks/common: set_threads gives both sides the same cores (XLA_FLAGS stays valid);
ChildContender runs a side in its own process and reports a child that dies."""
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
import common  # noqa: E402

# Pins itself twice, then a child (inheriting the pin) pins again and runs a jitted matmul.
_SCRIPT = """
import json, os, subprocess, sys
sys.path.insert(0, {bench!r})
from common import set_threads
set_threads(1)
set_threads(1)
if len(sys.argv) > 1:
    import jax, jax.numpy as jnp
    x = jnp.ones((64, 64), jnp.float32)
    value = float(jax.jit(lambda a: (a @ a).sum())(x))
    print(json.dumps({{"cpus": sorted(os.sched_getaffinity(0)), "value": value,
                      "omp": os.environ["OMP_NUM_THREADS"],
                      "xla_flags": os.environ.get("XLA_FLAGS")}}))
else:
    out = subprocess.run([sys.executable, __file__, "child"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    print(json.dumps({{"parent_cpus": sorted(os.sched_getaffinity(0)),
                      "child": json.loads(out.stdout.splitlines()[-1])}}))
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")
def test_set_threads_pins_once_and_children_keep_it(tmp_path):
    script = tmp_path / "pin.py"
    script.write_text(_SCRIPT.format(bench=str(ROOT / "benchmarks")))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_cpu_multi_thread_eigen=true")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout.splitlines()[-1])
    first = min(os.sched_getaffinity(0))
    assert record["parent_cpus"] == [first]
    child = record["child"]
    assert child["cpus"] == [first] and child["omp"] == "1"
    assert child["xla_flags"] == "--xla_cpu_multi_thread_eigen=true"  # untouched
    assert child["value"] == 64.0 * 64 * 64


def test_set_threads_refuses_counts_outside_the_usable_cpus():
    for n in (0, common.available_cpus() + 1):
        with pytest.raises(SystemExit, match=f"--threads {n}: this process may use 1 to"):
            common.set_threads(n)


def test_alternating_runs_the_contenders_in_turn():
    calls = []
    contenders = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    rates = common.alternating(contenders, work=10.0, repeats=3)
    assert calls == ["a", "b", "c"] * 3
    assert set(rates) == {"a", "b", "c"}
    for r in rates.values():
        assert len(r["rates"]) == 3 and all(x > 0 for x in r["rates"])
        assert r["per_s"] == sorted(r["rates"])[1]  # the median of three


def test_ratio_stats_are_per_round_ratios():
    stats = common.ratio_stats([4.0, 9.0, 3.0], [2.0, 3.0, 3.0])  # round ratios 2, 3, 1
    assert stats == {"ratio": 2.0, "ratio_min": 1.0, "ratio_max": 3.0, "repeats": 3}


def test_best_vs_best_pairs_each_sides_fastest_configuration():
    # Ours: bf16 faster; theirs: float32 faster (bf16 autocast emulated on this CPU).
    rates = {"ours_f32": {"per_s": 10.0, "rates": [10.0, 9.0, 11.0]},
             "ours_bf16": {"per_s": 20.0, "rates": [20.0, 18.0, 30.0]},
             "ref_f32": {"per_s": 8.0, "rates": [8.0, 9.0, 10.0]},
             "ref_bf16": {"per_s": 2.0, "rates": [2.0, 2.0, 2.0]}}
    best = common.best_vs_best(rates, ["ours_f32", "ours_bf16"], ["ref_f32", "ref_bf16"])
    assert (best["ours"], best["reference"]) == ("ours_bf16", "ref_f32")
    assert (best["ratio"], best["ratio_min"], best["ratio_max"]) == (2.5, 2.0, 3.0)


def test_cpu_description_names_the_bf16_instruction_sets():
    cpu = common.cpu_description()
    assert set(cpu) == {"model", "avx2", "avx512f", "avx512_bf16", "amx_bf16"}
    flags = next((line.split(":", 1)[1].split() for line in
                  Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")),
                 [])
    assert cpu["amx_bf16"] == ("amx_bf16" in flags)
    assert cpu["avx512_bf16"] == ("avx512_bf16" in flags)


def test_alternating_rates_keeps_its_two_sided_record():
    record = common.alternating_rates(lambda: None, lambda: None, work=1.0, repeats=2)
    assert set(record) == {"ours_per_s", "reference_per_s", "ratio", "ratio_min", "ratio_max",
                           "repeats"}
    assert record["ratio_min"] <= record["ratio"] <= record["ratio_max"]


# A contender that counts its runs in a file and says its pid; "fail" dies before READY.
_CONTENDER = """
import os, sys
sys.path.insert(0, {bench!r})
from common import serve_contender
if sys.argv[1] == "fail":
    sys.exit("cannot build the step: bad arrays.npz")
count = [0]
def run():
    count[0] += 1
    with open(sys.argv[1], "w") as f:
        f.write(str(count[0]))
serve_contender(run, {{"pid": os.getpid()}})
"""


def test_child_contender_runs_its_work_in_another_process_per_call(tmp_path):
    script = tmp_path / "contender.py"
    script.write_text(_CONTENDER.format(bench=str(ROOT / "benchmarks")))
    counter = tmp_path / "runs"
    side = common.ChildContender([sys.executable, str(script), str(counter)])
    try:
        assert side.info["pid"] != os.getpid()
        rates = common.alternating({"child": side, "here": lambda: None}, 1.0, 3)
        assert counter.read_text() == "3"  # one run per round, finished before the call returned
        assert len(rates["child"]["rates"]) == 3
    finally:
        side.close()
    assert side._proc.returncode == 0  # stdin closed: the child's loop ended


def test_child_contender_that_dies_reports_its_stderr(tmp_path):
    script = tmp_path / "contender.py"
    script.write_text(_CONTENDER.format(bench=str(ROOT / "benchmarks")))
    with pytest.raises(RuntimeError, match="before READY(.|\n)*bad arrays.npz"):
        common.ChildContender([sys.executable, str(script), "fail"])
