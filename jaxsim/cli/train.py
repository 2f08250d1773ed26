"""Train a sentence encoder: `python train.py --config configs/NAME.py --workdir DIR`.

  --config.KEY=VALUE      override a config field (dict fields: --config.objective_kwargs.temp=0.1)
  --allow-change=K1,K2    rerun a workdir with these run-defining keys changed (recorded there)
  --seeds 1,2,3           one run per seed (DIR/seed_N) and mean/std of STS-B dev/test
  --coordinator H:P --num_processes N --process_id I    multi-process (multi-host) launch
  --distributed auto      multi-process launch detected from the cluster (TPU pod, SLURM, MPI)
  --plan TOPOLOGY         train nothing: compile this config's step for a TPU topology on this
                          machine and report memory, cost and collectives (python -m jaxsim plan)
The logic lives in jaxsim.train; this file parses flags and turns outcomes into exit codes:
0 done, 1 bad input (one `error:` line), 130/143 interrupted by SIGINT/SIGTERM (state saved).
The repository's train.py runs `main` here.
"""
# Before transformers loads and a JAX backend starts: no "PyTorch was not found" advice (jaxsim
# uses transformers for tokenizers only) and no libtpu / XLA start-up chatter.
from jaxsim.cli import environment

environment.quiet_environment()

import argparse  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

from absl import logging as absl_logging  # noqa: E402

from jaxsim import distributed  # noqa: E402
from jaxsim.cli import cli_io, interrupts  # noqa: E402
from jaxsim.cli.plan import run_plan  # noqa: E402
from jaxsim.errors import USER_ERROR_EXIT, USER_ERRORS, Interrupted  # noqa: E402
from jaxsim.train.config import TrainConfig  # noqa: E402
from jaxsim.train.config_files import apply_overrides, load_config_file  # noqa: E402
from jaxsim.train.fingerprint import parse_key_list  # noqa: E402
from jaxsim.train.loop import format_seed_summary, run_seeds, train_and_evaluate  # noqa: E402
from jaxsim.train.records import DERIVED_KEYS  # noqa: E402
from jaxsim.train.step import configure_jax  # noqa: E402


def parse_args(argv):
    p = cli_io.ArgumentParser(prog='train.py', description=__doc__.split('\n')[0])
    p.add_argument('--config', required=True, help='configs/NAME.py (or NAME.py:ARG)')
    p.add_argument('--workdir', help='the run folder (becomes a loadable model)')
    p.add_argument('--plan', metavar='TOPOLOGY', default=None,
                   help='compile the config for a TPU topology here (v5e:4x4, v5p-128) and '
                        'report per chip; trains nothing (python -m jaxsim plan)')
    p.add_argument('--num-slices', type=int, default=1, help='with --plan: slices over DCN')
    p.add_argument('--allow-change', default='', metavar='KEYS',
                   help='comma-separated run-defining keys allowed to differ on a rerun')
    p.add_argument('--seeds', default='', help='comma-separated seeds')
    distributed.add_launch_flags(p)
    p.add_argument('--progress', action=argparse.BooleanOptionalAction, default=True)
    p.add_argument('--noprogress', dest='progress', action='store_false', help=argparse.SUPPRESS)
    cli_io.add_import_flag(p)
    args, rest = p.parse_known_args(argv)
    overrides = cli_io.config_overrides(p, rest)
    if args.plan is None and not args.workdir:
        p.error('the following arguments are required: --workdir (or --plan TOPOLOGY)')
    if args.plan is not None and (args.workdir or args.seeds):
        p.error('--plan trains nothing: it takes no --workdir or --seeds')
    if args.num_slices < 1 or (args.num_slices > 1 and args.plan is None):
        p.error('--num-slices N (N >= 1) goes with --plan')
    return args, overrides


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


def main(argv=None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    if args.plan is not None:  # the plan command's report
        environment.setup()
        try:
            return run_plan(args.config, overrides, args.plan, args.num_slices)
        except USER_ERRORS as e:
            return cli_io.report_error(e)
    # orbax logs every save at INFO; JAX logs backend probing (libtpu) at INFO.
    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.getLogger('jax._src.xla_bridge').setLevel(logging.WARNING)
    # Before training a signal stops at once (nothing to save); the loop defers it to a save.
    previous = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return run(args, overrides)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run(args, overrides) -> int:
    try:
        interrupts.unblock()  # a signal held back during start-up is raised here
        distributed.initialize_from_flags(args)
        main_process = distributed.is_main_process()
        configure_jax()
        environment.setup()  # quiet libraries; compilation cache: the step compiles for seconds
        fields = apply_overrides(load_config_file(args.config), overrides)
        cfg = TrainConfig.from_dict(fields, source=args.config)
        allow = parse_key_list(args.allow_change, extra=DERIVED_KEYS)
        if args.seeds:
            summary = run_seeds(cfg, args.workdir, cli_io.parse_seeds(args.seeds),
                                progress=args.progress, allow_changes=allow)
            if main_process:
                print(format_seed_summary(summary))
            stopped = [r['stopped'] for r in summary['runs'].values() if r['stopped']]
        else:
            result = train_and_evaluate(cfg, args.workdir, progress=args.progress,
                                        allow_changes=allow)
            if main_process:
                if result.already_finished:
                    print(f'{args.workdir}: this run already finished ({result.steps} steps); '
                          f'nothing to do', file=sys.stderr)
                if not result.stopped:  # a stop is the error line below
                    print(result.summary())
            stopped = [result.stopped] if result.stopped else []
    except Interrupted as e:
        name = signal.Signals(e.signum).name
        if e.step is None:
            print(f'interrupted by {name}; rerun the same command to continue (from the last '
                  f'checkpoint, if any)', file=sys.stderr)
        else:
            print(f'interrupted by {name}: state saved at step {e.step}; rerun the same command '
                  f'to resume', file=sys.stderr)
        return e.exit_code
    except USER_ERRORS as e:
        return cli_io.report_error(e)
    if stopped:
        print(f'error: {stopped[0]}', file=sys.stderr)
        return USER_ERROR_EXIT
    return 0

