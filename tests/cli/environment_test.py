"""jaxsim.cli.environment: the one list of library-quieting variables, applied without
overriding the user's."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxsim.cli import environment
from tests.conftest import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]


def test_quiet_environment_sets_what_is_missing_and_keeps_what_the_user_set(monkeypatch):
    for name in environment.QUIET_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv('TF_CPP_MIN_LOG_LEVEL', '0')  # the user wants XLA's INFO lines
    environment.quiet_environment()
    assert os.environ['TF_CPP_MIN_LOG_LEVEL'] == '0'
    for name, value in environment.QUIET_ENV.items():
        if name != 'TF_CPP_MIN_LOG_LEVEL':
            assert os.environ[name] == value, name


def test_importing_train_or_eval_script_applies_the_list():
    # At import, not in main(): transformers' import-time advice must read the variables.
    code = ("import os, sys\n"
            "sys.path.insert(0, {repo!r})\n"
            "import importlib.util\n"
            "spec = importlib.util.spec_from_file_location('script', {path!r})\n"
            "module = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(module)\n"
            "from jaxsim.cli import environment\n"
            "print(all(os.environ.get(k) == v for k, v in environment.QUIET_ENV.items()))\n")
    env = {k: v for k, v in os.environ.items() if k not in environment.QUIET_ENV}
    for script in ('train.py', 'eval.py'):
        out = subprocess.run([sys.executable, '-c', code.format(repo=str(REPO),
                                                                path=str(REPO / script))],
                             env=env, capture_output=True, text=True, timeout=HANG_GUARD_S,
                             cwd=REPO)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == 'True', script


@pytest.mark.parametrize('libtpu, plugins, attached, user, skips', [
    (True, False, False, {}, True),  # libtpu on a CPU host: its start-up errors skipped
    (False, False, False, {}, False),  # no libtpu: JAX tries no TPU
    (True, True, False, {}, False),  # a GPU plugin: JAX chooses
    (True, False, True, {}, False),  # a TPU host: the TPU backend
    (True, False, False, {'JAX_PLATFORMS': 'tpu,cpu'}, False),  # the user's choice
    (True, False, False, {'JAX_FORCE_TPU_INIT': '1'}, False),
])
def test_an_absent_tpu_is_skipped_only_where_nothing_else_decides(monkeypatch, libtpu, plugins,
                                                                 attached, user, skips):
    monkeypatch.delenv('JAX_PLATFORMS', raising=False)
    monkeypatch.delenv('JAX_FORCE_TPU_INIT', raising=False)
    for name, value in user.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(environment, '_libtpu_installed', lambda: libtpu)
    monkeypatch.setattr(environment, '_backend_plugins', lambda: plugins)
    monkeypatch.setattr(environment, '_tpu_attached', lambda: attached)
    assert environment.skips_absent_tpu() is skips


def test_a_commands_error_is_one_line_where_libtpu_is_installed_without_a_tpu(tmp_path,
                                                                             monkeypatch):
    """The test extra installs libtpu (for the plan command); on a TPU-less host a command run
    without JAX_PLATFORMS used to print libtpu's five start-up error lines first."""
    monkeypatch.delenv('JAX_PLATFORMS')
    if not environment.skips_absent_tpu():  # a TPU or GPU host, or no libtpu: not this case
        pytest.skip('this host has a TPU, a GPU plugin or no libtpu')
    (tmp_path / 'empty.txt').write_text('\n')
    env = {k: v for k, v in os.environ.items() if k != 'JAX_PLATFORMS'}
    out = subprocess.run([sys.executable, '-m', 'jaxsim', 'encode', '--input', 'empty.txt',
                          '--output', 'x.npy'], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 1
    assert out.stderr.splitlines() == ['error: empty.txt: no sentences (the input is empty '
                                       'or blank)'], out.stderr[-2000:]
