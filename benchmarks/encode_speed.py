"""Encoding throughput: jaxsim vs sentence-transformers on the unique STS-B test sentences.

Same model (bundled all-MiniLM-L6-v2), avg pooling, batch 64, same thread count, one run.
jaxsim's compile time is measured apart (a first warm-up pass compiles every length bucket).

    python benchmarks/encode_speed.py [--threads 2] [--repeats 3] [--data ../shared/data/senteval]
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path


def set_threads(n: int) -> None:
    # XLA:CPU sizes its pool to the machine's cores; torch is given the same count, so the
    # default (--threads = nproc) compares like with like. Set before torch starts its pool.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(n)


def stsb_test_sentences(root: Path) -> list[str]:
    """Unique sentences of STS-B test, in first-seen order."""
    from jaxsim.data.senteval import load_stsb

    pairs = load_stsb(root, "test")
    return list(dict.fromkeys(s for pair in zip(pairs.sent1, pairs.sent2) for s in pair))


def best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--data", type=Path,
                        default=None, help="SentEval root (default: jaxsim.paths.SENTEVAL_ROOT)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="write a jax profiler trace of one jaxsim pass here")
    args = parser.parse_args()
    set_threads(args.threads)

    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    import jaxsim

    torch.set_num_threads(args.threads)
    from jaxsim.paths import SENTEVAL_ROOT
    sentences = stsb_test_sentences(args.data or SENTEVAL_ROOT)
    n = len(sentences)
    print(f"{n} unique STS-B test sentences, batch {args.batch_size}, {args.threads} threads")

    model = jaxsim.load_pretrained(jaxsim.bundled_model_path())
    # The bundled sentence-transformers pipeline ends in Normalize, so normalize here too.
    run_jax = lambda: jaxsim.encode(model, sentences, pooler="avg", batch_size=args.batch_size,
                                    normalize=True)
    start = time.perf_counter()
    ours = run_jax()
    first = time.perf_counter() - start
    jax_time = best_time(run_jax, args.repeats)
    compile_time = max(first - jax_time, 0.0)
    if args.profile:
        import jax
        with jax.profiler.trace(str(args.profile)):
            run_jax()

    # bf16 compute (fp32 params): XLA:CPU uses the processor's bf16 dot units where present.
    import jax.numpy as jnp
    run_bf16 = lambda: jaxsim.encode(model, sentences, pooler="avg", batch_size=args.batch_size,
                                     normalize=True, dtype=jnp.bfloat16)
    half = run_bf16()
    bf16_time = best_time(run_bf16, args.repeats)

    st = SentenceTransformer(str(jaxsim.bundled_model_path()), device="cpu")
    run_st = lambda: st.encode(sentences, batch_size=args.batch_size, convert_to_numpy=True)
    theirs = run_st()  # warm-up
    st_time = best_time(run_st, args.repeats)

    jax_rate, st_rate = n / jax_time, n / st_time
    print(f"max |jaxsim - sentence-transformers| = {np.abs(ours - theirs).max():.2e}")
    print(f"jaxsim:                {jax_rate:8.1f} sentences/s  (compile, first pass only: {compile_time:.2f} s)")
    print(f"sentence-transformers: {st_rate:8.1f} sentences/s")
    print(f"ratio jaxsim / sentence-transformers: {jax_rate / st_rate:.2f}x")
    cos = (half * ours).sum(1)  # both unit-normalized
    print(f"jaxsim bf16:           {n / bf16_time:8.1f} sentences/s  (ratio {n / bf16_time / st_rate:.2f}x; "
          f"min cosine to fp32 vectors {cos.min():.5f})")


if __name__ == "__main__":
    main()
