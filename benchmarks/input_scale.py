"""Training input vs corpus size: memory and start-up of `train.py` on 1M and 10M lines.

Writes synthetic corpora (lines drawn from the shipped SNLI sentences) into a temporary
folder, indexes each once (`python -m jaxsim prepare`, the one-off data preparation,
reported apart), then runs `train.py` (configs/tiny_unsup_simcse.py, `--steps` steps) on each
as a subprocess and reports:

  peak_rss_mb         peak resident memory of the training process (os.wait4's ru_maxrss)
  first_step_s        from launching the process to the end of its first step
  step_sentences_s    sentences the step consumes per second (steps 2..N)
  input_sentences_s   sentences per second the input pipeline delivers on its own (this
                      process: `StreamIterator` over the same corpus, same batch and max_len)

Top-level "ratio" = max(RSS(largest)/RSS(smallest), first_step(largest)/first_step(smallest));
the goal is <= 1.2 (memory and start-up independent of corpus size). Every training run shares
one compilation cache that a warm-up run fills first, so compile time does not favour a side;
the corpora alternate `--repeats` times and each reports its fastest start and largest peak.

    python benchmarks/input_scale.py --json scale.json [--sizes 1000000,10000000] [--steps 10]
        [--repeats 2]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import common  # noqa: E402
from jaxsim.data import pipeline, sources  # noqa: E402
from jaxsim.formats.hf_folder import bundled_model_path, load_tokenizer  # noqa: E402
from jaxsim.storage.paths import SENTEVAL_ROOT  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / 'configs' / 'tiny_unsup_simcse.py'
BATCH, MAX_LEN = 16, 16  # the tiny config's

# Runs train.main in the child and records when the first and the last step are done.
_CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import jax
from jaxsim.cli import train
from jaxsim.train import step as step_lib

steps, marks, real_make = int(sys.argv[2]), {}, step_lib.make_train_step

def make(*args, **kwargs):
    step, count = real_make(*args, **kwargs), [0]
    def timed(state, batch):
        out = step(state, batch)
        count[0] += 1
        if count[0] in (1, steps):
            jax.block_until_ready(out)
            marks[count[0]] = time.time()
        return out
    return timed

step_lib.make_train_step = make  # what build.train_program calls
rc = train.main(sys.argv[3:])
print('MARKS ' + json.dumps(marks), flush=True)
sys.exit(rc)
"""


def write_corpus(path: Path, lines: int, seed: int) -> None:
    """`lines` sentences sampled from SentEval's SNLI files, written a million at a time."""
    pool = sorted({s for name in ('s1.dev', 's2.dev', 's1.test', 's2.test')
                   for s in (SENTEVAL_ROOT / 'SNLI' / name).read_text().splitlines() if s})
    rng = np.random.default_rng(seed)
    with path.open('w', encoding='utf-8') as f:
        for start in range(0, lines, 1_000_000):
            picks = rng.integers(0, len(pool), min(1_000_000, lines - start))
            f.write('\n'.join(pool[i] for i in picks) + '\n')


def run_measured(args: list[str], env: dict) -> tuple[float, float, str, str]:
    """Runs a command; (wall seconds, peak RSS MB of that process, stdout, stderr)."""
    out_file, err_file = tempfile.TemporaryFile('w+'), tempfile.TemporaryFile('w+')
    t0 = time.time()
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=out_file, stderr=err_file)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.time() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    out_file.seek(0)
    err_file.seek(0)
    out, err = out_file.read(), err_file.read()
    if proc.returncode != 0:
        raise SystemExit(f'error: {" ".join(args[:4])} ... exited {proc.returncode}:\n'
                         f'{err[-3000:]}')
    return wall, usage.ru_maxrss / 1024.0, out, err


def train_once(corpus: Path, workdir: Path, steps: int, env: dict) -> dict:
    args = [sys.executable, '-c', _CHILD, str(REPO), str(steps), '--config', str(CONFIG),
            '--workdir', str(workdir), f'--config.train_file={corpus}',
            f'--config.max_steps={steps}', '--config.checkpoint=False', '--no-progress']
    t0 = time.time()
    wall, rss, out, _ = run_measured(args, env)
    marks = json.loads(out.split('MARKS ')[-1].splitlines()[0])
    first, last = marks['1'], marks[str(steps)]
    return {'peak_rss_mb': round(rss, 1), 'first_step_s': round(first - t0, 2),
            'wall_s': round(wall, 2),
            'step_sentences_s': round((steps - 1) * BATCH / (last - first), 1)}


