"""jaxsim.cli.environment: the one list of library-quieting variables, applied without
overriding the user's."""
import os
import subprocess
import sys
from pathlib import Path

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
