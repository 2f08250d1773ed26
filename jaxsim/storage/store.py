"""The one storage layer: how jaxsim names, checks and writes every file it produces.

The output rule every command follows (docs/storage.md): an existing target is refused unless
the caller says `overwrite` (`refuse_existing`); a file is written to a temporary sibling and
renamed into place (`write_atomic`, `open_atomic`), a folder built beside its target and swapped
in (`replace_dir`); remote files are written in one PUT, atomic already. Path naming
(`jaxsim.storage.paths`) and the workdir lock (`jaxsim.storage.lock`) are reachable here too.
"""
from __future__ import annotations

import atexit
import contextlib
import io
import json
import math
import os
import pathlib
import re
import shutil
import signal
import tempfile
import threading
import uuid
from typing import IO, Any, Iterator, Mapping, Optional, Union

from etils import epath

from jaxsim.storage.lock import LOCK_FILE, WorkdirLock, WorkdirLockedError, pid_alive
from jaxsim.storage.paths import Path, PathLike, StorageError, as_path, is_remote, scheme

__all__ = [  # the storage layer's names, wherever they are defined
    "LOCK_FILE", "OutputExistsError", "Path", "PathLike", "StorageError", "WorkdirLock",
    "WorkdirLockedError", "as_path", "check_reachable", "is_remote", "local_copy", "nan_to_null",
    "open_atomic", "read_json", "refuse_existing", "replace_dir", "scheme", "upload_dir",
    "write_atomic", "write_json"]


class OutputExistsError(StorageError):
    """An output target that exists, and the caller did not ask to overwrite it."""


def check_reachable(path: PathLike, what: str = "path") -> Path:
    """Checks, before any expensive work, that `path`'s storage answers; returns its epath.

    A remote URL's bucket must be listable; a local path's nearest existing parent must be a
    writable folder. One line naming the path otherwise.
    """
    p = as_path(path, what)
    if is_remote(p):
        return _check_bucket(p, what)
    probe = next((q for q in (p, *p.parents) if q.exists()), p)
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
    if p.exists() and not overwrite and (not p.is_dir() or any(p.iterdir())):
        raise OutputExistsError(f"{what} {p} exists; pass --overwrite to replace it")
    return p


def _temp_sibling(p: Path, tag: str) -> Path:
    return p.parent / f".{p.name}.{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _remove_stale_siblings(p: Path) -> None:
    """Removes what a killed writer of `p` (SIGKILL, power loss) left beside it: temporary
    siblings of a process that is gone. A moved-aside old folder goes only once `p` exists
    again (before that it may be the only copy)."""
    folder = os.fspath(p.parent)
    pattern = re.compile(rf"^\.{re.escape(p.name)}\.(tmp|old)-(\d+)-[0-9a-f]{{8}}$")
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        found = pattern.match(name)
        if not found or pid_alive(int(found.group(2))):
            continue
        if found.group(1) == "old" and not os.path.exists(os.fspath(p)):
            continue
        sibling = os.path.join(folder, name)
        if os.path.isdir(sibling) and not os.path.islink(sibling):
            shutil.rmtree(sibling, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(sibling)


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
        # one PUT: readers see the old object or the new one
        p.write_bytes(data if mode == "wb" else data.encode("utf-8"))
        return
    p.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_siblings(p)
    tmp = _temp_sibling(p, "tmp")
    try:
        with _naming_failed_writes(p, tmp, what):
            with open(tmp, mode, **({} if mode == "wb" else {"encoding": "utf-8"})) as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, p)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def _naming_failed_writes(target: Path, tmp: Path, what: str) -> Iterator[None]:
    """A write into `tmp` that fails (a full disk: '[Errno 28]', or numpy's '115200 requested
    and 42976 written') is reported under the target's name, which the temporary one is not.
    An error naming another file (an input read on the way) passes unchanged."""
    try:
        yield
    except OSError as e:
        named = getattr(e, "filename", None)
        if named is not None and not os.fspath(named).startswith(os.fspath(tmp)):
            raise
        reason = e.strerror or str(e)
        if e.errno is None and "written" in reason:
            reason = f"the disk took only part of it ({reason}): is it full?"
        raise StorageError(f"{what} {target}: cannot be written: {reason}; the earlier "
                           f"content, if any, is kept") from None


def write_atomic(path: PathLike, data: Union[bytes, str], overwrite: bool = True,
                 what: str = "output") -> Path:
    """Writes `data` (bytes, or str as UTF-8) to `path` atomically; returns the path."""
    with open_atomic(path, "wb" if isinstance(data, bytes) else "w", overwrite, what) as f:
        f.write(data)
    return as_path(path, what)


def nan_to_null(value: Any) -> Any:
    """Non-finite floats -> None, recursively (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: nan_to_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [nan_to_null(v) for v in value]
    return value


def write_json(path: PathLike, value, overwrite: bool = True, what: str = "output",
               indent: int = 1) -> Path:
    """Strict JSON (non-finite floats as null), indented, atomically."""
    text = json.dumps(nan_to_null(value), indent=indent, allow_nan=False) + "\n"
    return write_atomic(path, text, overwrite, what)


def read_json(path: PathLike, error: type = StorageError, what: str = "file",
              expect: Optional[type] = dict) -> Any:
    """The JSON value in `path`; a missing, malformed or non-UTF-8 file, or a value that is not
    an `expect`, raises `error` (the caller's error type) naming the file (and line)."""
    p = as_path(path, what)
    try:
        value = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{p}: {what} not found") from None
    except json.JSONDecodeError as e:
        raise error(f"{p}:{e.lineno}: malformed JSON: {e.msg}") from None
    except UnicodeDecodeError:
        raise error(f"{p}: not valid UTF-8") from None
    if expect is not None and not isinstance(value, expect):
        raise error(f"{p}: expected a JSON {'object' if expect is dict else expect.__name__}")
    return value


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
    _remove_stale_siblings(p)
    tmp = _temp_sibling(p, "tmp")
    tmp.mkdir()
    os.chmod(tmp, 0o777 & ~_umask())  # the mode a plain mkdir would give the final folder
    old = None
    try:
        with _naming_failed_writes(p, tmp, what):
            yield tmp
        with _signals_held():  # between the two renames an interrupt would lose both folders
            if p.exists():
                old = _temp_sibling(p, "old")
                os.replace(p, old)
            os.replace(tmp, p)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
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
