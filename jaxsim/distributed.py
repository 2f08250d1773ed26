"""Multi-process (multi-host) start-up: `jax.distributed.initialize` when asked for (docs/pod.md).

A run is multi-process when a coordinator address is given (flags, or JAXSIM_COORDINATOR,
JAXSIM_NUM_PROCESSES, JAXSIM_PROCESS_ID), or with JAX's own cluster detection (`auto`). On one
CPU machine, several processes on loopback use CPU (gloo) collectives, as the tests run it.
Settings that contradict each other or would be ignored are refused before anything starts
(`resolve_launch`); SIGINT / SIGTERM end the wait for the other processes at once.
"""
from __future__ import annotations

import atexit
import dataclasses
import functools
import hashlib
import json
import math
import os
import socket
import sys
import threading
import time
from typing import Any, Callable, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxsim import runtime
from jaxsim.errors import JaxsimError

_initialized = False


class DistributedError(JaxsimError):
    """Multi-process settings that cannot start a run (the message names the setting)."""


DEFAULT_INIT_TIMEOUT_S = 300.0  # JAX's own default wait for every process to connect
# JAX aborts the process (a C++ check failure) when its own initialization timeout passes:
# it is given this much longer than ours, which ends the wait first with one line.
_JAX_TIMEOUT_MARGIN_S = 60
# A process-directed SIGINT / SIGTERM may land on any thread that does not block it (JAX's,
# the connecting one); Python then only notes it, and runs the handler when the main thread
# next runs Python code. The main thread's wait returns this often so that it does.
_SIGNAL_CHECK_S = 0.25


@dataclasses.dataclass(frozen=True)
class Launch:
    """How a command starts: one process (neither set), explicitly (`coordinator` with
    `num_processes` and `process_id`) or by JAX's cluster detection (`auto`)."""
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False
    init_timeout_s: float = DEFAULT_INIT_TIMEOUT_S

    @property
    def multi_process(self) -> bool:
        return bool(self.coordinator) or self.auto


def _env_number(name: str, parse: type, what: str):
    """The environment variable `name` parsed by `parse` (int or float); None when unset."""
    value = os.environ.get(name)
    if not value:
        return None
    try:
        return parse(value)
    except ValueError:
        raise DistributedError(f"${name}={value!r} is not {what}") from None


def resolve_launch(coordinator: str | None = None, num_processes: int | None = None,
                   process_id: int | None = None, auto: bool = False,
                   init_timeout_s: float | None = None, *, flags: bool = False) -> Launch:
    """The launch the settings ask for, checked before anything starts; unset values come
    from JAXSIM_COORDINATOR, JAXSIM_NUM_PROCESSES, JAXSIM_PROCESS_ID, JAXSIM_INIT_TIMEOUT.

    `flags`: the values are the command-line flags (messages name `--coordinator`, ...).

    Raises:
      DistributedError: settings that contradict each other or that would be ignored (a
        process count without a coordinator, a coordinator with `auto`, ...), naming them.
    """
    def name(setting: str) -> str:
        return f'--{setting}' if flags else setting

    values = dict(coordinator=coordinator, num_processes=num_processes, process_id=process_id)
    given = [n for n, v in values.items() if v is not None]
    if auto and given:
        raise DistributedError(
            f"{name('distributed')} auto detects the cluster itself; drop "
            f"{', '.join(name(n) for n in given)} (or drop --distributed auto)")
    if init_timeout_s is not None and not (coordinator or auto
                                           or os.environ.get('JAXSIM_COORDINATOR')):
        raise DistributedError(f"{name('init_timeout')} applies to a multi-process launch "
                               f"only: add --coordinator HOST:PORT (with --num_processes and "
                               f"--process_id) or --distributed auto")
    sources = {n: name(n) for n in values}
    for n, parse in (('coordinator', str), ('num_processes', int), ('process_id', int)):
        var = f'JAXSIM_{n.upper()}'
        if not auto and values[n] is None and os.environ.get(var):
            values[n], sources[n] = _env_number(var, parse, 'an integer'), f'${var}'
    coordinator, num_processes, process_id = (values[n] for n in (
        'coordinator', 'num_processes', 'process_id'))
    where = name('init_timeout') if init_timeout_s is not None else '$JAXSIM_INIT_TIMEOUT'
    if init_timeout_s is None:
        init_timeout_s = _env_number('JAXSIM_INIT_TIMEOUT', float, 'a number of seconds')
    if init_timeout_s is None:
        init_timeout_s = DEFAULT_INIT_TIMEOUT_S
    elif not 0 < init_timeout_s < 10 ** 6:
        raise DistributedError(f'{where} must be a positive number of seconds (below '
                               f'1000000), got {init_timeout_s:g}')
    if auto:
        return Launch(auto=True, init_timeout_s=init_timeout_s)
    if not coordinator:
        stray = [sources[n] for n in ('num_processes', 'process_id') if values[n] is not None]
        if stray:
            raise DistributedError(f"{' and '.join(stray)} need{'s' * (len(stray) == 1)} "
                                   f"{name('coordinator')} "
                                   f"HOST:PORT (process 0's host and a free port) to start "
                                   f"several processes; without it the run is one process")
        return Launch(init_timeout_s=init_timeout_s)
    host, _, port = coordinator.rpartition(':')
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(f"{sources['coordinator']} {coordinator!r} is not HOST:PORT "
                               f"(process 0's host and a port in [1, 65535])")
    missing = [sources[n] for n in ('num_processes', 'process_id') if values[n] is None]
    if missing:
        raise DistributedError(f"{sources['coordinator']} needs {' and '.join(missing)} too "
                               f"(or JAXSIM_NUM_PROCESSES / JAXSIM_PROCESS_ID)")
    if num_processes < 1:
        raise DistributedError(f"{sources['num_processes']} must be at least 1, got "
                               f"{num_processes}")
    if not 0 <= process_id < num_processes:
        raise DistributedError(f"{sources['process_id']} {process_id} is not in "
                               f"[0, {num_processes}) ({sources['num_processes']} "
                               f"{num_processes})")
    return Launch(coordinator, num_processes, process_id, init_timeout_s=init_timeout_s)


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids=None, auto: bool = False,
               init_timeout_s: float | None = None) -> bool:
    """Initializes jax.distributed once; returns True when running multi-process.

    Must be called before any JAX computation. Arguments default to the JAXSIM_* env vars
    (`resolve_launch`). Waits at most `init_timeout_s` for every process to connect.

    Raises:
      DistributedError: inconsistent settings, no cluster detected (`auto`), or a process
        that did not connect within the wait.
    """
    if _initialized:
        return jax.process_count() > 1
    return start(resolve_launch(coordinator_address, num_processes, process_id, auto,
                                init_timeout_s), local_device_ids)


