"""Matrix-product peak of JAX and of PyTorch on this machine's threads: the ceiling the
benchmarks' `fraction_of_peak` figures are read against.

For each framework and dtype (float32, bfloat16) one square `--size` product is timed
`--repeats` times after a warm-up; the best time gives GFLOP/s = 2 n^3 / seconds / 1e9.
Each framework's bf16 product is its fastest one, the form its models run: JAX's is
`jaxsim.models.ops.matmul` (bf16 operands, float32 accumulation and result); PyTorch's is
`a @ b` on bf16 tensors (float32 accumulation inside oneDNN/MKL). On XLA:CPU (jaxlib 0.10) the
difference matters: a bf16-result dot is upcast to float32 before it reaches a kernel, while a
float32-result one runs YNNPACK's bf16 kernel, about 4x faster on an AVX512-BF16/AMX Xeon.
JAX runs on its default device (XLA:CPU, or an accelerator); PyTorch on the CPU, or on CUDA
when JAX's device is a GPU and torch has CUDA. A benchmark calls `measure_peaks` in its own
process, after `common.set_threads`, so the peak and the rows share the same cores.

    python benchmarks/peak.py [--threads 2] [--size 2048] [--repeats 10] [--json peak.json]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    available_cpus,
    load_average,
    set_threads,
    setup_process,
    write_json,
)

# Like jax and torch, jaxsim (which imports jax) is imported inside the functions that use it:
# importing this module for its arithmetic (`fraction_of_peak`, `describe`) or timing PyTorch
# alone loads neither framework, and no benchmark pays for a JAX it does not run.

DTYPES = ("float32", "bfloat16")


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up: compilation, allocator, first-call paths
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


# A product predicted to take longer than this at the asked size is timed at a smaller one.
SLOW_PRODUCT_S = 5.0
_PROBE_SIZE = 256


def timed_size(make: Callable[[int], Callable[[], object]], size: int,
               clock: Callable[[], float] = time.perf_counter) -> int:
    """`size`, or the largest half of it whose product is predicted (from one at 256, scaled by
    n^3) to take at most `SLOW_PRODUCT_S`: a product with no fast kernel on this machine
    (PyTorch's bf16 `a @ b` on a CPU without bf16 instructions, 0.3 GFLOP/s: a minute per
    2048^3) would otherwise hold a benchmark for many minutes. Such a loop's rate hardly depends
    on the size. `clock` is what the probe is timed with (its tests pass their own)."""
    probe = min(size, _PROBE_SIZE)
    run = make(probe)
    run()
    start = clock()
    run()
    seconds = clock() - start
    while size > probe and seconds * (size / probe) ** 3 > SLOW_PRODUCT_S:
        size //= 2
    return size


def jax_product(size: int, dtype: str) -> Callable[[], object]:
    import jax
    import jax.numpy as jnp

    from jaxsim.models import ops

    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.random.normal(key_a, (size, size), jnp.float32).astype(dtype)
    b = jax.random.normal(key_b, (size, size), jnp.float32).astype(dtype)
    if dtype == "float32":
        # Full float32 precision (no TF32/bf16 passes on accelerators).
        product = jax.jit(lambda x, y: jnp.matmul(x, y, precision="highest"))
    else:
        # The models' own product: bf16 operands into a float32 result (XLA's fast bf16
        # path).
        product = jax.jit(lambda x, y: ops.matmul(x, y, dtype))
    return lambda: product(a, b).block_until_ready()


def torch_device() -> str:
    """'cuda' when JAX runs on a GPU and torch has CUDA, else 'cpu'."""
    import jax
    import torch

    return "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"


def torch_product(size: int, dtype: str, device: str) -> Callable[[], object]:
    import torch

    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator).to(device=device,
                                                              dtype=getattr(torch, dtype))
            for _ in range(2))

    def run():
        out = a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    return run


def measure_peaks(size: int = 2048, repeats: int = 10, torch_too: bool = True) -> dict:
    """{'jax': {dtype: GFLOP/s}, 'torch': {...}, 'best_s': {framework: {dtype: s}}, ...}.

    The threads are whatever this process may use (pin them first with common.set_threads)."""
    record = {"size": size, "repeats": repeats, "flops_per_product": 2.0 * size ** 3,
              "best_s": {}, "sizes": {}}
    makers = {"jax": jax_product}
    if torch_too:
        device = record["torch_device"] = torch_device()
        makers["torch"] = lambda n, dtype: torch_product(n, dtype, device)
    for framework, make in makers.items():
        for part in (record, record["best_s"], record["sizes"]):
            part[framework] = {}
        for dtype in DTYPES:
            n = timed_size(lambda n: make(n, dtype), size)
            best = best_seconds(make(n, dtype), repeats)
            record["best_s"][framework][dtype] = best
            record["sizes"][framework][dtype] = n
            record[framework][dtype] = 2.0 * n ** 3 / best / 1e9
    return record


def fraction_of_peak(flops_per_unit: float, units_per_s: float,
                     peak_gflops: Optional[float]) -> Optional[float]:
    """Achieved GFLOP/s (XLA's FLOPs per step or pass x rate) over a peak; None without one."""
    if not peak_gflops or not flops_per_unit:
        return None
    return flops_per_unit * units_per_s / 1e9 / peak_gflops


def describe(peaks: dict) -> str:
    sizes = peaks.get("sizes", {})

    def at(fw, dt):  # the size where a slow product was timed at a smaller one
        n = sizes.get(fw, {}).get(dt, peaks["size"])
        return "" if n == peaks["size"] else f" (at {n}^3)"

    parts = [f"{fw} {dt} {peaks[fw][dt]:.{0 if peaks[fw][dt] >= 10 else 2}f}{at(fw, dt)}"
             for fw in ("jax", "torch") if fw in peaks for dt in DTYPES]
    return (f"matrix-product peak ({peaks['size']}x{peaks['size']}, best of {peaks['repeats']}, "
            f"GFLOP/s): " + ", ".join(parts))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=available_cpus(),
                        help="cores for both frameworks (the process is pinned to them)")
    parser.add_argument("--size", type=int, default=2048, help="square product size")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    setup_process()
    if args.size < 1 or args.repeats < 1:
        parser.error("--size and --repeats must be positive")
    set_threads(args.threads)  # before JAX's backend and torch's pool start
    import torch

    torch.set_num_threads(args.threads)
    load = load_average()
    peaks = measure_peaks(args.size, args.repeats)
    print(f"threads {args.threads}, 1-min load average before the run "
          f"{'n/a' if load is None else f'{load:.2f}'}")
    print(describe(peaks))
    # The headline: how far PyTorch's float32 product is from XLA's on the same cores.
    ratio = peaks["jax"]["float32"] / peaks["torch"]["float32"]
    print(f"jax / torch float32: {ratio:.2f}x, bfloat16: "
          f"{peaks['jax']['bfloat16'] / peaks['torch']['bfloat16']:.2f}x")
    write_json(args.json, {**peaks, "threads": args.threads, "ratio": ratio,
                           "ratio_definition": "jax float32 GFLOP/s / torch float32 GFLOP/s"})


if __name__ == "__main__":
    main()
