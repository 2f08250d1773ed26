"""Exact top-k search throughput: jaxsim.search vs faiss IndexFlatIP, same machine, same run.

Random unit vectors (corpus and queries), so inner product = cosine, as in a normalized
sentence index. For each (rows, dim): both indexes hold the same vectors; each searches the
same query batch for its top-k after a warm-up call (jaxsim's compilation is timed apart);
the contenders run in interleaved rounds and the best of --repeats rounds gives queries/s.
Also reported: the overlap of jaxsim's exact rows with faiss's, and the `approx_max_k`
path's speed and recall against the exact search. The bfloat16 corpus option
(`corpus_dtype="bfloat16"`: scored in bf16, the candidates rescored in float32) is timed in
the same rounds, with the share of queries whose top-k set equals the float32 search's
(`bf16_same_top_k_as_float32`) and the queries it sent back to float32; top-level
"ratio_bfloat16" is its geometric-mean ratio to faiss.

faiss is given its BLAS path for every batch (`--faiss-blas-threshold 0`; its default
heuristic sends small batches, e.g. 256 queries of dimension 384, to a ~10x slower loop) and
its best OpenMP thread count among --faiss-threads (OMP_WAIT_POLICY=PASSIVE).

Fraction of peak: each configuration's scoring product (2 x queries x rows x dim FLOPs; the
top-k selection adds none) at jaxsim's rate, over JAX's float32 matrix-product peak measured in
the same process (`peak.py`).

"ratio" (top level) = geometric mean over the configurations of jaxsim_qps / faiss_qps
(> 1: jaxsim faster).

Approximate indexes (`--ann ivf,hnsw`, jaxsim's `method="ivf"|"hnsw"` through faiss, default
options) are timed on the same queries: q/s, recall@k against the exact search, speed-up over
the exact search, build time. `--data clustered` draws the corpus around 1000 centres (as
sentence vectors cluster; uniform random vectors are the hardest case for IVF and HNSW).

    pip install faiss-cpu        # or: pip install -e .[bench]
    python benchmarks/search_speed.py --json /tmp/search_speed.json
        [--rows 100000,1000000] [--dims 384,768] [--queries 256] [--top-k 10] [--repeats 3]
        [--faiss-threads 1,NPROC]
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import setup_process  # noqa: E402
from peak import describe, fraction_of_peak, measure_peaks  # noqa: E402


def unit_rows(n: int, dim: int, rng: np.random.Generator,
              centres: np.ndarray | None = None) -> np.ndarray:
    """[n, dim] float32 rows of unit norm, normalized in chunks (no [n, dim] temporaries);
    around `centres` (noise of the same scale as the centres' spread) when given."""
    x = rng.standard_normal((n, dim), dtype=np.float32)
    if centres is not None:
        for s in range(0, n, 65536):
            part = x[s: s + 65536]
            part += 1.5 * centres[rng.integers(len(centres), size=len(part))]
    for s in range(0, n, 65536):
        x[s: s + 65536] /= np.linalg.norm(x[s: s + 65536], axis=1, keepdims=True)
    return x


def overlap(a: np.ndarray, b: np.ndarray) -> float:
    """Mean fraction of each row of `b` (top-k row ids) also found in the same row of `a`."""
    return float(np.mean([len(set(x) & set(y)) / len(y) for x, y in zip(a, b)]))


def run_config(rows: int, dim: int, args, faiss, SearchIndex) -> dict:
    rng = np.random.default_rng(rows * 1000 + dim)
    start = time.perf_counter()
    centres = (rng.standard_normal((1000, dim), dtype=np.float32)
               if args.data == "clustered" else None)
    corpus = unit_rows(rows, dim, rng, centres)
    queries = unit_rows(args.queries, dim, rng, centres)
    make_s = time.perf_counter() - start

    start = time.perf_counter()
    index = SearchIndex.from_vectors(corpus, block_rows=args.block_rows,
                                     query_batch=args.query_batch)
    del corpus  # the index holds the (already unit) rows; faiss takes them from there
    gc.collect()
    flat = faiss.IndexFlatIP(dim)
    flat.add(index.vectors)
    build_s = time.perf_counter() - start

    start = time.perf_counter()
    ours = index.search_vectors(queries, args.top_k)  # places the corpus and compiles
    first_s = time.perf_counter() - start
    approx = index.search_vectors(queries, args.top_k, approx_recall=args.approx_recall)
    # The bfloat16 corpus option: its own index over the same rows.
    low = SearchIndex.from_vectors(index.vectors, corpus_dtype="bfloat16",
                                   block_rows=args.block_rows, query_batch=args.query_batch)
    start = time.perf_counter()
    low_hits = low.search_vectors(queries, args.top_k)
    low_first_s = time.perf_counter() - start
    low_again = low.last_search_stats.get("float32_again")
    low_wide = low.last_search_stats.get("bf16_again")
    _, faiss_rows = flat.search(queries, args.top_k)  # warm-up, and the rows to compare

    def faiss_search(threads):
        faiss.omp_set_num_threads(threads)
        flat.search(queries, args.top_k)

    # Interleaved rounds, best of each: on a shared machine every contender sees the same
    # load. faiss runs at each thread count asked for and keeps its best.
    contenders = {"jaxsim": lambda: index.search_vectors(queries, args.top_k),
                  "jaxsim_bf16": lambda: low.search_vectors(queries, args.top_k),
                  "approx": lambda: index.search_vectors(queries, args.top_k,
                                                         approx_recall=args.approx_recall)}
    for threads in args.faiss_threads:
        contenders[f"faiss_{threads}"] = lambda t=threads: faiss_search(t)
    best = {name: math.inf for name in contenders}
    # Process CPU seconds too (every thread of this process): on a shared machine they move
    # less with the load than wall time does.
    cpu = {name: math.inf for name in contenders}
    for _ in range(args.repeats):
        for name, fn in contenders.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
            cpu[name] = min(cpu[name], time.process_time() - start_cpu)
    jax_s, approx_s = best["jaxsim"], best["approx"]
    faiss_by_threads = {t: best[f"faiss_{t}"] for t in args.faiss_threads}
    faiss_s = min(faiss_by_threads.values())
    row = {
        "rows": rows, "dim": dim, "queries": args.queries, "top_k": args.top_k,
        "jaxsim_qps": args.queries / jax_s, "faiss_qps": args.queries / faiss_s,
        "ratio": faiss_s / jax_s,
        "jaxsim_s": jax_s, "faiss_s": faiss_s,
        "faiss_qps_by_threads": {t: args.queries / v for t, v in faiss_by_threads.items()},
        "jaxsim_first_call_s": first_s,  # device placement + compilation + one search
        "overlap_with_faiss": overlap(ours.rows, faiss_rows),
        "bf16_qps": args.queries / best["jaxsim_bf16"], "bf16_ratio": faiss_s / best["jaxsim_bf16"],
        "bf16_first_call_s": low_first_s,
        # Best process CPU seconds per search of each contender, and faiss's (best thread
        # count) over jaxsim's: the ratios in CPU time.
        "cpu_s": cpu,
        "ratio_cpu": min(cpu[f"faiss_{t}"] for t in args.faiss_threads) / cpu["jaxsim"],
        "bf16_ratio_cpu": min(cpu[f"faiss_{t}"] for t in args.faiss_threads) / cpu["jaxsim_bf16"],
        # Queries whose top-k row set is the float32 search's (1.0: all), and how many the bf16
        # pass could not certify (searched again in float32).
        "bf16_same_top_k_as_float32": float(np.mean(
            [set(a) == set(b) for a, b in zip(low_hits.rows, ours.rows)])),
        "bf16_float32_again": low_again,
        "bf16_second_pass": low_wide,  # queries through the wider bf16 pass first
        "approx_qps": args.queries / approx_s, "approx_recall_target": args.approx_recall,
        "approx_recall": overlap(approx.rows, ours.rows),
        "data_s": make_s, "build_s": build_s, "load_average_1min": os.getloadavg()[0],
        "data": args.data,
    }
    row["flops"] = 2.0 * args.queries * rows * dim
    row["peak_gflops"] = args.peaks["jax"]["float32"]
    row["fraction_of_peak"] = fraction_of_peak(row["flops"], 1.0 / jax_s, row["peak_gflops"])
    faiss.omp_set_num_threads(max(args.faiss_threads))
    row["peak_rss_gb_exact"] = peak_rss_gb()
    # The approximate indexes need only the host rows and the exact answers: the flat index
    # and the device copy go first (at 1M x 384 each is 1.5 GB).
    # (Rebound rather than deleted: the closures above read these names.)
    flat = None
    contenders.clear()
    exact_vectors = np.array(index.vectors)
    index = approx = low = None
    gc.collect()
    for method in args.ann:
        options = ann_options(method, args)
        start = time.perf_counter()
        approximate = SearchIndex.from_vectors(exact_vectors, method=method, ann_options=options)
        approximate.search_vectors(queries[:1], args.top_k)  # builds the structure
        build = time.perf_counter() - start
        # Each search-time setting (cells probed / search beam) on the same structure.
        key = "nprobe" if method == "ivf" else "ef_search"
        row[method] = {"build_s": build, "options": options, "by_" + key: {}}
        for value in args.nprobe if method == "ivf" else args.ef_search:
            approximate.tune(**{key: value})
            found = approximate.search_vectors(queries, args.top_k)
            took = min(seconds(lambda: approximate.search_vectors(queries, args.top_k))
                       for _ in range(args.repeats))
            row[method]["by_" + key][value] = {
                "qps": args.queries / took, "recall": overlap(found.rows, ours.rows),
                "speedup_vs_exact": jax_s / took}
        row[method]["peak_rss_gb"] = peak_rss_gb()
        approximate = None
        gc.collect()
    return row


def ann_options(method: str, args) -> dict:
    """Build-time options given on the command line (the library's defaults otherwise)."""
    given = ({"nlist": args.nlist} if method == "ivf" else
             {"m": args.hnsw_m, "ef_construction": args.ef_construction})
    return {k: v for k, v in given.items() if v is not None}


def peak_rss_gb() -> float:
    """This process's peak resident set so far, GB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="100000,1000000")
    parser.add_argument("--dims", default="384,768")
    parser.add_argument("--queries", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--faiss-threads", default=f"1,{os.cpu_count()}",
                        help="OpenMP thread counts to time faiss with, e.g. 1,8; the best "
                             "counts (XLA:CPU uses every core)")
    parser.add_argument("--faiss-blas-threshold", type=int, default=0,
                        help="faiss.cvar.distance_compute_blas_threshold (0: always BLAS)")
    parser.add_argument("--block-rows", type=int, default=None)
    parser.add_argument("--query-batch", type=int, default=None)
    parser.add_argument("--approx-recall", type=float, default=0.95)
    parser.add_argument("--peak-size", type=int, default=2048, help="peak product size")
    parser.add_argument("--peak-repeats", type=int, default=10)
    parser.add_argument("--ann", default="ivf,hnsw",
                        help="approximate methods to time too (comma-separated; '' for none)")
    parser.add_argument("--data", choices=("random", "clustered"), default="random")
    parser.add_argument("--nprobe", default="4,8,16,32,64", help="ivf cells probed, swept")
    parser.add_argument("--ef-search", default="16,32,64,128", help="hnsw beams, swept")
    parser.add_argument("--nlist", type=int, default=None,
                        help="ivf cells (default: ~4 sqrt(rows))")
    parser.add_argument("--hnsw-m", type=int, default=None, help="hnsw links a node")
    parser.add_argument("--ef-construction", type=int, default=None, help="hnsw build beam")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    setup_process()

    # Idle OpenMP threads sleep instead of spinning: with spinning, faiss with several threads
    # ran up to 7x slower than with one on a shared machine. Read when faiss loads OpenMP.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import faiss
    import jax

    from jaxsim.search import SearchIndex
    from jaxsim.search.topk import DEFAULT_BLOCK_ROWS, DEFAULT_QUERY_BATCH

    args.block_rows = args.block_rows or DEFAULT_BLOCK_ROWS
    args.query_batch = args.query_batch or DEFAULT_QUERY_BATCH
    args.faiss_threads = sorted({int(t) for t in args.faiss_threads.split(",")})
    args.ann = [m for m in args.ann.split(",") if m]
    args.nprobe = [int(v) for v in args.nprobe.split(",")]
    args.ef_search = [int(v) for v in args.ef_search.split(",")]
    # faiss sends a batch to BLAS only when queries * dim >= this threshold (128000 by
    # default), else to a per-pair loop about 10x slower: 256 queries of dimension 384 would
    # take that loop. 0 gives faiss its BLAS path for every batch here.
    default_blas_threshold = faiss.cvar.distance_compute_blas_threshold
    faiss.cvar.distance_compute_blas_threshold = args.faiss_blas_threshold
    load_before = os.getloadavg()
    args.peaks = measure_peaks(args.peak_size, args.peak_repeats, torch_too=False)
    print(describe(args.peaks))
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} x{jax.device_count()}, "
          f"faiss {faiss.__version__} (best of {args.faiss_threads} threads, BLAS threshold "
          f"{args.faiss_blas_threshold}), "
          f"{os.cpu_count()} cpus, "
          f"load average {load_before[0]:.2f}")
    print(f"{'rows':>9} {'dim':>4} {'jaxsim q/s':>11} {'faiss q/s':>10} {'ratio':>6} "
          f"{'bf16 q/s':>9} {'ratio':>6} {'=f32':>5} "
          f"{'overlap':>8} {'approx q/s':>11} {'recall':>7} {'1st call s':>10}")
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        for dim in (int(d) for d in args.dims.split(",")):
            r = run_config(rows, dim, args, faiss, SearchIndex)
            gc.collect()  # both indexes of this configuration go before the next is built
            results.append(r)
            print(f"{rows:>9} {dim:>4} {r['jaxsim_qps']:>11.0f} {r['faiss_qps']:>10.0f} "
                  f"{r['ratio']:>6.2f} {r['bf16_qps']:>9.0f} {r['bf16_ratio']:>6.2f} "
                  f"{r['bf16_same_top_k_as_float32']:>5.3f} {r['overlap_with_faiss']:>8.4f} "
                  f"{r['approx_qps']:>11.0f} "
                  f"{r['approx_recall']:>7.4f} {r['jaxsim_first_call_s']:>10.1f}", flush=True)
            for method in args.ann:
                (key, sweep), = ((k, v) for k, v in r[method].items() if k.startswith("by_"))
                for value, a in sweep.items():
                    print(f"{'':>9} {'':>4} {method} {key[3:]}={value}: {a['qps']:.0f} q/s, "
                          f"recall@{args.top_k} {a['recall']:.4f}, "
                          f"{a['speedup_vs_exact']:.1f}x exact (built in "
                          f"{r[method]['build_s']:.1f} s, peak RSS "
                          f"{r[method]['peak_rss_gb']:.2f} GB)", flush=True)
    load_after = os.getloadavg()
    ratio = math.exp(np.mean([math.log(r["ratio"]) for r in results]))
    ratio_bf16 = math.exp(np.mean([math.log(r["bf16_ratio"]) for r in results]))
    ratio_cpu = {key: math.exp(np.mean([math.log(r[key]) for r in results]))
                 for key in ("ratio_cpu", "bf16_ratio_cpu")}
    print(f"ratio (geometric mean of jaxsim/faiss queries/s): {ratio:.2f} float32 corpus, "
          f"{ratio_bf16:.2f} bfloat16 corpus; in CPU seconds {ratio_cpu['ratio_cpu']:.2f}, "
          f"{ratio_cpu['bf16_ratio_cpu']:.2f}; load average {os.getloadavg()[0]:.2f}")
    if args.json:
        out = {"ratio": ratio,
               "ratio_definition": "geometric mean over configs of jaxsim_qps / faiss_qps",
               "ratio_bfloat16": ratio_bf16,
               "ratio_bfloat16_definition": "the same for the bfloat16 corpus option "
                                            "(corpus_dtype='bfloat16', float32 results)",
               "ratio_cpu": ratio_cpu["ratio_cpu"],
               "ratio_bfloat16_cpu": ratio_cpu["bf16_ratio_cpu"],
               "configs": results, "faiss_threads": args.faiss_threads, "cpus": os.cpu_count(),
               "data": args.data, "ann": args.ann,
               "faiss_blas_threshold": args.faiss_blas_threshold,
               "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
               "faiss_default_blas_threshold": default_blas_threshold,
               "peak_gflops": args.peaks, "block_rows": args.block_rows,
               "query_batch": args.query_batch,
               "load_average_before": load_before, "load_average_after": load_after,
               "jax": jax.__version__, "faiss": faiss.__version__,
               "machine": platform.processor() or platform.machine()}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
