"""From a TrainConfig to what training starts with: the base encoder and the examples.

Host-side only: nothing here compiles or places arrays on devices, so every input is read and
checked before any tracing (bad input fails in seconds, naming the file).
"""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxsim import distributed, sharding
from jaxsim.cpu import warn_if_bf16_emulated
from jaxsim.data import readers, sources
from jaxsim.data.packing import pack_batch
from jaxsim.io.hf_folder import bundled_model_path, load_tokenizer, resolve_model_path
from jaxsim.io.pretrained import load_pretrained
from jaxsim.models.bert import BertConfig, ConfigError as ModelConfigError
from jaxsim.models.encoder import SentenceEncoder
from jaxsim.models.poolers import get_pooler
from jaxsim.objectives import Objective, ObjectiveError
from jaxsim.train.config import ConfigError, TrainConfig

_DROPOUT_FIELDS = ('hidden_dropout_prob', 'attention_probs_dropout_prob')


@dataclasses.dataclass(frozen=True)
class BaseModel:
    """The starting point of a run.

    Attributes:
      config: the encoder architecture (with the config's overrides and dropout).
      tokenizer: the `transformers` tokenizer.
      bert_params: pretrained 'bert' parameter subtree (host arrays), or None (random init).
      path: the folder it was read from.
      mlm_params: the checkpoint's masked-LM head (host arrays), or None.
    """

    config: BertConfig
    tokenizer: Any
    bert_params: Optional[Any]
    path: str
    mlm_params: Optional[Any] = None

    def without_weights(self) -> 'BaseModel':
        """This base without its weight arrays, so they can be freed once the train state
        holds its own copy (else they stay resident for the whole run)."""
        return dataclasses.replace(self, bert_params=None, mlm_params=None)


def load_base(cfg: TrainConfig) -> BaseModel:
    """Reads the base model named by `cfg.model` (weights unless `random_init`)."""
    path = bundled_model_path() if cfg.model == 'bundled' else resolve_model_path(cfg.model)
    if cfg.random_init:
        config = BertConfig.from_json(Path(path) / 'config.json')
        tokenizer, bert_params, mlm_params = load_tokenizer(Path(path)), None, None
    else:
        model = load_pretrained(path)
        config, tokenizer = model.config, model.tokenizer
        bert_params = jax.tree.map(np.asarray, model.params['bert'])
        mlm_params = (jax.tree.map(np.asarray, model.params['mlm_head'])
                      if 'mlm_head' in model.params else None)
    overrides = dict(cfg.model_overrides)
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(BertConfig)})
    if unknown:
        raise ConfigError(f'train config: model_overrides has unknown BertConfig fields '
                          f'{", ".join(unknown)}')
    if not cfg.random_init and set(overrides) - set(_DROPOUT_FIELDS):
        raise ConfigError('train config: model_overrides may change the architecture only with '
                          'random_init=True (pretrained weights fix it)')
    if cfg.dropout >= 0:
        overrides.update({k: cfg.dropout for k in _DROPOUT_FIELDS})
    try:
        config = dataclasses.replace(config, **overrides)
    except ModelConfigError as e:
        raise ConfigError(f'train config: model_overrides: {e}') from None
    # Positions past the table are read out of range: the loss turns NaN, no error is raised.
    if cfg.max_len > config.max_length:
        raise ConfigError(f'train config: max_len {cfg.max_len} is more than the '
                          f'{config.max_length} tokens the model takes '
                          f'(max_position_embeddings {config.max_position_embeddings})')
    return BaseModel(config=config, tokenizer=tokenizer, bert_params=bert_params, path=str(path),
                     mlm_params=mlm_params)


def make_encoder(cfg: TrainConfig, config: BertConfig) -> SentenceEncoder:
    """The SentenceEncoder trained (compute dtype from the config; params stay float32)."""
    get_pooler(cfg.pooler)
    dtype = jnp.bfloat16 if cfg.dtype == 'bfloat16' else jnp.float32
    warn_if_bf16_emulated(dtype, {d.platform for d in jax.devices()})
    return SentenceEncoder(config, pooler=cfg.pooler, mlp_only_train=cfg.mlp_only_train,
                           mlm=cfg.mlm_weight > 0,
                           dtype=dtype, remat=cfg.remat)


def open_source(cfg: TrainConfig):
    """The training examples as a random-access source (`jaxsim.data.sources`).

    Text, CSV and SentEval SNLI files are read through line indexes built once (and cached);
    the small deduplicated SentEval corpus ('senteval_corpus') is held in memory.
    `source.name` names the data in messages and the run record.
    """
    path = cfg.data_path
    if cfg.data_format == 'tfds':
        source = sources.TfdsSource(cfg.tfds_name, cfg.tfds_split, cfg.tfds_data_dir or None,
                                    cfg.tfds_fields)
    elif cfg.data_format == 'text':
        source = sources.TextSource(path)
    elif cfg.data_format == 'csv':
        source = sources.CsvSource(path)
    elif cfg.data_format == 'senteval_corpus':
        source = sources.ListSource(readers.collect_corpus(path), f'{path} '
                                    f'({len(readers.CORPUS_FILES)} SentEval text files)')
    else:
        source = sources.SnliSource(path, cfg.snli_splits)
    if cfg.max_examples > 0:
        source = sources.Limited(source, cfg.max_examples)
    return source


def check_views(source, objective: Objective) -> int:
    """Sentences per example, checked against what the objective takes."""
    views = source.views
    if not objective.accepts(views):
        want = f'{objective.views}' + (' (or 1, repeated)' if objective.from_single else '')
        raise ObjectiveError(f'{source.name}: objective {objective.name!r} needs {want} '
                             f'sentence(s) per example, the data has {views}')
    return views


def batch_preparer(cfg: TrainConfig, objective: Objective, mesh) -> Callable[[dict], dict]:
    """What turns this process's host batch into the step's input: its packed layout added
    (`cfg.pack_length`: each of the batch shards this process feeds packed on its own, the row
    count agreed among processes), or the batch itself."""
    if not cfg.pack_length:
        return lambda batch: batch
    local_shards = len(sharding.process_batch_rows(mesh, sharding.batch_shards(mesh)))
    return functools.partial(pack_batch, views=objective.views, pack_length=cfg.pack_length,
                             shards=local_shards, agree=distributed.max_over_processes)
