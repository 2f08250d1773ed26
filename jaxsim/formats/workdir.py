"""A train workdir is a model: what it holds, and loading it as a `SentenceModel`.

WORKDIR/
  model.json      the SentenceEncoder (architecture, pooler, mlp_only_train, token limit) and
                  a kept sentence-transformers head's modules (Dense weights: checkpoints)
  tokenizer/      the tokenizer files
  config.json     the train config
  checkpoints/    orbax checkpoints of the TrainState (params are the SentenceEncoder tree,
                  the head's Dense weights under 'st_head' and the objective's own parameters
                  under 'objective' when there are any)
The checkpoint's params are the very tree the encoder was trained with, so loading is a
restore: no translation step and no Hugging Face folder inside the workdir.
"""
from __future__ import annotations

import os
import tempfile
from typing import Mapping, Optional, Union

import jax
import numpy as np

from jaxsim.errors import JaxsimError
from jaxsim.formats.checkpoint import CHECKPOINT_DIR, Checkpointer
from jaxsim.formats.hf_folder import load_tokenizer
from jaxsim.model import SentenceModel
from jaxsim.models import st_head
from jaxsim.models.bert import BertConfig
from jaxsim.models.encoder import SentenceEncoder, check_params
from jaxsim.models.poolers import get_pooler
from jaxsim.objectives import owned
from jaxsim.storage import store

MODEL_FILE = "model.json"
TOKENIZER_DIR = "tokenizer"
CONFIG_FILE = "config.json"
_FORMAT = "jaxsim-sentence-encoder"


class WorkdirError(JaxsimError):
    """A train workdir that is incomplete or unreadable; the message names the file."""


def is_train_workdir(path: Union[str, os.PathLike]) -> bool:
    path = store.as_path(path)
    return (path / MODEL_FILE).is_file() and (path / CHECKPOINT_DIR).is_dir()


def model_record(model: SentenceModel, base_model: str = "") -> dict:
    """The content of model.json for `model`."""
    record = {"format": _FORMAT, "version": 1, "config": model.config.to_hf_dict(),
              "pooler": model.encoder.pooler, "mlp_only_train": bool(model.encoder.mlp_only_train),
              "max_seq_length": model.max_seq_length, "base_model": base_model}
    if model.head:  # a kept sentence-transformers head: its structure (weights: checkpoints)
        record["head"] = st_head.head_record(model.head)
    return record


def write_model(workdir: Union[str, os.PathLike], model: SentenceModel,
                base_model: str = "") -> None:
    """Writes model.json and tokenizer/ (the checkpoints come from the train loop)."""
    workdir = store.as_path(workdir, "--workdir")
    # The tokenizer library writes local files only: save, then copy them into the workdir.
    with tempfile.TemporaryDirectory() as local:
        model.tokenizer.save_pretrained(local)
        store.upload_dir(local, workdir / TOKENIZER_DIR)
    store.write_json(workdir / MODEL_FILE, model_record(model, base_model))


def encoder_from_record(record: Mapping, source: str) -> tuple[SentenceEncoder, Optional[int]]:
    """The SentenceEncoder (float32) and token limit described by a model.json record."""
    if record.get("format") != _FORMAT or not isinstance(record.get("config"), Mapping):
        raise WorkdirError(f"{source}: not a jaxsim model record")
    max_len = record.get("max_seq_length")
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int)
                                or max_len < 2):
        raise WorkdirError(f"{source}: max_seq_length: expected int >= 2, got {max_len!r}")
    try:
        config, pooler = BertConfig.from_hf_dict(record["config"]), record.get("pooler") or "avg"
        get_pooler(pooler)
        encoder = SentenceEncoder(config, pooler=str(pooler),
                                  mlp_only_train=bool(record.get("mlp_only_train")))
    except (JaxsimError, TypeError) as e:  # the file at fault, not just the key
        raise WorkdirError(f"{source}: {e}") from None
    return encoder, max_len


def load_workdir(workdir: Union[str, os.PathLike], which: Union[str, int] = "best"
                 ) -> SentenceModel:
    """Loads a trained encoder from a train workdir; `which`: 'best' (by the dev metric; the
    latest when the run had no evaluation), 'latest', or a step number."""
    workdir = store.as_path(workdir)
    record = store.read_json(workdir / MODEL_FILE, WorkdirError, "model record")
    encoder, max_len = encoder_from_record(record, str(workdir / MODEL_FILE))
    ckpt_dir = workdir / CHECKPOINT_DIR
    with Checkpointer(ckpt_dir, read_only=True) as ckpt:
        step = ckpt.resolve_step(which)
        params = ckpt.restore_params(step, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    # The objective's own parameters (a learned temperature) trained with the encoder; they
    # are no part of the model.
    params = owned.encoder_params(jax.tree.map(np.asarray, params))
    # A kept sentence-transformers head: its structure from the record, its (trained) Dense
    # weights from the checkpoint.
    params, weights = st_head.split_weights(params)
    try:
        head = st_head.head_from_record(record.get("head", []), weights, f"{ckpt_dir}/{step}")
    except st_head.HeadError as e:
        raise WorkdirError(str(e)) from None
    check_params(encoder, params, f"{ckpt_dir}/{step}")
    return SentenceModel(encoder=encoder, params=jax.device_put(params),
                         tokenizer=load_tokenizer(store.local_copy(workdir / TOKENIZER_DIR)),
                         path=str(workdir), max_seq_length=max_len, head=head)
