"""Cost of fitting BERT-flow vs the cost of encoding the sentences it is fitted on.

Encodes every unique STS-B sentence (train + dev + test) with the bundled all-MiniLM-L6-v2
(or --model), then fits the reference Glow (configs/flow_glow.py) on those vectors, and prints
both wall times and their ratio (goal: fit < 10% of encode). Both timings are cold (they include
XLA compilation, as a user's first `eval.py --post flow` would); the fit is then repeated warm
(compiled functions cached) to show the compile share.

  python benchmarks/flow_speed.py [--pooler avg] [--config configs/flow_glow.py]
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

os.environ.setdefault('OPENBLAS_NUM_THREADS', '1')

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxsim  # noqa: E402
from jaxsim.data.senteval import load_stsb  # noqa: E402
from jaxsim.encode import encode  # noqa: E402
from jaxsim.flows import fit_flow_calibration  # noqa: E402
from jaxsim.flows.config import load_config_file  # noqa: E402
from jaxsim.paths import SENTEVAL_ROOT  # noqa: E402
from jaxsim.pretrained import bundled_model_path  # noqa: E402

_ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--model', default=None, help='default: the bundled all-MiniLM-L6-v2')
    p.add_argument('--data', default=str(SENTEVAL_ROOT))
    p.add_argument('--pooler', default='avg')
    p.add_argument('--config', default=str(_ROOT / 'configs' / 'flow_glow.py'))
    p.add_argument('--cache', default=None,
                   help='optional .npy: reuse/store the encoded vectors (skips the encode timing '
                        'when it exists)')
    args = p.parse_args(argv)

    sentences = []
    for split in ('train', 'dev', 'test'):
        pairs = load_stsb(args.data, split)
        sentences += list(pairs.sent1) + list(pairs.sent2)
    sentences = sorted(set(sentences))
    print(f'STS-B train+dev+test: {len(sentences)} unique sentences; devices: {jax.devices()}')

    encode_s = None
    if args.cache and pathlib.Path(args.cache).exists():
        emb = np.load(args.cache)
        print(f'loaded {emb.shape} vectors from {args.cache} (encode not timed)')
    else:
        model = jaxsim.load_pretrained(args.model or bundled_model_path())
        t0 = time.perf_counter()
        emb = encode(model, sentences, pooler=args.pooler, progress=False)
        encode_s = time.perf_counter() - t0
        print(f'encode ({args.pooler}): {encode_s:.2f} s  ({len(sentences) / encode_s:.0f} sent/s)')
        if args.cache:
            np.save(args.cache, emb)

    config = load_config_file(args.config)
    t0 = time.perf_counter()
    fc = fit_flow_calibration(emb, config, seed=0, progress=False)
    jax.block_until_ready(fc.params)
    fit_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    fc = fit_flow_calibration(emb, config, seed=0, progress=False)
    jax.block_until_ready(fc.params)
    warm_s = time.perf_counter() - t0
    last = fc.history[-1]
    print(f'flow fit ({config.arch}, levels={config.levels}, depth={config.depth}, '
          f'{config.coupling}, width={config.width}): cold {fit_s:.2f} s, warm {warm_s:.2f} s; '
          f'{last["step"]} steps, held-out NLL {last["val_nll"]:.1f} nats '
          f'({last["val_bpd"]:.3f} bits/dim)')
    if encode_s is not None:
        print(f'ratio fit/encode: cold {fit_s / encode_s:.1%}, warm {warm_s / encode_s:.1%} '
              f'(goal < 10%)')
    return 0


if __name__ == '__main__':
    sys.exit(main())
