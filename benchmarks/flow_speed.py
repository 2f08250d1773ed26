"""Cost of fitting a BERT-flow calibration vs the cost of encoding the sentences it is fitted on.

Encodes every unique STS-B sentence (train + dev + test) with the bundled all-MiniLM-L6-v2,
then fits the 'flow' calibration (default: BERT-flow as its code executes it,
configs/flow_bert_flow.py) on those vectors, and reports both wall times and their ratio
(goal: fit < 10% of encode). Both are cold (they include XLA compilation, as a user's first
`eval.py --post flow` would); the fit is then repeated warm (compiled programs cached) to show
the compile share. "ratio" in the JSON record is cold fit seconds / cold encode seconds.

    python benchmarks/flow_speed.py [--pooler avg] [--config bert_flow|glow|PATH] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault('OPENBLAS_NUM_THREADS', '1')
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import setup_process, write_json  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--pooler', default='avg')
    p.add_argument('--config', default='bert_flow',
                   help='shipped flow config name (bert_flow, glow, realnvp) or a config file')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--json', type=Path, default=None, help='write the figures here')
    args = p.parse_args(argv)
    setup_process()

    import jax

    import jaxsim
    from jaxsim import calibrate
    from jaxsim.calibrate.flow import resolve_config
    from jaxsim.data.senteval import load_stsb
    from jaxsim.storage.paths import SENTEVAL_ROOT

    sentences = []
    for split in ('train', 'dev', 'test'):
        pairs = load_stsb(SENTEVAL_ROOT, split)
        sentences += list(pairs.sent1) + list(pairs.sent2)
    sentences = sorted(set(sentences))
    print(f'STS-B train+dev+test: {len(sentences)} unique sentences; devices: {jax.devices()}')

    model = jaxsim.load_pretrained(jaxsim.bundled_model_path())
    t0 = time.perf_counter()
    emb = jaxsim.encode(model, sentences, pooler=args.pooler, progress=False)
    encode_s = time.perf_counter() - t0
    print(f'encode ({args.pooler}): {encode_s:.2f} s ({len(sentences) / encode_s:.0f} sent/s)')

    config = resolve_config(args.config)
    times = []
    for _ in range(2):  # cold, then warm
        t0 = time.perf_counter()
        cal = calibrate.fit('flow', emb, config=config, seed=args.seed, progress=False)
        jax.block_until_ready(cal.params)
        times.append(time.perf_counter() - t0)
    cold_s, warm_s = times
    last = cal.history[-1]
    print(f'flow fit {cal.describe()}: cold {cold_s:.2f} s, warm {warm_s:.2f} s')
    ratio = cold_s / encode_s
    print(f'ratio fit/encode: cold {ratio:.1%}, warm {warm_s / encode_s:.1%} (goal < 10%)')
    write_json(args.json, {
        'ratio': ratio, 'ratio_warm': warm_s / encode_s, 'encode_s': encode_s,
        'fit_cold_s': cold_s, 'fit_warm_s': warm_s, 'sentences': len(sentences),
        'dim': int(emb.shape[1]), 'pooler': args.pooler, 'config': config.to_dict(),
        'steps': cal.best_step, 'final_bpd': last['bpd'], 'devices': len(jax.devices())})
    return 0


if __name__ == '__main__':
    sys.exit(main())
