"""Multi-process launch flags of train.py, eval.py and `python -m jaxsim encode`: contradictory
or ignored flags are refused in one line before anything starts; a run whose other processes
never come stops after `--init_timeout` seconds with one line naming the coordinator; SIGINT /
SIGTERM while waiting for them exit 130 / 143 at once (`jaxsim.distributed`)."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import eval as eval_cli
import train
from jaxsim import distributed
from jaxsim.__main__ import main as cli_main
from jaxsim.distributed import DistributedError, Launch, resolve_launch
from tests.conftest import HANG_GUARD_S, cpu_devices_env
from tests.train.multiprocess_test import reserved_port

REPO = Path(__file__).resolve().parents[1]
_LAUNCH_ENV = ('JAXSIM_COORDINATOR', 'JAXSIM_NUM_PROCESSES', 'JAXSIM_PROCESS_ID',
               'JAXSIM_INIT_TIMEOUT')


@pytest.fixture(autouse=True)
def _no_launch_env(monkeypatch):
    for name in _LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize('flags, message', [
    (dict(num_processes=2), '--num_processes needs --coordinator HOST:PORT'),
    (dict(process_id=0), '--process_id needs --coordinator HOST:PORT'),
    (dict(num_processes=2, process_id=1), '--num_processes and --process_id need --coordinator'),
    (dict(coordinator='127.0.0.1:1234'), '--coordinator needs --num_processes and --process_id'),
    (dict(coordinator='127.0.0.1:1234', num_processes=2),
     '--coordinator needs --process_id too'),
    (dict(coordinator='127.0.0.1', num_processes=2, process_id=0),
     "--coordinator '127.0.0.1' is not HOST:PORT"),
    (dict(coordinator='host:70000', num_processes=2, process_id=0), 'is not HOST:PORT'),
    (dict(coordinator='h:1', num_processes=2, process_id=2), '--process_id 2 is not in [0, 2)'),
    (dict(coordinator='h:1', num_processes=0, process_id=0), '--num_processes must be at least'),
    (dict(auto=True, coordinator='h:1'), '--distributed auto detects the cluster itself; drop '
                                         '--coordinator'),
    (dict(init_timeout_s=5.0), '--init_timeout applies to a multi-process launch only'),
    (dict(coordinator='h:1', num_processes=2, process_id=0, init_timeout_s=0.0),
     '--init_timeout must be a positive number of seconds'),
    (dict(coordinator='h:1', num_processes=2, process_id=0, init_timeout_s=float('nan')),
     '--init_timeout must be a positive number of seconds'),
])
def test_contradictory_or_ignored_launch_flags_are_refused(flags, message):
    with pytest.raises(DistributedError) as info:
        resolve_launch(**flags, flags=True)
    assert message in str(info.value)


def test_launch_settings_come_from_flags_then_the_environment(monkeypatch):
    assert resolve_launch(flags=True) == Launch()
    assert not Launch().multi_process
    assert resolve_launch('h:1', 2, 1, init_timeout_s=7, flags=True) == Launch('h:1', 2, 1,
                                                                                 init_timeout_s=7)
    monkeypatch.setenv('JAXSIM_COORDINATOR', 'h:2')
    monkeypatch.setenv('JAXSIM_NUM_PROCESSES', '4')
    monkeypatch.setenv('JAXSIM_PROCESS_ID', '3')
    monkeypatch.setenv('JAXSIM_INIT_TIMEOUT', '9.5')
    assert resolve_launch(flags=True) == Launch('h:2', 4, 3, init_timeout_s=9.5)
    assert resolve_launch(process_id=0, flags=True) == Launch('h:2', 4, 0, init_timeout_s=9.5)
    assert resolve_launch(auto=True, flags=True) == Launch(auto=True, init_timeout_s=9.5)
    monkeypatch.setenv('JAXSIM_PROCESS_ID', '4')
    with pytest.raises(DistributedError, match=r'\$JAXSIM_PROCESS_ID 4 is not in \[0, 4\) '
                                               r'\(\$JAXSIM_NUM_PROCESSES 4\)'):
        resolve_launch(flags=True)
    monkeypatch.delenv('JAXSIM_COORDINATOR')
    with pytest.raises(DistributedError, match=r'\$JAXSIM_NUM_PROCESSES and \$JAXSIM_PROCESS_ID '
                                               r'need --coordinator'):
        resolve_launch(flags=True)
    monkeypatch.setenv('JAXSIM_INIT_TIMEOUT', 'soon')
    with pytest.raises(DistributedError, match=r"\$JAXSIM_INIT_TIMEOUT='soon' is not a number"):
        resolve_launch(auto=True, flags=True)


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and err.startswith('error: '), err
    return err


def test_every_command_refuses_a_process_count_without_a_coordinator(tmp_path, capsys):
    (tmp_path / 'in.txt').write_text('a man plays a guitar .\n')
    assert cli_main(['encode', '--input', str(tmp_path / 'in.txt'), '--output',
                     str(tmp_path / 'v.npy'), '--num_processes', '2']) == 1
    assert '--num_processes needs --coordinator' in _one_error(capsys)
    assert eval_cli.main(['--json', str(tmp_path / 'r.json'), '--process_id', '1']) == 1
    assert '--process_id needs --coordinator' in _one_error(capsys)
    assert train.main(['--config', str(REPO / 'configs' / 'tiny_unsup_simcse.py'), '--workdir',
                       str(tmp_path / 'w'), '--num_processes', '2', '--process_id', '0']) == 1
    assert '--num_processes and --process_id need --coordinator' in _one_error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ['in.txt']  # nothing written
    assert not distributed._initialized


def _alone(command, tmp_path, port, *extra):
    """Starts `command` as process 0 of 2 on `port`, with no process 1."""
    launch = ['--coordinator', f'127.0.0.1:{port}', '--num_processes', '2', '--process_id', '0']
    return subprocess.Popen([sys.executable, *command, *launch, *extra], cwd=tmp_path,
                            env=dict(cpu_devices_env(1), PYTHONPATH=str(REPO)),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _encode(tmp_path):
    (tmp_path / 'in.txt').write_text('a man plays a guitar .\n')
    return ['-m', 'jaxsim', 'encode', '--input', 'in.txt', '--output', 'v.npy']


def test_a_process_whose_peers_never_come_stops_in_one_line_naming_the_coordinator(tmp_path):
    with reserved_port() as port:
        proc = _alone(_encode(tmp_path), tmp_path, port, '--init_timeout', '2')
        out, err = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 1, err[-3000:]
    assert err.splitlines() == [
        f'waiting up to 2 s for the 2 processes of the run at 127.0.0.1:{port} (this is '
        f'process 0) to connect',
        f'error: not every process connected to the coordinator 127.0.0.1:{port} within 2 s; '
        f'start all 2 processes with the same --coordinator, or wait longer with '
        f'--init_timeout SECONDS'], err[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ['in.txt']


def _train(tmp_path):
    return [str(REPO / 'train.py'), '--config', str(REPO / 'configs' / 'tiny_unsup_simcse.py'),
            '--workdir', 'w', '--noprogress']


def _eval(tmp_path):
    return [str(REPO / 'eval.py'), '--json', 'r.json']


@pytest.mark.parametrize('command, signum, last_line', [
    (_encode, signal.SIGTERM, 'interrupted by SIGTERM; no output file written'),
    (_eval, signal.SIGINT, 'interrupted by SIGINT; no output file written'),
    (_train, signal.SIGTERM, 'interrupted by SIGTERM; rerun the same command to continue (from '
                             'the last checkpoint, if any)'),
])
def test_a_signal_while_waiting_for_the_other_processes_stops_at_once(tmp_path, command,
                                                                      signum, last_line):
    args = command(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    with reserved_port() as port:
        # The default wait (300 s): only the signal can end it before the outer timeout.
        proc = _alone(args, tmp_path, port)
        watchdog = threading.Timer(600, proc.kill)
        watchdog.start()
        try:
            first = proc.stderr.readline()  # the command says it is waiting, then waits
            assert first.startswith('waiting up to 300 s for the 2 processes'), first
            proc.send_signal(signum)
            out, err = proc.communicate()
        finally:
            watchdog.cancel()
    assert proc.returncode == 128 + signum, first + err[-3000:]
    assert err.splitlines() == [last_line], err[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_process_0_refuses_a_coordinator_port_another_program_listens_on():
    # JAX's coordination service crashed (a segmentation fault) on such a port.
    with socket.socket() as other:
        other.bind(('127.0.0.1', 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(DistributedError, match=rf'cannot serve the coordinator '
                                                   rf'127\.0\.0\.1:{port} on this host '
                                                   rf'\(process 0\): port {port}: '):
            distributed._check_port_free(f'127.0.0.1:{port}')
    with reserved_port() as port:  # held as gRPC holds a port: shared, as the service shares it
        distributed._check_port_free(f'127.0.0.1:{port}')


def test_a_signal_that_lands_on_another_thread_still_ends_the_wait(monkeypatch):
    # A process-directed signal may be delivered to any thread that does not block it; Python
    # then only notes it for the main thread, which must wake up to run the handler (a wait in
    # one call slept through a SIGTERM until its 300 s were over, on a loaded machine).
    handled, connect_ended, seen_by_connect = threading.Event(), threading.Event(), []

    class Stop(Exception):
        pass

    def handler(signum, frame):
        handled.set()
        raise Stop

    def connect():  # on the worker thread: the signal lands here, not on the waiting thread
        handled.wait(0.5)  # a pause, so that the waiting thread is inside its wait
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
        # Still connecting: the handler must run now, not when the waiter's wait ends.
        seen_by_connect.append(handled.wait(HANG_GUARD_S))
        connect_ended.set()

    monkeypatch.setattr(distributed, '_abandon', lambda: None)  # no exit hooks in this process
    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        with pytest.raises(Stop):
            distributed._wait_for(connect, 2 * HANG_GUARD_S, 'the test')
        assert connect_ended.wait(HANG_GUARD_S) and seen_by_connect == [True]
    finally:
        signal.signal(signal.SIGUSR1, previous)
