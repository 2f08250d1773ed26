"""The train workdir's lock: one run at a time writes a workdir (`WorkdirLock`), held for all
processes of a run by its process 0 (`hold_workdir`)."""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
from typing import Iterator, Optional

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxsim.storage.paths import PathLike, StorageError, as_path, is_remote

LOCK_FILE = ".lock"


class WorkdirLockedError(StorageError):
    """A workdir that another live run holds."""


def _start_time(pid: int) -> Optional[str]:
    """The kernel's start time of `pid` (Linux), so a reused pid is not taken for the holder."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _alive(holder: dict) -> bool:
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0 or not pid_alive(pid):
        return False
    started = holder.get("proc_start")
    return started is None or _start_time(pid) in (None, started)


class WorkdirLock:
    """Holds WORKDIR/.lock while a run writes the workdir.

    Locally the lock is the kernel's (`flock` on the file): it cannot be held twice, and dies
    with its process, so a killed run never leaves a lock behind; the file only says who holds
    it (host, pid, since) and is emptied on release, so finding a previous holder's record
    under a free lock means that run died, which is reported. Object stores have no locks: there
    the file is created if absent, a holder on this host that is gone is taken over, and one
    from another host is refused with the file to remove.
    """

    def __init__(self, workdir: PathLike, say=None):
        self.workdir = as_path(workdir, "--workdir")
        self.path = self.workdir / LOCK_FILE
        self.say = say or (lambda message: None)
        self.record = {"host": socket.gethostname(), "pid": os.getpid(),
                       "proc_start": _start_time(os.getpid()),
                       "since": datetime.datetime.now(datetime.timezone.utc).isoformat(
                           timespec="seconds")}
        self._fd: Optional[int] = None
        self.held = False

    def _refuse(self, holder: dict) -> None:
        where = (f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')}"
                 if holder else "another run")
        hint = ("stop that run first" if not holder or holder.get("host") == self.record["host"]
                else f"if that run is gone, remove {self.path}")
        raise WorkdirLockedError(f"--workdir {self.workdir} is in use by {where}; {hint}")

    def _taken_over(self, holder: dict) -> None:
        self.say(f"{self.workdir}: a run that is gone left its lock (pid {holder.get('pid')} "
                 f"on {holder.get('host')}, since {holder.get('since')}); taking it over")

    def _acquire_local(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            self._refuse(_parse_holder(self.path.read_text(encoding="utf-8")))
        previous = _parse_holder(os.pread(fd, 1 << 16, 0).decode("utf-8", "replace"))
        if previous:
            self._taken_over(previous)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(self.record) + "\n").encode("utf-8"), 0)
        os.fsync(fd)
        self._fd = fd

    def _acquire_remote(self) -> None:
        holder = _parse_holder(self.path.read_text(encoding="utf-8")) if self.path.exists() else {}
        if holder and (holder.get("host") != self.record["host"] or _alive(holder)):
            self._refuse(holder)
        if holder:
            self._taken_over(holder)
        self.path.write_text(json.dumps(self.record) + "\n", encoding="utf-8")
        written = _parse_holder(self.path.read_text(encoding="utf-8"))
        if written != self.record:  # another host wrote it at the same time
            self._refuse(written)

    def acquire(self) -> "WorkdirLock":
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self._acquire_remote if is_remote(self.workdir) else self._acquire_local)()
        self.held = True
        return self

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        if self._fd is not None:  # emptied, never unlinked: a waiter may have it open
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
        elif _parse_holder(self.path.read_text(encoding="utf-8")) == self.record:
            self.path.unlink()

    def __enter__(self) -> "WorkdirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


@contextlib.contextmanager
def hold_workdir(workdir: PathLike, main: bool, say) -> Iterator[None]:
    """Holds the workdir's lock (process 0) while the run writes; every process learns whether
    it was had, so a refused run stops on all processes at once, before anything is written."""
    lock, refusal = None, None
    if main:
        try:
            lock = WorkdirLock(workdir, say=say).acquire()
        except WorkdirLockedError as e:
            refusal = e
    if jax.process_count() > 1:
        held = bool(multihost_utils.broadcast_one_to_all(np.int32(refusal is None)))
        if not held and refusal is None:
            refusal = WorkdirLockedError(f"--workdir {workdir} is in use by another run")
    if refusal is not None:
        raise refusal
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def _parse_holder(text: str) -> dict:
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
