"""Train SimCSE: `python train.py --config configs/NAME.py --workdir DIR [--config.key=value]`.

  --seeds 1,2,3          one run per seed (DIR/seed_N) and mean/std of STS-B dev/test
  --coordinator H:P --num_processes N --process_id I    multi-process (multi-host) launch
The logic lives in jaxsim.train_lib; this file only parses flags.
"""
import sys

from absl import app, flags
from ml_collections import config_flags

config_flags.DEFINE_config_file('config', None, 'configs/NAME.py', lock_config=True)
flags.DEFINE_string('workdir', None, 'output folder (config.json, metrics.jsonl, checkpoints/)')
flags.DEFINE_string('seeds', '', 'comma-separated seeds; runs each and reports mean/std')
flags.DEFINE_string('coordinator', None, 'jax.distributed coordinator address host:port')
flags.DEFINE_integer('num_processes', None, 'number of processes (multi-process runs)')
flags.DEFINE_integer('process_id', None, 'this process index (multi-process runs)')
flags.DEFINE_boolean('progress', True, 'show a progress bar')
flags.mark_flags_as_required(['config', 'workdir'])
FLAGS = flags.FLAGS


def main(argv):
    del argv
    from jaxsim import distributed
    distributed.initialize(FLAGS.coordinator, FLAGS.num_processes, FLAGS.process_id)
    from jaxsim.runtime import enable_compilation_cache
    enable_compilation_cache()  # the train step and eval buckets compile for seconds on CPU
    from jaxsim import train_lib
    from jaxsim.data.pipeline import DataError
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every save step at INFO
    try:
        cfg = train_lib.TrainConfig.from_dict(FLAGS.config)
        if FLAGS.seeds:
            seeds = [int(s) for s in FLAGS.seeds.split(',') if s.strip()]
            summary = train_lib.run_seeds(cfg, FLAGS.workdir, seeds, FLAGS.progress)
            print(train_lib.format_seed_summary(summary))
            stopped = [r['stopped'] for r in summary['runs'].values() if r['stopped']]
        else:
            r = train_lib.train_and_evaluate(cfg, FLAGS.workdir, FLAGS.progress)
            print(f'steps {r.steps}  final loss {r.final_loss:.4f}  best STS-B dev '
                  f'{r.best_dev} @ {r.best_step}  test@best {r.test_at_best}  '
                  f'wall {r.wall_s:.0f}s')
            stopped = [r.stopped] if r.stopped else []
    except (ValueError, DataError, FileNotFoundError) as e:
        print(f'error: {e}', file=sys.stderr)
        return 2
    if stopped:
        print(f'error: {stopped[0]}', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    app.run(lambda argv: sys.exit(main(argv)))
