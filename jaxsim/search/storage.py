"""The on-disk form of a search index: one folder, three files.

  vectors.npy      float32 [count, dim] (already unit-norm when the index normalizes)
  sentences.jsonl  one JSON string a line (sentences may hold newlines); absent for an index
                   of bare vectors
  ann.faiss        the approximate structure (faiss) of an index built with method ivf/hnsw
  index.json       format, version, count, dim, normalize, has_sentences, model, pooler, probe,
                   method, ann (options; absent: an exact index),
                   sha256 (of the rows of vectors.npy and of sentences.jsonl, in order)

The folder is swapped in whole (`jaxsim.storage.store.replace_dir`); the checksum is verified
on load, so rows reordered or edited after the save are refused, not searched.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

from jaxsim.search.ann import METHODS
from jaxsim.search.vectors import SearchError, as_matrix
from jaxsim.storage import store

FORMAT = "jaxsim-search-index"
VERSION = 1
INDEX_FILE, VECTORS_FILE, SENTENCES_FILE = "index.json", "vectors.npy", "sentences.jsonl"
ANN_FILE = "ann.faiss"


class IndexFileError(SearchError):
    """A saved index that cannot be read; the message names the file (and line)."""


def rows_checksum(vectors: np.ndarray, sentence_lines: Optional[bytes]) -> str:
    """sha256 of the float32 rows (in order) and of the sentences file's bytes."""
    digest = hashlib.sha256()
    rows = np.ascontiguousarray(vectors, np.float32)
    digest.update(f"{rows.shape[0]}x{rows.shape[1] if rows.ndim == 2 else 0}\n".encode())
    digest.update(memoryview(rows.reshape(-1)).cast("B"))
    if sentence_lines is not None:
        digest.update(sentence_lines)
    return digest.hexdigest()


def check_replaceable_index(folder) -> None:
    """An existing folder that --overwrite may replace: a previous index, nothing else."""
    if any(True for _ in folder.iterdir()) and not (folder / INDEX_FILE).exists():
        raise IndexFileError(f"{folder} is not empty and holds no {INDEX_FILE}: not a previous "
                             f"index, so it is not replaced even with overwrite")


def write_index(folder: Union[str, os.PathLike], meta: dict, vectors: np.ndarray,
                sentences: Optional[Sequence[str]], overwrite: bool = False,
                what: str = "index folder", ann: Optional[bytes] = None) -> Path:
    """Writes the files; `meta` holds every index.json field but format, version, sha256.
    `what` names the folder in messages (e.g. '--out'); `ann`: the faiss structure, if any."""
    vectors = np.ascontiguousarray(vectors, np.float32)
    lines = None if sentences is None else "".join(
        json.dumps(s, ensure_ascii=False) + "\n" for s in sentences).encode("utf-8")
    meta = {"format": FORMAT, "version": VERSION, **meta,
            "sha256": rows_checksum(vectors, lines)}
    with store.replace_dir(folder, overwrite, what, keep=check_replaceable_index) as tmp:
        with (tmp / VECTORS_FILE).open("wb") as f:  # through epath: the folder may be gs://
            np.save(f, vectors)
        if lines is not None:
            (tmp / SENTENCES_FILE).write_bytes(lines)
        if ann is not None:
            (tmp / ANN_FILE).write_bytes(ann)
        store.write_json(tmp / INDEX_FILE, meta)
    return Path(folder)


def read_index(folder: Union[str, os.PathLike]
               ) -> tuple[dict, np.ndarray, Optional[list[str]]]:
    """(index.json fields, vectors [count, dim] (memory-mapped), sentences or None), checked.

    Raises:
      IndexFileError: a missing or inconsistent file, named with the line at fault.
    """
    folder = Path(folder)
    meta = _read_meta(folder)
    vectors = _read_vectors(folder / VECTORS_FILE, meta["count"], meta["dim"])
    sentences = (_read_sentences(folder / SENTENCES_FILE, meta["count"])
                 if meta["has_sentences"] else None)
    lines = (folder / SENTENCES_FILE).read_bytes() if meta["has_sentences"] else None
    if meta.get("sha256") is not None and rows_checksum(vectors, lines) != meta["sha256"]:
        changed = f"{VECTORS_FILE} or {SENTENCES_FILE}" if lines is not None else VECTORS_FILE
        raise IndexFileError(f"{folder}: {changed} changed since the index was saved (rows "
                             f"reordered, replaced or edited: checksum mismatch); rebuild it "
                             f"with `python -m jaxsim index`")
    return meta, vectors, sentences


