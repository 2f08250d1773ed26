"""Line-offset indexes of text files: built once, cached, reused while the file is unchanged.

A corpus is read at random through an [N, 2] uint64 array of the (start, end) byte offsets of
its records (its non-blank lines), so a process reads only the lines it trains on and start-up
costs the same for a thousand lines as for a hundred million. Building the index is one
streaming pass over the file that also validates it as `readers.read_text` does (UTF-8, no NUL
byte, no overlong line; errors name file:line) and hashes its content (the data digest).

The index lives beside the file (`NAME.<kind>-index.npy` + `.json`), or under the index cache
folder ($JAXSIM_INDEX_DIR, else ~/.cache/jaxsim/index) when the file's folder is not
writable. It is reused while the file's size, modification time and a hash of its first and
last 64 KiB are unchanged, and rebuilt otherwise.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from jaxsim.data.readers import MAX_LINE_CHARS, DataError, PathLike
from jaxsim.io import store

log = logging.getLogger(__name__)

INDEX_VERSION = 1
CHUNK_BYTES = 1 << 22  # scanned at a time: the per-chunk numpy work stays ~100 MB
EDGE_BYTES = 1 << 16
_BOM = b'\xef\xbb\xbf'
# Bytes that str.isspace() holds for (str.strip() removes them): \t \n \v \f \r, \x1c-\x1f,
# space. Other whitespace is non-ASCII (U+00A0, U+2028, ...), checked by decoding the line.
_ASCII_SPACE = np.zeros(256, bool)
_ASCII_SPACE[[9, 10, 11, 12, 13, 28, 29, 30, 31, 32]] = True
# A validator of records: (texts, 1-based line numbers) -> None, raising DataError.
Check = Callable[[Sequence[str], np.ndarray], None]


def index_dir() -> Path:
    """The index cache folder for files whose own folder is not writable."""
    return Path(os.environ.get('JAXSIM_INDEX_DIR')
                or Path.home() / '.cache' / 'jaxsim' / 'index')


@dataclasses.dataclass(frozen=True)
class FileKey:
    """What identifies a file's version cheaply: size, mtime and a hash of its edges."""

    size: int
    mtime_ns: int
    edges: str

    @classmethod
    def of(cls, path: Path) -> 'FileKey':
        st = path.stat()
        h = hashlib.sha256()
        with path.open('rb') as f:
            h.update(f.read(EDGE_BYTES))
            if st.st_size > EDGE_BYTES:
                f.seek(max(EDGE_BYTES, st.st_size - EDGE_BYTES))
                h.update(f.read(EDGE_BYTES))
        return cls(st.st_size, st.st_mtime_ns, h.hexdigest()[:32])


@dataclasses.dataclass
class LineIndex:
    """The records of one text file and how to read them.

    Attributes:
      path: the file.
      offsets: [records, 2] uint64 (start, end) byte offsets (a read-only memory map).
      sha256: 'sha256:<hex>' of the file's bytes.
      size: the file's size in bytes.
      lines: physical lines in the file.
      build_s: seconds spent building the index now (0.0 when a cached one was reused).
    """

    path: Path
    offsets: np.ndarray
    sha256: str
    size: int
    lines: int
    build_s: float = 0.0

    def __len__(self) -> int:
        return len(self.offsets)

    def raw(self, fd: int, i: int) -> str:
        """Record i's line as text (not stripped), read with `os.pread` from `fd`."""
        start, end = (int(x) for x in self.offsets[i])
        return os.pread(fd, end - start, start).decode('utf-8')

    def line_number(self, i: int) -> int:
        """Record i's 1-based line in the file (counts line breaks: meant for messages)."""
        start, seen = int(self.offsets[i][0]), 0
        with self.path.open('rb') as f:
            while start > 0:
                block = f.read(min(CHUNK_BYTES, start))
                seen, start = seen + block.count(b'\n'), start - len(block)
        return seen + 1


