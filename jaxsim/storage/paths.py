"""Naming paths: local, or a URL of a scheme epath serves (gs://, s3://, ...), and where the
shipped data lives (`SENTEVAL_ROOT`: `../shared/data/senteval` beside the repository, or
$JAXSIM_SENTEVAL).

`as_path` is how every path given to jaxsim becomes an `etils.epath.Path` (what orbax uses):
an empty one is refused, and a remote scheme whose fsspec backend is not installed is named in
one line.
"""
from __future__ import annotations

import importlib
import logging
import os
import pathlib
from typing import Union

from etils import epath

from jaxsim.errors import JaxsimError

PathLike = Union[str, os.PathLike]
Path = epath.Path

# parents[2] is the repository root (this file is jaxsim/storage/paths.py); shared/ sits
# beside the repository.
SENTEVAL_ROOT = pathlib.Path(
    os.environ.get("JAXSIM_SENTEVAL")
    or pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "data" / "senteval")

# The fsspec implementation each remote scheme needs (epath's own message is a stack trace).
_SCHEME_PACKAGES = {"gs": "gcsfs", "s3": "s3fs", "az": "adlfs", "abfs": "adlfs"}


class StorageError(JaxsimError):
    """A path that cannot be used: empty, unreachable scheme, not writable."""


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
