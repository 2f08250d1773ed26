"""train.py: one summary line, no start-up noise, one-line errors with exit code 1."""
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from jaxsim.cli import train
from jaxsim.formats import hf_folder
from jaxsim.storage import store
from tests.conftest import HANG_GUARD_S, write_run_data

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / 'configs' / 'tiny_unsup_simcse.py')


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    """A corpus and a 40-pair STS-B."""
    return write_run_data(tmp_path_factory.mktemp('cli'), 's1.dev', 64, 40)


# train.py as in the JAX-only install, where transformers finds no PyTorch and would say so.
_WITHOUT_TORCH = """
import importlib.util, runpy, sys
find_spec = importlib.util.find_spec  # how transformers looks for torch
importlib.util.find_spec = lambda name, *a: None if name.split('.')[0] == 'torch' else (
    find_spec(name, *a))
sys.argv = ['train.py'] + sys.argv[1:]
runpy.run_path('train.py', run_name='__main__')
"""


def _cli(args):
    env = dict(os.environ, JAX_PLATFORMS='cpu')
    for name in ('TRANSFORMERS_NO_ADVISORY_WARNINGS', 'TRANSFORMERS_VERBOSITY',
                 'TF_CPP_MIN_LOG_LEVEL'):
        env.pop(name, None)
    return subprocess.run([sys.executable, '-c', _WITHOUT_TORCH, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=HANG_GUARD_S)


def test_cli_prints_the_summary_and_no_start_up_noise(data, tmp_path):
    p = _cli(['--config', TINY, '--workdir', str(tmp_path / 'w'),
              f'--config.train_file={data / "corpus.txt"}', '--config.max_steps=2',
              f'--config.senteval_root={data / "senteval"}', '--config.eval_every=2',
              '--config.eval_max_len=16'])
    assert p.returncode == 0, p.stderr[-3000:]
    assert re.fullmatch(r'best STS-B dev -?\d+\.\d\d @ step [02], test -?\d+\.\d\d\n', p.stdout)
    assert 'final evaluation: STS-B test with the parameters of step' in p.stderr
    for noise in ('PyTorch was not found', 'libtpu', 'Traceback', 'TPU'):
        assert noise not in p.stderr + p.stdout, noise


@pytest.mark.parametrize('args, message', [
    (['--config.learnign_rate=1'],
     "unknown config key 'learnign_rate' (did you mean 'learning_rate'?)"),
    (['--config.batch_size=abc'], '--config.batch_size=abc: expected an integer'),
    (['--config.batch_size=15', '--config.grad_accum_steps=2'],
     'train config: batch_size 15 is not divisible by grad_accum_steps 2'),
    (['--config.learning_rate=-1'], 'train config: learning_rate must be a finite number >= 0'),
    (['--config.objective=nope'], "unknown objective 'nope'; choose one of"),
    # Alone, an example has no in-batch negative: its loss is exactly 0, nothing trains.
    (['--config.batch_size=1'], "objective 'unsup' needs at least 2 examples a loss; global "
                                "batch 1 gives 1"),
    (['--config.batch_size=4', '--config.grad_accum_steps=4'],
     "global batch 4 in 4 accumulated pieces gives 1"),
    (['--config.train_file=/nonexistent/x.txt'], '/nonexistent/x.txt: sentence file not found'),
    (['--allow-change=max_step'], "unknown config key 'max_step' (did you mean 'max_steps'?)"),
    (['--config.model='], "train config: model is empty; give a folder, a hub id or 'bundled'"),
    (['--seeds', '1,1'], "--seeds '1,1': a seed is listed twice"),
    (['--seeds', ','], "--seeds ',': '' is not a non-negative integer"),
    (['--seeds', '1,-2'], "--seeds '1,-2': '-2' is not a non-negative integer"),
    (['--config.model_overrides.num_attention_heads=0'],
     'train config: model_overrides: num_attention_heads: expected int >= 1, got 0'),
    # Past the tiny model's 64 positions: refused before the workdir, not NaN losses in it.
    (['--config.max_len=100'], 'train config: max_len 100 is more than the 64 tokens'),
    (['--config.eval_max_len=100', '--config.eval_every=1', '--config.senteval_root=SENTEVAL'],
     'train config: eval_max_len must be in [2, 64] for this model, got 100'),
    # Values the first step or JAX's key would refuse: refused before the workdir is written,
    # so the corrected rerun is not refused as another run.
    (['--config.seed=99999999999999999999'],
     'train config: seed must fit in 64 bits, got 99999999999999999999'),
    (['--seeds', '1,99999999999999999999'],
     "--seeds '1,99999999999999999999': 99999999999999999999 is larger than 4294967295"),
    (['--config.objective_kwargs.temp=0'],
     "objective 'unsup': temp must be a positive number, got 0"),
    (['--config', 'YAML'], 'c.yaml: not a Python file; a config file is a .py file defining '
                           'get_config()'),
])
def test_bad_input_is_one_error_line_and_exit_code_1(data, tmp_path, capsys, args, message):
    base = ['--config', TINY, '--workdir', str(tmp_path / 'w'), '--noprogress',
            f'--config.train_file={data / "corpus.txt"}']
    (tmp_path / 'c.yaml').write_text('seed: 1\n')
    args = [a.replace('SENTEVAL', str(data / 'senteval')).replace('YAML', str(tmp_path / 'c.yaml'))
            for a in args]
    assert train.main(base + args) == 1
    out, err = capsys.readouterr()
    assert out == '' and err.count('\n') == 1 and err.startswith('error: '), err
    assert message in err
    assert not (tmp_path / 'w').exists()  # nothing written for a refused run


@pytest.mark.parametrize('args, message', [
    (['--workdir', 'w'], 'the following arguments are required: --config'),
    (['--config', TINY, '--workdir', 'w', '--bogus'], 'unrecognized argument --bogus'),
])
def test_bad_flags_are_one_error_line_and_exit_code_1(capsys, args, message):
    # The one format of every command line, not argparse's usage block and exit code 2.
    with pytest.raises(SystemExit) as stop:
        train.main(args)
    assert stop.value.code == 1
    out, err = capsys.readouterr()
    assert out == '' and err.count('\n') == 1 and err.startswith('error: ') and message in err


def test_read_only_workdir_is_one_error_line(data, tmp_path, capsys, monkeypatch):
    ro = tmp_path / 'ro'
    ro.mkdir()
    os.chmod(ro, 0o555)
    if os.getuid() == 0:
        # root may write anywhere; answer access() as the kernel would for a plain user.
        monkeypatch.setattr(store.os, 'access', lambda path, mode: not (
            mode & os.W_OK and not os.stat(path).st_mode & 0o002))
    args = ['--config', TINY, '--workdir', str(ro / 'run'), '--noprogress',
            f'--config.train_file={data / "corpus.txt"}']
    assert train.main(args) == 1
    out, err = capsys.readouterr()
    assert err == f'error: --workdir {ro / "run"}: not writable ({ro} is read-only)\n'
    assert list(ro.iterdir()) == []


def test_a_signal_while_the_tokenizer_loads_exits_143(data, tmp_path, capsys, monkeypatch):
    # The tokenizer loader turns every Exception into "cannot load a tokenizer" (exit 1); the
    # interrupt must pass through it and end like any other: one line, 143.
    class Loader:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            signal.raise_signal(signal.SIGTERM)  # train.py's handler raises here
            raise AssertionError('SIGTERM was not raised as an interrupt')

    monkeypatch.setattr(hf_folder, '_declared_tokenizer_class', lambda folder: Loader)
    args = ['--config', TINY, '--workdir', str(tmp_path / 'w'), '--noprogress',
            f'--config.train_file={data / "corpus.txt"}']
    assert train.main(args) == 143
    out, err = capsys.readouterr()
    assert out == '' and err.startswith('interrupted by SIGTERM') and err.count('\n') == 1, err


def test_a_folder_of_the_users_files_is_refused_as_workdir(data, tmp_path, capsys):
    """Files a run would replace (model.json, metrics.jsonl, result.json) or leave mixed with
    its own: without jaxsim's run record the workdir must be new or empty."""
    mine = tmp_path / 'mine'
    mine.mkdir()
    names = ('metrics.jsonl', 'model.json', 'result.json', 'notes.txt')
    for name in names:
        (mine / name).write_text(f'the user\'s {name}\n')
    seeds = tmp_path / 'seeds'
    seeds.mkdir()
    (seeds / 'seeds_summary.json').write_text('{}')
    base = ['--config', TINY, '--noprogress', f'--config.train_file={data / "corpus.txt"}']
    assert train.main(base + ['--workdir', str(mine)]) == 1
    assert capsys.readouterr().err == (
        f'error: --workdir {mine} holds files jaxsim did not write (metrics.jsonl, model.json, '
        f'notes.txt and 1 more); choose an empty or new --workdir\n')
    assert sorted(p.name for p in mine.iterdir()) == sorted(names)
    assert all((mine / n).read_text() == f'the user\'s {n}\n' for n in names)
    assert train.main(base + ['--workdir', str(seeds), '--seeds', '1,2']) == 1
    assert capsys.readouterr().err == (
        f'error: --workdir {seeds} holds files jaxsim did not write (seeds_summary.json); '
        f'choose an empty or new --workdir\n')
    assert [p.name for p in seeds.iterdir()] == ['seeds_summary.json']


def test_a_run_that_fails_before_training_leaves_no_record(data, tmp_path):
    """A sharding the mesh cannot take is found while the step is built, after the run wrote
    its record: the record goes again, so the corrected command is a new run, not refused as
    'a run with other settings'."""
    from tests.conftest import cpu_devices_env

    workdir = tmp_path / 'w'
    p = subprocess.run([sys.executable, 'train.py', '--config', TINY, '--workdir', str(workdir),
                        f'--config.train_file={data / "corpus.txt"}', '--noprogress',
                        '--config.mesh_tensor=4'],
                       cwd=REPO, env=cpu_devices_env(4), capture_output=True, text=True,
                       timeout=HANG_GUARD_S)
    assert p.returncode == 1 and p.stderr.count('\n') == 1, p.stderr[-2000:]
    assert "its 'vocab' dimension 30522 cannot be split over mesh axes tensor" in p.stderr
    assert [q.name for q in workdir.iterdir()] == [store.LOCK_FILE]  # released, nothing else
