"""STS evaluation by the SimCSE protocol, with label-free calibrations.

Example (the bundled all-MiniLM-L6-v2 on the shipped tasks):
  python eval.py --post none --post whitening --post whitening:256
"""
from __future__ import annotations

import argparse
import os
import sys

# The eval's linear algebra is small ([D, D] eigh); OpenBLAS threads spinning against busy
# cores made it 50x slower on a shared 2-core machine. Set before numpy loads.
os.environ.setdefault('OPENBLAS_NUM_THREADS', '1')

from jaxsim.eval import runner  # noqa: E402

ALL_TASKS = 'sts12,sts13,sts14,sts15,sts16,stsb,sickr'


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog='python eval.py', description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--model', action='append', default=None,
                   help='HF folder, hub id or train workdir; repeat for several models '
                        '(default: the bundled all-MiniLM-L6-v2)')
    p.add_argument('--data', action='append', default=None,
                   help=f'SentEval data root; repeatable (default: {runner.DEFAULT_DATA})')
    p.add_argument('--tasks', default=None,
                   help=f'comma-separated subset of {ALL_TASKS} (default: all found in --data)')
    p.add_argument('--pooler', default=None,
                   help="pooler (default: the model's own, else avg)")
    p.add_argument('--max-length', type=int, default=None,
                   help="token limit (default: the tokenizer's, i.e. no truncation as in SimCSE)")
    p.add_argument('--batch-size', type=int, default=64)
    p.add_argument('--dtype', choices=('float32', 'bfloat16'), default='float32',
                   help='encoder compute dtype (bfloat16 uses the CPU\'s bf16 units; params stay fp32)')
    p.add_argument('--post', action='append', default=None,
                   help='none | whitening[:K] | sn | natsv:K | flow; repeat for several rows')
    p.add_argument('--fit-on', default='target',
                   help="calibration fit set: 'target' (all sentences of the evaluated tasks), "
                        "'task' (each task's own), or a corpus FILE (one sentence a line)")
    p.add_argument('--flow-checkpoint', default=None,
                   help='a saved flow for --post flow (default: fit one on the fit set)')
    p.add_argument('--flow-config', default=None,
                   help='flow config file for --post flow (default: the reference Glow, '
                        'configs/flow_glow.py; e.g. configs/flow_realnvp.py)')
    p.add_argument('--eps', type=float, default=0.0,
                   help='covariance regularizer for whitening/sn (default 0: reject degenerate)')
    p.add_argument('--aggregate', choices=('all', 'wmean', 'mean'), default='all',
                   help='STS12-16 aggregation shown in the table (JSON has all three)')
    p.add_argument('--split', choices=('test', 'dev'), default='test',
                   help="'dev' scores STS-B dev (model selection)")
    p.add_argument('--json', default=None, help='write results JSON here')
    p.add_argument('--plots', default=None, help='write PNG figures into this folder')
    p.add_argument('--no-diagnostics', action='store_true',
                   help='skip alignment/uniformity/anisotropy/spectrum')
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from jaxsim.eval import plots, report
    from jaxsim.errors import USER_ERRORS
    from jaxsim.runtime import enable_compilation_cache
    enable_compilation_cache()

    try:
        rows = runner.run(
            args.model or [None], args.data or [runner.DEFAULT_DATA],
            args.tasks.split(',') if args.tasks else None,
            posts=args.post or ['none'], pooler=args.pooler, max_length=args.max_length,
            batch_size=args.batch_size, split=args.split, aggregate=args.aggregate,
            fit_on=args.fit_on, flow_checkpoint=args.flow_checkpoint, eps=args.eps,
            flow_config=args.flow_config,
            diagnostics=not args.no_diagnostics or bool(args.plots), dtype=args.dtype)
    except USER_ERRORS as e:
        print(f'error: {e}', file=sys.stderr)
        return 1
    print(report.markdown_table(rows, args.aggregate))
    t = rows[-1].details['timing']
    print(f"\ntime: {t['total_s']:.1f} s evaluating ({t['encode_s']:.1f} s encoding "
          f"{t['sentences_encoded']} sentences, {t['rest_s']:.1f} s the rest)", file=sys.stderr)
    if args.json:
        report.write_json(args.json, rows)
    if args.plots:
        for path in plots.write_plots(rows, args.plots):
            print(f'wrote {path}', file=sys.stderr)
    return 0


if __name__ == '__main__':
    sys.exit(main())
