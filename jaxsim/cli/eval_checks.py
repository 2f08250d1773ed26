"""The checks eval.py runs before any work: flags that would do nothing, unwritable outputs.

An evaluation can take minutes; a typo in `--json` or an unwritable `--plots` folder must fail
in the first second, not after it.
"""
from __future__ import annotations

from jaxsim import calibrate
from jaxsim.cli import cli_io
from jaxsim.cli.cli_io import UsageError
from jaxsim.eval import report_tb
from jaxsim.eval.runner import DEFAULT_DATA, is_seeded
from jaxsim.storage import store


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
    return ([('--data', d) for d in args.data or [DEFAULT_DATA]]
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
        seeded = [p for p in calibrating if is_seeded(p)] if runs_sts else []
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