def load_or_build(path: PathLike, kind: str = 'text', check: Optional[Check] = None,
                  what: str = 'file') -> LineIndex:
    """The index of `path`, from the cache when the file is unchanged, else built and cached.

    Args:
      path: a local text file.
      kind: 'text' (records are the lines that are not blank after stripping whitespace) or
        'csv' (records are the non-empty lines, '\\r' aside).
      check: validates every record when the index is built (e.g. CSV columns).
      what: what the file is, for messages.

    Raises:
      DataError: naming the file (and line): missing, unreadable, not UTF-8, NUL byte, an
        overlong line, what `check` refuses.
    """
    path = Path(path)
    if path.is_dir():
        raise DataError(f'{path}: is a directory, not a {what}')
    try:
        key = FileKey.of(path)
    except FileNotFoundError:
        raise DataError(f'{path}: {what} not found') from None
    except OSError as e:
        raise DataError(f'{path}: cannot read {what}: {e.strerror or e}') from None
    for stem in _candidates(path, kind):
        found = _load(stem, path, kind, key)
        if found is not None:
            return found
    t0 = time.perf_counter()
    offsets, sha, lines = _scan(path, kind, check)
    build_s = time.perf_counter() - t0
    meta = {'version': INDEX_VERSION, 'kind': kind, 'size': key.size, 'mtime_ns': key.mtime_ns,
            'edges': key.edges, 'sha256': sha, 'records': len(offsets), 'lines': lines,
            'build_s': round(build_s, 3)}
    for stem in _candidates(path, kind):
        if _save(stem, offsets, meta):
            log.info('%s: indexed %d records in %.1f s (%s)', path, len(offsets), build_s, stem)
            found = _load(stem, path, kind, key)
            if found is not None:
                return dataclasses.replace(found, build_s=build_s)
    log.warning('%s: could not cache its line index (read-only folders); kept in memory', path)
    return LineIndex(path, offsets, sha, key.size, lines, build_s)


def _candidates(path: Path, kind: str) -> list[Path]:
    """Where the index may live: beside the file, then in the cache folder."""
    name = f'{path.name}.{kind}-index'
    tag = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    return [path.parent / name, index_dir() / f'{tag}-{name}']


def _load(stem: Path, path: Path, kind: str, key: FileKey) -> Optional[LineIndex]:
    meta_path, array_path = stem.with_name(stem.name + '.json'), stem.with_name(stem.name + '.npy')
    try:
        meta = json.loads(meta_path.read_text())
        if (meta.get('version'), meta.get('kind'), meta.get('size'), meta.get('mtime_ns'),
                meta.get('edges')) != (INDEX_VERSION, kind, key.size, key.mtime_ns, key.edges):
            return None
        offsets = np.load(array_path, mmap_mode='r')
    except (OSError, ValueError):
        return None
    if offsets.shape != (meta['records'], 2) or offsets.dtype != np.uint64:
        return None
    return LineIndex(path, offsets, meta['sha256'], key.size, meta['lines'])


def _save(stem: Path, offsets: np.ndarray, meta: dict) -> bool:
    """Writes the offsets, then the metadata that validates them; False where not writable."""
    try:
        # Atomic writes: every process of a run may build at once, and a crash mid-write
        # never leaves a half-written index (the metadata, written last, validates it).
        with store.open_atomic(stem.with_name(stem.name + '.npy'), 'wb') as f:
            np.save(f, offsets)
        store.write_json(stem.with_name(stem.name + '.json'), meta)
        return True
    except (OSError, store.StorageError):
        return False


# ---------------------------------------------------------------------------------------------
# The scan.
# ---------------------------------------------------------------------------------------------

