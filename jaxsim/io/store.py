"""The one storage layer: how jaxsim names, checks and writes every file it produces.

Paths are `etils.epath.Path` (what orbax uses): a local path, or a URL of a scheme epath serves
(`gs://`, `s3://`, ...) through its fsspec backend. The output rule every command follows:

  - an existing target is refused in one line unless the caller says `overwrite`
    (`refuse_existing`);
  - a file is written to a temporary sibling and renamed into place (`write_atomic`,
    `open_atomic`), a folder is built beside its target and swapped in (`replace_dir`), so an
    interrupted write leaves the old content or none, never half of it. Object stores have no
    rename, but a single object PUT is atomic already: remote files are written in one PUT;
  - a train workdir is held by one run at a time (`WorkdirLock`).
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import fcntl
import importlib
import io
import json
import logging
import os
import pathlib
import shutil
import signal
import socket
import tempfile
import threading
import uuid
from typing import IO, Iterator, Optional, Union

from etils import epath

from jaxsim.errors import JaxsimError

PathLike = Union[str, os.PathLike]
Path = epath.Path
LOCK_FILE = ".lock"

# The fsspec implementation each remote scheme needs (epath's own message is a stack trace).
_SCHEME_PACKAGES = {"gs": "gcsfs", "s3": "s3fs", "az": "adlfs", "abfs": "adlfs"}


class StorageError(JaxsimError):
    """A path that cannot be used: empty, unreachable scheme, not writable."""


class OutputExistsError(StorageError):
    """An output target that exists, and the caller did not ask to overwrite it."""


class WorkdirLockedError(StorageError):
    """A workdir that another live run holds."""


def scheme(path: PathLike) -> str:
    """'' for a local path, else the URL scheme ('gs', 's3', ...)."""
    text = os.fspath(path)
    return text.split("://", 1)[0] if "://" in text else ""


def is_remote(path: PathLike) -> bool:
    return bool(scheme(path))


def as_path(path: PathLike, what: str = "path") -> Path:
    """The epath of `path`; refuses an empty one (it would silently mean the current folder).

    Args:
      path: a local path or a URL (gs://bucket/run).
      what: how the user named it, for the message (e.g. '--workdir').
    """
    text = os.fspath(path) if path is not None else ""
    if not str(text).strip():
        raise StorageError(f"{what} is empty; give a folder or file name")
    if is_remote(text):
        _check_backend(text, what)
    return epath.Path(text)


def _check_backend(url: str, what: str) -> None:
    name = scheme(url)
    package = _SCHEME_PACKAGES.get(name)
    if package is None:
        return
    if name == "gs":
        # Without application credentials (e.g. a local server) gcsfs warns on every bucket
        # that it cannot tell the bucket's type; it falls back to the plain API, which we use.
        logging.getLogger("gcsfs").setLevel(logging.ERROR)
    try:
        importlib.import_module(package)
    except ImportError:
        raise StorageError(f"{what} {url}: the {name}:// scheme needs the '{package}' package "
                           f"(pip install {package})") from None


def check_reachable(path: PathLike, what: str = "path") -> Path:
    """Checks, before any expensive work, that `path`'s storage answers; returns its epath.

    A remote URL's bucket must be listable; a local path's nearest existing parent must be a
    writable folder. One line naming the path otherwise.
    """
    p = as_path(path, what)
    if is_remote(p):
        return _check_bucket(p, what)
    probe = p
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise StorageError(f"{what} {p}: {probe} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise StorageError(f"{what} {p}: not writable ({probe} is read-only)")
    return p


def _check_bucket(p: Path, what: str) -> Path:
    bucket = epath.Path(f"{scheme(p)}://{os.fspath(p).split('://', 1)[1].split('/', 1)[0]}")
    try:
        found = bucket.exists()
        next(iter(bucket.iterdir()), None)
    except Exception as e:  # fsspec backends raise their own types (no common base)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StorageError(f"{what} {p}: storage not reachable ({first})") from None
    if not found:
        raise StorageError(f"{what} {p}: bucket {bucket} not found (or not accessible)")
    return p


def refuse_existing(path: PathLike, overwrite: bool, what: str = "output") -> Path:
    """Refuses an existing target unless `overwrite`; an empty folder counts as absent."""
    p = as_path(path, what)
    if p.exists() and not overwrite:
        if p.is_dir() and not any(True for _ in p.iterdir()):
            return p
        raise OutputExistsError(f"{what} {p} exists; pass --overwrite to replace it")
    return p


def _temp_sibling(p: Path, tag: str) -> Path:
    return p.parent / f".{p.name}.{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@contextlib.contextmanager
def open_atomic(path: PathLike, mode: str = "wb", overwrite: bool = True,
                what: str = "output") -> Iterator[IO]:
    """A file object whose content replaces `path` only when the block ends without error."""
    if mode not in ("w", "wb"):
        raise ValueError(f"open_atomic writes ('w' or 'wb'), got mode {mode!r}")
    p = refuse_existing(path, overwrite, what)
    if is_remote(p):
        buffer = io.BytesIO() if mode == "wb" else io.StringIO()
        yield buffer
        data = buffer.getvalue()
        p.parent.mkdir(parents=True, exist_ok=True)
        if mode == "wb":
            p.write_bytes(data)  # one PUT: readers see the old object or the new one
        else:
            p.write_text(data, encoding="utf-8")
        return
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_sibling(p, "tmp")
    try:
        with open(tmp, mode, **({} if mode == "wb" else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_atomic(path: PathLike, data: Union[bytes, str], overwrite: bool = True,
                 what: str = "output") -> Path:
    """Writes `data` (bytes, or str as UTF-8) to `path` atomically; returns the path."""
    with open_atomic(path, "wb" if isinstance(data, bytes) else "w", overwrite, what) as f:
        f.write(data)
    return as_path(path, what)


def write_json(path: PathLike, value, overwrite: bool = True, what: str = "output") -> Path:
    """Strict JSON (no NaN), indented, atomically."""
    return write_atomic(path, json.dumps(value, indent=1, allow_nan=False) + "\n", overwrite,
                        what)


@contextlib.contextmanager
def replace_dir(path: PathLike, overwrite: bool = False, what: str = "output",
                keep: Optional[callable] = None) -> Iterator[Path]:
    """Yields a fresh folder that becomes `path` when the block ends without error.

    Locally the folder is a temporary sibling, renamed into place (the old folder, if any, is
    moved aside first and deleted after), so an interrupt leaves the old folder or none.
    Remotely (no renames on object stores) the files are written into `path` itself.

    Args:
      keep: an optional check on the existing folder before it is replaced (raise to refuse).
    """
    p = refuse_existing(path, overwrite, what)
    if p.exists() and keep is not None:
        keep(p)
    if is_remote(p):
        if p.exists():
            p.rmtree()
        p.mkdir(parents=True, exist_ok=True)
        yield p
        return
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_sibling(p, "tmp")
    tmp.mkdir()
    os.chmod(tmp, 0o777 & ~_umask())  # the mode a plain mkdir would give the final folder
    old = None
    try:
        yield tmp
        with _signals_held():  # between the two renames an interrupt would lose both folders
            if p.exists():
                old = _temp_sibling(p, "old")
                os.replace(p, old)
            os.replace(tmp, p)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and old.exists():
            shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT/SIGTERM wait (in the kernel) until the block ends; main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ------------------------------------------------------------------------------ workdir lock
def _start_time(pid: int) -> Optional[str]:
    """The kernel's start time of `pid` (Linux), so a reused pid is not taken for the holder."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(holder: dict) -> bool:
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
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
        if self.path.exists():
            holder = _parse_holder(self.path.read_text(encoding="utf-8"))
            if holder and (holder.get("host") != self.record["host"] or _alive(holder)):
                self._refuse(holder)
            if holder:
                self._taken_over(holder)
        self.path.write_text(json.dumps(self.record) + "\n", encoding="utf-8")
        if _parse_holder(self.path.read_text(encoding="utf-8")) != self.record:
            self._refuse(_parse_holder(self.path.read_text(encoding="utf-8")))

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


def _parse_holder(text: str) -> dict:
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


# ------------------------------------------------------------------------------ reading
def local_copy(folder: PathLike, what: str = "folder") -> pathlib.Path:
    """A local folder with `folder`'s files: the folder itself when local, else a copy.

    Libraries that only read local files (tokenizers, safetensors) are given the copy; it lives
    in a temporary folder removed when the process exits.
    """
    p = as_path(folder, what)
    if not is_remote(p):
        return pathlib.Path(os.fspath(p))
    if not p.is_dir():
        raise StorageError(f"{what} {p}: no such folder")
    target = pathlib.Path(tempfile.mkdtemp(prefix="jaxsim-remote-"))
    atexit.register(shutil.rmtree, target, True)

    def copy(folder: Path, dest: pathlib.Path) -> None:  # level by level: GCS has no `**`
        for source in folder.iterdir():
            if source.is_dir():
                (dest / source.name).mkdir()
                copy(source, dest / source.name)
            else:
                (dest / source.name).write_bytes(source.read_bytes())

    copy(p, target)
    return target


def upload_dir(local: PathLike, remote: PathLike) -> None:
    """Copies a local folder's files into `remote` (which may be local too)."""
    local, remote = pathlib.Path(local), as_path(remote)
    for source in sorted(local.rglob("*")):
        if source.is_file():
            dest = remote / os.fspath(source.relative_to(local))
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(source.read_bytes())
