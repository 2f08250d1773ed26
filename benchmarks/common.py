"""Shared benchmark plumbing: thread counts, timing, ratio statistics, the --json record."""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Mapping, Optional

# Random-init architectures for `--shape` (BERT vocabulary, so the bundled tokenizer's ids fit).
SHAPES = {
    "bert-base": {"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12,
                  "num_attention_heads": 12, "intermediate_size": 3072,
                  "max_position_embeddings": 512, "type_vocab_size": 2},
    "tiny": {"vocab_size": 30522, "hidden_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 2, "intermediate_size": 37, "max_position_embeddings": 512,
             "type_vocab_size": 2},
}


def available_cpus() -> int:
    """CPUs this process may run on (its affinity; os.cpu_count() where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def setup_process() -> None:
    """The commands' process set-up (`jaxsim.cli.environment.setup`, without the compilation
    cache): library noise off, and the CPU asked for where libtpu is installed but no TPU is
    attached. Call it before JAX starts a backend."""
    from jaxsim.cli import environment

    environment.setup(compilation_cache=False)


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


class ChildContender:
    """A contender that runs in a process of its own, started from `cmd` (a script that ends in
    `serve_contender`). Calling it runs one unit of work there and returns when it is done, so
    `alternating` times it like an in-process callable (the pipe adds ~0.1 ms a call).

    Sides in separate processes do not share a heap or thread pools: one side's allocations and
    spinning threads cannot slow the next side's round, and each process starts from the same
    environment (the parent's).
    """

    def __init__(self, cmd: list):
        self.cmd = cmd
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._stderr, text=True, bufsize=1)
        self.info = self._answer("READY")

    def _answer(self, tag: str) -> dict:
        for line in self._proc.stdout:
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1:])
        self._proc.wait()
        self._stderr.seek(0)
        raise RuntimeError(f"benchmark child {' '.join(map(str, self.cmd))} exited "
                           f"({self._proc.returncode}) before {tag}:\n"
                           f"{self._stderr.read()[-3000:]}")

    def __call__(self) -> dict:
        self._proc.stdin.write("RUN\n")
        self._proc.stdin.flush()
        return self._answer("DONE")

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._stderr.close()


def serve_contender(run: Callable[[], object], info: Mapping) -> None:
    """The child's side of `ChildContender`: prints 'READY {info}', then runs `run` once for
    every 'RUN' line on stdin, answering 'DONE {}', until stdin closes."""
    print("READY " + json.dumps(dict(info)), flush=True)
    for line in sys.stdin:
        if line.strip() == "RUN":
            run()
            print("DONE {}", flush=True)


def alternating(contenders: Mapping[str, Callable[[], object]], work: float,
                repeats: int) -> dict:
    """Runs the contenders in turn (A B C A B C ...) `repeats` times.

    Returns {name: {'per_s': median rate, 'rates': [...]}}. Alternating spreads slow drifts of
    the machine (thermal, other processes) over every side, so per-round ratios
    (`ratio_stats`) are steadier than the ratio of separate bests.
    """
    rates = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, fn in contenders.items():
            rates[name].append(work / seconds(fn))
    return {name: {"per_s": statistics.median(r), "rates": r} for name, r in rates.items()}


def ratio_stats(ours: list, theirs: list) -> dict:
    """Median, min and max of the per-round ratios ours[i] / theirs[i] (rates of one round)."""
    ratios = [a / b for a, b in zip(ours, theirs)]
    return {"ratio": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "repeats": len(ratios)}


def alternating_rates(ours: Callable[[], object], theirs: Callable[[], object], work: float,
                      repeats: int) -> dict:
    """Two sides run alternately `repeats` times: both median rates and the ratio spread."""
    rates = alternating({"ours": ours, "theirs": theirs}, work, repeats)
    return {"ours_per_s": rates["ours"]["per_s"], "reference_per_s": rates["theirs"]["per_s"],
            **ratio_stats(rates["ours"]["rates"], rates["theirs"]["rates"])}


def best_vs_best(rates: Mapping[str, Mapping], ours: list, theirs: list) -> dict:
    """Each side at its best: the configuration of `ours` and of `theirs` with the highest
    median rate (`alternating`'s record), and the per-round ratios of those two.

    Which configuration is fastest depends on the CPU: with AVX512-BF16 or AMX, bf16 (autocast
    for PyTorch) wins; on a CPU without bf16 instructions PyTorch's bf16 autocast runs slower
    than its float32, and the headline must not compare against a configuration no one would
    pick there."""
    best = {side: max(names, key=lambda name: rates[name]["per_s"])
            for side, names in (("ours", ours), ("theirs", theirs))}
    return {**ratio_stats(rates[best["ours"]]["rates"], rates[best["theirs"]]["rates"]),
            "ours": best["ours"], "reference": best["theirs"]}


def cpu_description() -> dict:
    """The CPU's model name and the instruction sets that decide which dtype is fastest."""
    from jaxsim.cpu import cpu_flags, cpu_model  # the parent only (it has JAX loaded)

    flags = cpu_flags() or frozenset()
    return {"model": cpu_model(), **{flag: flag in flags for flag in _CPU_FLAGS}}


_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def xla_flops(stage) -> float:
    """XLA's FLOP count of a compiled (or lowered) program; 0.0 where the backend has none."""
    return float(cost_analysis(stage).get("flops", 0.0))


def cost_analysis(stage) -> dict:
    """XLA's cost analysis of a compiled (or lowered) program."""
    analysis = stage.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older JAX: one dict per module
        analysis = analysis[0] if analysis else {}
    return dict(analysis or {})


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
              "cpus_used": available_cpus(), "cpu": cpu_description()}
    Path(path).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