def _scan(path: Path, kind: str, check: Optional[Check]) -> tuple[np.ndarray, str, int]:
    """One pass: validated (start, end) offsets of the records, content sha256, line count."""
    h, parts, lines_before, pos, carry = hashlib.sha256(), [], 0, 0, b''
    with path.open('rb') as f:
        first = True
        while True:
            block = f.read(CHUNK_BYTES)
            h.update(block)
            data, eof = carry + block, not block
            if first and data.startswith(_BOM):
                data, pos = data[len(_BOM):], len(_BOM)
            first = False
            cut = len(data) if eof else data.rfind(b'\n') + 1
            if cut == 0 and not eof:  # no line break in the carried bytes: one very long line
                if len(data) > 4 * MAX_LINE_CHARS:
                    raise DataError(f'{path}:{lines_before + 1}: line of more than '
                                    f'{MAX_LINE_CHARS} characters exceeds the limit (missing '
                                    f'line breaks?)')
                carry = data
                continue
            chunk, carry = data[:cut], data[cut:]
            if chunk:
                starts, ends, linenos = _chunk_records(path, chunk, kind, lines_before, pos)
                if check is not None and len(starts):
                    check([chunk[s:e].decode('utf-8') for s, e in zip(starts, ends)], linenos)
                parts.append(np.stack([starts + pos, ends + pos], 1).astype(np.uint64))
                lines_before += chunk.count(b'\n') + (0 if chunk.endswith(b'\n') else 1)
                pos += len(chunk)
            if eof:
                break
    offsets = np.concatenate(parts) if parts else np.zeros((0, 2), np.uint64)
    return offsets, 'sha256:' + h.hexdigest(), lines_before


def _chunk_records(path: Path, chunk: bytes, kind: str, lines_before: int, pos: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validates a chunk of whole lines; (start, end, line number) of its records."""
    nul = chunk.find(b'\x00')
    if nul >= 0:
        line = lines_before + chunk.count(b'\n', 0, nul) + 1
        raise DataError(f'{path}:{line}: NUL byte (a binary file, not text)')
    try:
        chunk.decode('utf-8')
    except UnicodeDecodeError as e:
        line = lines_before + chunk.count(b'\n', 0, e.start) + 1
        raise DataError(f'{path}:{line}: not valid UTF-8 ({e.reason} at byte {pos + e.start})'
                        ) from None
    buf = np.frombuffer(chunk, np.uint8)
    breaks = np.flatnonzero(buf == 10)
    starts = np.concatenate([[0], breaks + 1])
    ends = np.concatenate([breaks, [len(buf)]])
    if ends[-1] == starts[-1]:  # the chunk ends with a line break: no line after it
        starts, ends = starts[:-1], ends[:-1]
    linenos = lines_before + 1 + np.arange(len(starts))
    for i in np.flatnonzero(ends - starts > MAX_LINE_CHARS):  # bytes >= characters
        n = len(chunk[starts[i]:ends[i]].decode('utf-8'))
        if n > MAX_LINE_CHARS:
            raise DataError(f'{path}:{linenos[i]}: line of {n} characters exceeds the '
                            f'{MAX_LINE_CHARS} limit (missing line breaks?)')
    if kind == 'csv':
        length = ends - starts
        cr = np.zeros(len(starts), bool)
        cr[length > 0] = buf[ends[length > 0] - 1] == 13
        keep = length - cr > 0
    else:
        keep = _non_blank(chunk, buf, starts, ends)
    return starts[keep], ends[keep], linenos[keep]


def _non_blank(chunk: bytes, buf: np.ndarray, starts: np.ndarray, ends: np.ndarray
               ) -> np.ndarray:
    """Which lines hold something besides whitespace (str.strip's whitespace)."""
    filled = ends > starts
    first = np.zeros(len(starts), np.uint8)
    first[filled] = buf[starts[filled]]
    # Most lines start with a visible ASCII character; the rest are decoded and stripped.
    keep = filled & ~_ASCII_SPACE[first] & (first < 128)
    for i in np.flatnonzero(filled & ~keep):
        keep[i] = bool(chunk[starts[i]:ends[i]].decode('utf-8').strip())
    return keep
