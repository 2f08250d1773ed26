"""STS evaluation by the SimCSE protocol, with label-free calibrations, and SentEval's
transfer tasks.

Examples (the bundled all-MiniLM-L6-v2 on the shipped tasks):
  python eval.py --post none --post whitening --post whitening:256
  python eval.py --tasks mr,cr,subj,mpqa,sst2,trec,mrpc
"""
from __future__ import annotations

# Library noise off before transformers loads ("PyTorch was not found ..."; jaxsim.cli.environment
# owns the list). The repository's eval.py runs `main` here.
from jaxsim.cli import environment

environment.quiet_environment()

import argparse  # noqa: E402
import sys  # noqa: E402

from jaxsim import calibrate, distributed, runtime  # noqa: E402
from jaxsim.cli import cli_io  # noqa: E402
from jaxsim.cli.cli_io import UsageError  # noqa: E402
from jaxsim.eval import plots, report, report_tb, runner  # noqa: E402
from jaxsim.storage import store  # noqa: E402

ALL_TASKS = 'sts12,sts13,sts14,sts15,sts16,stsb,sickr'
TRANSFER_TASKS = 'mr,cr,subj,mpqa,sst2,trec,mrpc'


def parse_args(argv=None) -> argparse.Namespace:
    p = cli_io.ArgumentParser(prog='python eval.py', description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--model', action='append', default=None,
                   help='HF folder, hub id or train workdir; repeat for several models '
                        '(default: the bundled all-MiniLM-L6-v2)')
    p.add_argument('--data', action='append', default=None,
                   help='SentEval data root; repeat for several: each file is read from the '
                        f'first root holding it (default: {runner.DEFAULT_DATA})')
    p.add_argument('--tasks', default=None,
                   help=f'comma-separated STS tasks ({ALL_TASKS}; default: all found in '
                        f'--data) and/or transfer tasks ({TRANSFER_TASKS})')
    p.add_argument('--pooler', default=None,
                   help="pooler (default: the model's own, else avg)")
    p.add_argument('--max-length', type=int, default=None,
                   help="token limit (default: the model's, i.e. no truncation as in SimCSE)")
    p.add_argument('--batch-size', type=int, default=64)
    p.add_argument('--dtype', choices=('float32', 'bfloat16'), default='float32',
                   help="encoder compute dtype (bfloat16 uses the CPU's bf16 units; params "
                        'stay fp32)')
    p.add_argument('--post', action='append', default=None,
                   help='calibration: none | whitening[:K] | sn | natsv:K | flow[:CONFIG]; '
                        'repeat for several rows')
    p.add_argument('--fit-on', action='append', default=None,
                   help="calibration fit set: 'target' (default: all sentences of the "
                        "evaluated tasks, one fit), 'task' (each task's own), 'paper' (per "
                        'task as BERT-whitening / BERT-flow fit it: STS-B and SICK-R on '
                        'train+dev+test), or a sentence FILE; repeat for rows of each')
    p.add_argument('--seeds', default=None,
                   help='comma-separated seeds: one flow fit / transfer classifier run per '
                        "seed, scores averaged (default: 0 for flows, SentEval's 1111 for "
                        'transfer tasks)')
    p.add_argument('--flow-checkpoint', default=None,
                   help='a saved flow calibration for --post flow (default: fit one)')
    p.add_argument('--flow-config', default=None,
                   help='flow config for --post flow: a shipped name (glow, realnvp, ...) or a '
                        'config file (default: BERT-flow as its code runs, fitted on '
                        'dropout-noised vectors)')
    p.add_argument('--eps', type=float, default=0.0,
                   help='covariance regularizer for whitening/sn (default 0: drop null '
                        'directions with a note)')
    p.add_argument('--aggregate', choices=('all', 'wmean', 'mean'), default='all',
                   help='STS12-16 aggregation shown in the table (JSON has all three)')
    p.add_argument('--split', choices=('test', 'dev'), default='test',
                   help="'dev' scores STS-B dev (model selection)")
    cli_io.add_output_flags(
        p, '--json', 'write results JSON to this file (an existing one only with --overwrite)',
        overwrite_help='replace an existing --json file / --plots / --tb folder')
    p.add_argument('--plots', default=None,
                   help='write PNG figures into this folder (absent or empty; an earlier '
                        'plots folder only with --overwrite)')
    p.add_argument('--tb', default=None,
                   help="write the scores as TensorBoard scalars into this local folder, one "
                        "run per model, at its checkpoint's step (else 0); absent or empty, "
                        'an earlier --tb folder only with --overwrite')
    p.add_argument('--no-diagnostics', action='store_true',
                   help='skip alignment/uniformity/anisotropy/spectrum')
    distributed.add_launch_flags(p)
    cli_io.add_import_flag(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    # The handlers go in first (delivering a signal held back during start-up); then a
    # usage error, an interrupt or a user error is one line.
    return cli_io.run_command(lambda: evaluate(parse_args(argv)))


def evaluate(args: argparse.Namespace) -> int:
    seeds = cli_io.parse_seeds(args.seeds) if args.seeds is not None else None
    if args.json:
        cli_io.check_output_file(args.json, args.overwrite, '--json', inputs=inputs(args))
    if args.plots:
        cli_io.check_output_dir(args.plots, args.overwrite, '--plots', keep=plots.check_replaceable)
    if args.tb:
        check_tb_target(args.tb, args.overwrite)
    sts_tasks, transfer_tasks = runner.split_tasks(parse_tasks(args.tasks))
    check_flag_effects(args, sts_tasks, transfer_tasks)
    roots = args.data or [runner.DEFAULT_DATA]
    runner.check_transfer_data(transfer_tasks, roots)
    models = args.model or [None]
    # Several processes: each encodes its devices' rows of every batch (vectors gathered on
    # all, scores computed alike); process 0 prints and writes.
    distributed.initialize_from_flags(args)
    say = print if distributed.is_main_process() else (lambda *a, **k: None)
    launch = ('coordinator', 'num_processes', 'process_id', 'distributed')
    distributed.check_same_inputs({'arguments': {k: v for k, v in vars(args).items()
                                                 if k not in launch}})
    runtime.enable_compilation_cache()
    rows, transfer_rows = [], []
    if sts_tasks or not transfer_tasks:
        rows = runner.run(
            models, roots, sts_tasks or None,
            posts=args.post or ['none'], pooler=args.pooler, max_length=args.max_length,
            batch_size=args.batch_size, split=args.split, aggregate=args.aggregate,
            fit_on=args.fit_on or ['target'], seeds=seeds or [0],
            flow_checkpoint=args.flow_checkpoint, flow_config=args.flow_config,
            eps=args.eps, diagnostics=not args.no_diagnostics or bool(args.plots),
            dtype=args.dtype)
        say(report.markdown_table(rows, args.aggregate))
        t = rows[-1].details['timing']
        say(f"\ntime: {t['total_s']:.1f} s evaluating ({t['encode_s']:.1f} s encoding "
              f"{t['sentences_encoded']} sentences, {t['rest_s']:.1f} s the rest)",
              file=sys.stderr)
    if transfer_tasks:
        transfer_rows = runner.run_transfer(
            models, roots, transfer_tasks, pooler=args.pooler, max_length=args.max_length,
            batch_size=args.batch_size, seeds=seeds or [runner.SENTEVAL_SEED],
            dtype=args.dtype)
        say(('\n' if rows else '') + report.transfer_table(transfer_rows))
    if not distributed.is_main_process():
        return 0
    if args.json:
        report.write_json(args.json, rows, transfer_rows, overwrite=args.overwrite)
    if args.plots and rows:
        for path in plots.write_plots(rows, args.plots, overwrite=args.overwrite):
            print(f'wrote {path}', file=sys.stderr)
    if args.tb:
        for path in report_tb.write_scores(args.tb, models, rows, transfer_rows,
                                           overwrite=args.overwrite):
            print(f'wrote {path}', file=sys.stderr)
    return 0


# The checks run before any work: an evaluation can take minutes, and a typo in a flag or an
# unwritable output must fail in the first second, not after it.
def parse_tasks(text):
    """--tasks as names: None (not given) runs every task found; a value naming none (an
    empty variable in `--tasks $T`) is an error, not every task."""
    if text is None:
        return []
    names = [n.strip() for n in text.split(',') if n.strip()]
    if not names:
        raise UsageError(f'--tasks {text!r} names no task (e.g. --tasks stsb,sickr); omit '
                         f'--tasks to evaluate every task found in --data')
    return names


def inputs(args) -> list[tuple[str, object]]:
    """(flag, path) of every file or folder an evaluation reads, which no output may replace."""
    fit_files = [f for f in args.fit_on or () if f not in ('target', 'task', 'paper')]
    return ([('--data', d) for d in args.data or [runner.DEFAULT_DATA]]
            + [('--model', m) for m in args.model or ()]
            + [('--fit-on', f) for f in fit_files]
            + [('--flow-checkpoint', args.flow_checkpoint), ('--flow-config', args.flow_config)])


def check_flag_effects(args, sts_tasks, transfer_tasks) -> None:
    """Refuses flags that would do nothing with the other flags given (each named)."""
    models = list(args.model or ())
    twice = next((m for i, m in enumerate(models) if m in models[:i]), None)
    if twice is not None:  # the same rows again, not told apart in the table
        raise UsageError(f'--model {twice} is given twice; name each model once')
    from_posts = [calibrate.parse_spec(p)[0] for p in (args.post or ['none'])]
    calibrating = [p for p, name in zip(args.post or [], from_posts) if name != 'none']
    runs_sts = bool(sts_tasks) or not transfer_tasks
    # Transfer tasks score raw vectors on their own splits: both would be silently dropped.
    if calibrating and not runs_sts:
        raise UsageError(f'--post {calibrating[0]} has no effect: calibrations apply to STS '
                         f'tasks, and only transfer tasks are given')
    if args.split != 'test' and not runs_sts:
        raise UsageError(f'--split {args.split} has no effect: it chooses the STS split, and '
                         f'only transfer tasks are given')
    if args.fit_on and not (calibrating and runs_sts):
        raise UsageError(f'--fit-on {args.fit_on[0]} has no effect: it chooses what a '
                         f'calibration is fitted on, and no calibrating --post is given '
                         f'(e.g. --post whitening)')
    has_flow = 'flow' in from_posts and runs_sts
    for flag, value in (('--flow-checkpoint', args.flow_checkpoint),
                        ('--flow-config', args.flow_config)):
        if value is not None and not has_flow:
            raise UsageError(f'{flag} {value} has no effect without --post flow')
    if args.seeds is not None:
        seeded = [p for p in calibrating if runner.is_seeded(p)] if runs_sts else []
        if not seeded and not transfer_tasks:
            raise UsageError(f'--seeds {args.seeds} has no effect: only flow calibrations '
                             f'and transfer tasks take a seed, and none is asked for')
        if seeded and args.flow_checkpoint is not None and not transfer_tasks and all(
                calibrate.parse_spec(p)[0] == 'flow' for p in seeded):
            raise UsageError(f'--seeds {args.seeds} has no effect with --flow-checkpoint '
                             f'(the saved flow is used as it is)')


def check_tb_target(folder, overwrite: bool) -> None:
    """Refuses, before any work, a --tb folder that cannot be written (see
    `jaxsim.eval.report_tb.write_scores`)."""
    if store.is_remote(folder):
        # Event files are written locally through tensorboardX; copy them to a bucket after.
        raise store.StorageError(f'--tb must be a local folder, got {folder}')
    cli_io.check_output_dir(folder, overwrite, '--tb', keep=report_tb.check_replaceable)