def start(launch: Launch, local_device_ids=None) -> bool:
    """Starts `launch` (once); True when running multi-process. See `initialize`."""
    global _initialized
    if _initialized or not launch.multi_process:
        return jax.process_count() > 1
    # Cross-process collectives of CPU devices go through gloo (harmless on accelerators).
    # Set before the backend exists: querying the backend here would initialize it.
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    jax_timeout = int(math.ceil(launch.init_timeout_s)) + _JAX_TIMEOUT_MARGIN_S
    if launch.auto:
        what, given = 'the processes of the cluster JAX detects', {}
    else:
        what = (f'the {launch.num_processes} processes of the run at {launch.coordinator} '
                f'(this is process {launch.process_id})')
        given = dict(coordinator_address=launch.coordinator, num_processes=launch.num_processes,
                     process_id=launch.process_id, local_device_ids=local_device_ids)
    connect = functools.partial(jax.distributed.initialize, initialization_timeout=jax_timeout,
                                **given)
    if launch.process_id == 0:
        _check_port_free(launch.coordinator)
    try:
        _wait_for(connect, launch.init_timeout_s, what)
    except TimeoutError:
        where = ('the cluster JAX detected' if launch.auto else
                 f'the coordinator {launch.coordinator}')
        start_all = ('start every process of the run' if launch.auto else
                     f'start all {launch.num_processes} processes with the same --coordinator')
        raise DistributedError(
            f'not every process connected to {where} within {launch.init_timeout_s:g} s; '
            f'{start_all}, or wait longer with --init_timeout SECONDS') from None
    except (RuntimeError, ValueError) as e:
        if not launch.auto:  # e.g. the coordinator's port taken on process 0's host
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise DistributedError(f'cannot start the run at the coordinator '
                                   f'{launch.coordinator}: {first}') from None
        raise DistributedError(f'--distributed auto: no cluster detected ({e}); start on a '
                               f'TPU pod, under SLURM or Open MPI, or pass --coordinator, '
                               f'--num_processes and --process_id') from None
    _initialized = True
    return jax.process_count() > 1


def _check_port_free(coordinator: str) -> None:
    """Process 0 serves the coordinator on every address of its host at the coordinator's
    port; a port another program listens on crashes JAX's service (a segmentation fault), so
    it is refused first. A port held the way gRPC servers hold theirs (SO_REUSEPORT, by the
    same user) is shared, as the service will share it."""
    port = int(coordinator.rpartition(':')[2])
    for family, address in ((socket.AF_INET6, '::'), (socket.AF_INET, '0.0.0.0')):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this host: the IPv4 wildcard then
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            try:
                probe.bind((address, port))
            except OSError as e:
                raise DistributedError(f'cannot serve the coordinator {coordinator} on this '
                                       f'host (process 0): port {port}: {e.strerror}; pick a '
                                       f'free port for --coordinator') from None
        return