def read_ann(folder: Union[str, os.PathLike]) -> Optional[bytes]:
    """The saved approximate structure, or None when the folder has none."""
    path = Path(folder) / ANN_FILE
    return path.read_bytes() if path.is_file() else None


def _read_meta(folder: Path) -> dict:
    path = folder / INDEX_FILE
    if not path.is_file():
        raise IndexFileError(f"{folder}: not a search index (no {INDEX_FILE}; build one with "
                             f"`python -m jaxsim index`)")
    meta = store.read_json(path, IndexFileError, expect=None)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise IndexFileError(f"{path}: not a {FORMAT} file")
    if meta.get("version") != VERSION:
        raise IndexFileError(f"{path}: format version {meta.get('version')!r}, this jaxsim "
                             f"reads version {VERSION}")
    expected = {"count": int, "dim": int, "normalize": bool, "has_sentences": bool,
                "model": (str, type(None)), "pooler": (str, type(None)),
                "probe": (list, type(None))}
    for key, kind in expected.items():
        value = meta.get(key, KeyError)
        if value is KeyError or not isinstance(value, kind) or (
                kind is int and (isinstance(value, bool) or value < 0)):
            raise IndexFileError(f"{path}: field {key!r} is missing or invalid: {value!r:.60}")
    meta.setdefault("method", "exact")  # written before approximate indexes existed
    meta.setdefault("ann", None)
    if meta["method"] not in METHODS or not isinstance(meta["ann"], (dict, type(None))):
        raise IndexFileError(f"{path}: field 'method' must be one of {', '.join(METHODS)} and "
                             f"'ann' an object or null; got {meta['method']!r}, "
                             f"{meta['ann']!r:.40}")
    if meta["dim"] < 1:
        raise IndexFileError(f"{path}: field 'dim' must be positive, got {meta['dim']}")
    # json reads NaN / Infinity; a non-finite probe would make every model check pass.
    if meta["probe"] is not None and (len(meta["probe"]) != meta["dim"] or not all(
            isinstance(x, (int, float)) and math.isfinite(x) for x in meta["probe"])):
        raise IndexFileError(f"{path}: field 'probe' must hold {meta['dim']} finite numbers")
    return meta


def _read_vectors(path: Path, count: int, dim: int) -> np.ndarray:
    try:
        vectors = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise IndexFileError(f"{path}: missing") from None
    except (ValueError, OSError) as e:
        raise IndexFileError(f"{path}: unreadable .npy file ({e})") from None
    if vectors.shape != (count, dim) or vectors.dtype != np.float32:
        raise IndexFileError(f"{path}: holds {vectors.dtype} {tuple(vectors.shape)}, but "
                             f"{INDEX_FILE} says float32 ({count}, {dim})")
    try:
        as_matrix(vectors, str(path))
    except SearchError as e:
        raise IndexFileError(str(e)) from None
    return vectors


def _read_sentences(path: Path, count: int) -> list[str]:
    sentences = []
    try:
        with path.open("r", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                try:
                    s = json.loads(line)
                except json.JSONDecodeError as e:
                    raise IndexFileError(f"{path}:{lineno}: not a JSON string ({e.msg})") from None
                if not isinstance(s, str):
                    raise IndexFileError(f"{path}:{lineno}: not a JSON string: {line:.60}")
                sentences.append(s)
    except FileNotFoundError:
        raise IndexFileError(f"{path}: missing") from None
    except UnicodeDecodeError:
        raise IndexFileError(f"{path}: not UTF-8 text") from None
    except OSError as e:  # a folder in its place, no permission
        raise IndexFileError(f"{path}: unreadable ({e.strerror or e})") from None
    if len(sentences) != count:
        raise IndexFileError(f"{path}: {len(sentences)} sentences, but {INDEX_FILE} says {count}")
    return sentences
