"""Crash and stop safety: train.py killed (SIGKILL) or stopped (SIGINT/SIGTERM) at chosen and
random moments (inside a step, during an asynchronous checkpoint save, during the STS-B
evaluation) always resumes, ends bit-identical to an uninterrupted run, and leaves a workdir
that loads as a model at every point.

The moments are hooked inside the child process (the step function, `Checkpointer.save`, the
evaluator's encode), so each lands where intended with no timing involved: a save is held in
progress (its background finalization waits until the signal has been sent). Children share
one persistent compilation cache: only the first compiles.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxsim
from jaxsim.formats.checkpoint import Checkpointer
from tests.conftest import HANG_GUARD_S, cpu_devices_env, write_run_data

REPO = Path(__file__).resolve().parents[2]
STEPS = 20  # 120 sentences / 16 = 7 batches an epoch: the run crosses two epoch boundaries

_CHILD = """
import os, signal, sys, threading
sys.path.insert(0, os.getcwd())
from jaxsim.cli import train
from orbax.checkpoint import checkpoint_manager
from jaxsim.formats import checkpoint
from jaxsim.train import evaluate, loop, step as step_lib
# The parent checks that the signal landed where the plan says (the PHASE line).
from tests.signal_phases import fire as fire_signal, reached as phase_reached

mode, at, signame = sys.argv[1], int(sys.argv[2]), sys.argv[3]

def fire(phase):
    fire_signal(phase, getattr(signal, signame))

if mode == 'step':  # right after step `at` is dispatched: its computation is in flight
    real_make = step_lib.make_train_step
    def make(*args, **kwargs):
        step = real_make(*args, **kwargs)
        def wrapped(state, batch):
            before = int(state.step)
            out = step(state, batch)
            if before + 1 == at:
                fire(f'step {at} dispatched')
            return out
        return wrapped
    step_lib.make_train_step = make  # what build.train_program calls
elif mode == 'save':  # checkpoint `at` handed to orbax's background writer, held there
    released = threading.Event()
    real_finalize = checkpoint_manager.CheckpointManager._finalize
    def finalize(self, step, *args, **kwargs):  # the background thread that commits a save
        if int(step) == at:
            released.wait()
        return real_finalize(self, step, *args, **kwargs)
    checkpoint_manager.CheckpointManager._finalize = finalize
    real_save = checkpoint.Checkpointer.save
    def save(self, step, *args, **kwargs):
        started = real_save(self, step, *args, **kwargs)
        if int(step) == at:
            held = self._manager.is_saving_in_progress()
            phase_reached(f'save {step} ' + ('in progress' if held else 'committed'))
            try:
                os.kill(os.getpid(), getattr(signal, signame))
            finally:  # a graceful stop waits for this save: let it commit now
                released.set()
        return started
    checkpoint.Checkpointer.save = save
elif mode == 'eval':  # halfway through encoding the STS-B sentences of evaluation `at`
    real_encode, calls = evaluate.encode, []
    def encode(model, sentences, **kwargs):
        calls.append(1)
        if len(calls) == at:
            half = len(sentences) // 2
            real_encode(model, sentences[:half], **kwargs)
            fire(f'eval encode {at}')
        return real_encode(model, sentences, **kwargs)
    evaluate.encode = encode