def _wait_for(connect: Callable[[], Any], timeout_s: float, what: str) -> None:
    """Runs `connect` (jax.distributed.initialize: it blocks in native code, where neither a
    signal handler nor a timeout of ours could run) in a worker thread while this thread
    waits for it, in short slices, so that SIGINT / SIGTERM stop the wait at once (the
    handlers raise here) whichever thread the signal landed on, and the wait ends after
    `timeout_s` (TimeoutError). The abandoned connection is left to the process's exit
    (`_abandon`). Re-raises what `connect` raised."""
    done, failure = threading.Event(), []

    def run():
        try:
            connect()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            failure.append(e)
        finally:
            done.set()

    threading.Thread(target=run, name='jaxsim-distributed-connect', daemon=True).start()
    try:
        # One line on stderr: the wait is visible (a supervisor can tell it is under way).
        print(f'waiting up to {timeout_s:g} s for {what} to connect', file=sys.stderr,
              flush=True)
        deadline = time.monotonic() + timeout_s
        while not done.is_set() and (left := deadline - time.monotonic()) > 0:
            done.wait(min(left, _SIGNAL_CHECK_S))
    except BaseException:
        _abandon()
        raise
    if not done.is_set():
        _abandon()
        raise TimeoutError(what)
    if failure:
        raise failure[0]


def _abandon() -> None:
    """A connection given up on: at exit, JAX shuts its coordination service down, which logs
    several lines about the processes that never came; the command has already said why it
    stops in one line, so the process's stderr goes to /dev/null from then on. (Registered
    after JAX's own exit handler, so it runs first.)"""
    def silence():
        sys.stderr.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)

    atexit.register(silence)
    # JAX's shutdown of a coordination service whose peers never came can hang the exit.
    runtime.leave_hard_at_exit('a distributed connection was given up on')


def add_launch_flags(parser) -> None:
    """The multi-process launch flags every command takes (train.py, eval.py, encode)."""
    parser.add_argument('--coordinator', default=None,
                        help='jax.distributed coordinator host:port (multi-process launch)')
    parser.add_argument('--num_processes', type=int, default=None)
    parser.add_argument('--process_id', type=int, default=None)
    parser.add_argument('--distributed', choices=('auto',), default=None,
                        help="'auto': jax.distributed.initialize() detects the cluster (TPU pod "
                             'slice, SLURM, Open MPI); start the same command on every host')
    parser.add_argument('--init_timeout', type=float, default=None, metavar='SECONDS',
                        help='how long a multi-process launch waits for every process to '
                             f'connect before it stops with an error (default: '
                             f'$JAXSIM_INIT_TIMEOUT or {DEFAULT_INIT_TIMEOUT_S:g})')


def initialize_from_flags(args) -> bool:
    """`initialize` with the flags of `add_launch_flags`, checked first (contradictory or
    ignored flags are refused in one line); True when multi-process."""
    if _initialized:
        return jax.process_count() > 1
    return start(resolve_launch(args.coordinator, args.num_processes, args.process_id,
                                args.distributed == 'auto', args.init_timeout, flags=True))


def is_main_process() -> bool:
    """Process 0 writes logs, metrics and the summary (orbax coordinates its own writes)."""
    return jax.process_index() == 0


def max_over_processes(value: int) -> int:
    """The largest of every process's `value` (a collective: every process must call it)."""
    if jax.process_count() == 1:
        return int(value)
    return int(np.max(multihost_utils.process_allgather(np.asarray(value, np.int64))))


def _digest_words(value: Any) -> np.ndarray:
    """8 uint32 words of sha256 over the canonical JSON of `value` (strings hash as such)."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint32)


def check_same_inputs(inputs: Mapping[str, Any]) -> None:
    """Refuses to start when the processes of a run do not see the same inputs.

    Every process passes the same names (e.g. {'config': ..., 'corpus': digest}); each value
    is hashed and the hashes are all-gathered. A collective: every process must call it.

    Raises:
      DistributedError: naming the first input and the processes whose value differs from
        process 0's.
    """
    if jax.process_count() == 1:
        return
    names = sorted(inputs)
    local = np.stack([_digest_words(inputs[n]) for n in names])  # [inputs, 8]
    everyone = np.asarray(multihost_utils.process_allgather(local))  # [processes, inputs, 8]
    for i, name in enumerate(names):
        differ = np.flatnonzero((everyone[:, i] != everyone[0, i]).any(axis=1))
        if differ.size:
            which = ', '.join(map(str, differ))
            raise DistributedError(f'process {which} of {everyone.shape[0]} sees a different '
                                   f'{name} than process 0; every process must start the same '
                                   f'run on the same data')