def input_rate(corpus: Path, batches: int) -> float:
    """Sentences/s of the streamed input alone, at the tiny config's batch and max_len."""
    it = pipeline.StreamIterator(sources.TextSource(corpus), load_tokenizer(bundled_model_path()),
                                 MAX_LEN, BATCH, seed=0)
    next(it)  # threads started, first batch ready
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    rate = batches * BATCH / (time.perf_counter() - t0)
    it.close()
    return rate


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--json', type=Path)
    ap.add_argument('--sizes', default='1000000,10000000')
    ap.add_argument('--steps', type=int, default=10)
    ap.add_argument('--input-batches', type=int, default=300)
    ap.add_argument('--repeats', type=int, default=2, help='training runs per corpus')
    ap.add_argument('--keep', action='store_true', help='keep the temporary folder')
    args = ap.parse_args(argv)
    common.setup_process()
    if args.steps < 2:
        raise SystemExit('error: --steps must be >= 2')
    sizes = [int(s) for s in args.sizes.split(',')]
    root = Path(tempfile.mkdtemp(prefix='jaxsim-input-scale-'))
    env = dict(os.environ, JAX_PLATFORMS='cpu', JAXSIM_CACHE_DIR=str(root / 'xla-cache'),
               JAXSIM_INDEX_DIR=str(root / 'index-cache'),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get('PYTHONPATH', ''))
    rows = {}
    try:
        for n in sizes:
            corpus = root / f'corpus-{n}.txt'
            t0 = time.time()
            write_corpus(corpus, n, seed=n)
            print(f'{n} lines: written in {time.time() - t0:.1f} s '
                  f'({corpus.stat().st_size / 2**20:.0f} MiB)', file=sys.stderr)
            wall, rss, out, _ = run_measured(
                [sys.executable, '-m', 'jaxsim', 'prepare', str(corpus)], env)
            rows[n] = {'lines': n, 'file_mib': round(corpus.stat().st_size / 2**20, 1),
                       'index_build_s': round(wall, 2), 'index_build_rss_mb': round(rss, 1)}
            print(f'  indexed: {out.strip()} ({wall:.1f} s with start-up, peak {rss:.0f} MB)',
                  file=sys.stderr)
        train_once(root / f'corpus-{sizes[0]}.txt', root / 'warmup', args.steps, env)
        runs = {n: [] for n in sizes}
        for rep in range(args.repeats):  # sizes alternate: drifts of the load hit both
            for n in sizes:
                r = train_once(root / f'corpus-{n}.txt', root / f'run-{n}-{rep}', args.steps,
                               env)
                runs[n].append(r)
                print(f'{n} lines, run {rep + 1}: {json.dumps(r)}', file=sys.stderr)
        for n in sizes:
            # Other jobs only ever add time: the fastest start is the least disturbed one.
            # Memory is not disturbed that way: the largest peak is reported.
            rows[n].update({
                'peak_rss_mb': max(r['peak_rss_mb'] for r in runs[n]),
                'first_step_s': min(r['first_step_s'] for r in runs[n]),
                'step_sentences_s': max(r['step_sentences_s'] for r in runs[n]),
                'all_runs': runs[n]})
            rows[n]['input_sentences_s'] = round(input_rate(root / f'corpus-{n}.txt',
                                                            args.input_batches), 1)
            rows[n]['input_vs_step'] = round(rows[n]['input_sentences_s']
                                             / rows[n]['step_sentences_s'], 2)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    small, large = rows[min(sizes)], rows[max(sizes)]
    rss_ratio = large['peak_rss_mb'] / small['peak_rss_mb']
    start_ratio = large['first_step_s'] / small['first_step_s']
    record = {'benchmark': 'input_scale', 'config': CONFIG.name, 'steps': args.steps,
              'ratio': round(max(rss_ratio, start_ratio), 3), 'goal': '<= 1.2',
              'rss_ratio': round(rss_ratio, 3), 'first_step_ratio': round(start_ratio, 3),
              'runs': [rows[n] for n in sizes]}
    print(json.dumps(record, indent=1))
    common.write_json(args.json, record)
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