elif mode == 'final':  # halfway through encoding the STS-B test sentences at the end
    real_encode, real_score, phase = evaluate.encode, evaluate.StsbEvaluator.score, []
    def score(self, params, split='dev'):
        phase[:] = [split]
        return real_score(self, params, split)
    def encode(model, sentences, **kwargs):
        if phase == ['test']:
            real_encode(model, sentences[:len(sentences) // 2], **kwargs)
            fire('test encode')
        return real_encode(model, sentences, **kwargs)
    evaluate.StsbEvaluator.score, evaluate.encode = score, encode
sys.exit(train.main(sys.argv[4:]))
"""


@pytest.fixture(scope='module')
def setup(tmp_path_factory):
    root = write_run_data(tmp_path_factory.mktemp('resume'), 's2.dev', 120, 32)
    (root / 'cache').mkdir()
    return root


def _args(setup: Path, workdir: Path) -> list[str]:
    return ['--config', str(REPO / 'configs' / 'tiny_unsup_simcse.py'), '--workdir',
            str(workdir), f'--config.train_file={setup / "corpus.txt"}',
            f'--config.max_steps={STEPS}', '--config.checkpoint_every=4',
            '--config.keep_checkpoints=2', f'--config.senteval_root={setup / "senteval"}',
            '--config.eval_every=8', '--config.eval_max_len=16']


def _start(setup, workdir, mode='none', at=0, signame='SIGKILL'):
    env = dict(cpu_devices_env(1), JAXSIM_CACHE_DIR=str(setup / 'cache'))
    return subprocess.Popen(
        [sys.executable, '-c', textwrap.dedent(_CHILD), mode, str(at), signame,
         *_args(setup, workdir)], cwd=REPO, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)


def _run(*args, **kwargs):
    proc = _start(*args, **kwargs)
    out, err = proc.communicate(timeout=HANG_GUARD_S)
    return proc.returncode, out, err


def _latest(workdir: Path):
    folder = workdir / 'checkpoints'
    if not folder.is_dir():
        return None
    with Checkpointer(folder, read_only=True) as ckpt:
        return ckpt.latest_step()


def _final_params(workdir: Path) -> list[np.ndarray]:
    with Checkpointer(workdir / 'checkpoints', read_only=True) as ckpt:
        return [np.asarray(x) for x in jax.tree.leaves(ckpt.restore(STEPS).state['params'])]


def _check_consistent(workdir: Path) -> None:
    """What a crash may leave: strict JSON records, a clean log, a loadable model."""
    for name in ('config.json', 'model.json'):
        json.loads((workdir / name).read_text())
    steps = [json.loads(x)['step'] for x in (workdir / 'metrics.jsonl').read_text().splitlines()
             if x.strip().endswith('}')]
    assert steps == sorted(set(steps)), steps
    if _latest(workdir) is not None:
        model = jaxsim.load_pretrained(workdir)
        assert np.isfinite(jaxsim.encode(model, ['a man plays a guitar .'])).all()


def test_interrupted_runs_resume_bit_identical(setup, tmp_path):
    straight, work = tmp_path / 'straight', tmp_path / 'work'
    rng = np.random.default_rng(0)
    # (mode, at, signal): the kill points of successive runs, each past the previous restore.
    plan = [('step', int(rng.integers(2, 4)), 'SIGKILL'),
            ('save', 8, 'SIGKILL'),
            ('eval', 3, 'SIGKILL'),   # the 3rd encode: STS-B dev at step 16
            ('save', 16 + 4 * int(rng.integers(0, 2)), 'SIGTERM'),
            ('final', 0, 'SIGINT')]   # the STS-B test evaluation at the end
    want_phase = {'step': 'step {at} dispatched', 'save': 'save {at} in progress',
                  'eval': 'eval encode {at}', 'final': 'test encode'}
    uninterrupted = _start(setup, straight)  # alongside the first interrupted run
    for n, (mode, at, signame) in enumerate(plan):
        before = _latest(work)
        rc, out, err = _run(setup, work, mode, at, signame)
        phases = [x[len('PHASE '):] for x in err.splitlines() if x.startswith('PHASE ')]
        assert phases == [want_phase[mode].format(at=at)], (mode, at, phases, err[-3000:])
        if before is not None:
            assert f'resuming {work} from step {before} of {STEPS}' in err, err[-3000:]
        if signame == 'SIGKILL':
            assert rc == -signal.SIGKILL, (mode, at, rc, err[-3000:])
        else:
            assert rc == 128 + getattr(signal, signame), (mode, at, rc, err[-3000:])
            lines = [x for x in err.splitlines() if x.startswith('interrupted by')]
            assert len(lines) == 1 and 'rerun the same command to resume' in lines[0], err
            assert 'Traceback' not in err
            assert not list(work.glob('checkpoints/*tmp*')), list(work.glob('checkpoints/*'))
        _check_consistent(work)
        if n == 0:
            _, err = uninterrupted.communicate(timeout=HANG_GUARD_S)
            assert uninterrupted.returncode == 0, err[-3000:]
    rc, out, err = _run(setup, work)
    assert rc == 0, err[-3000:]
    assert out.splitlines()[-1].startswith('best STS-B dev')
    assert (work / 'metrics.jsonl').read_text() == (straight / 'metrics.jsonl').read_text()
    a, b = (json.loads((w / 'result.json').read_text()) for w in (straight, work))
    assert {**a, 'wall_s': 0} == {**b, 'wall_s': 0}
    for x, y in zip(_final_params(straight), _final_params(work)):
        np.testing.assert_array_equal(x, y)
    _check_consistent(work)
