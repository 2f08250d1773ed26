"""The pure pieces of jaxsim, in one place: what a custom training loop or experiment needs.

Each name is the piece `train.py`, `encode` and the commands use (imported from the module
that owns it), or a thin wrapper taking plain arguments; docs/api.md shows each with an
example, and `examples/custom_loop.py` rebuilds `train.py`'s losses from them.

  load_config(path, **overrides)       a config file -> TrainConfig
  initial_model(cfg)                   the SentenceModel a run starts from (train.py's init)
  embed_fn(model) -> (apply, params)   pure `apply(params, ids, mask, types) -> vectors`,
                                       pooler and sentence-transformers head included
  tokenize, tokenize_examples          sentences -> padded int32 arrays
  objective_loss(cfg) -> (loss, views) the configured objective, hyperparameters bound
  objective_params(cfg)                the parameters it owns (a learned temperature), if any
  make_loss_fn                         `loss_fn(params, batch, key, step=None) -> (loss, aux)`
  dropout_key, step_key, init_key      the run's keys from its seed, as the train step derives them
  batches(cfg, tokenizer)              train.py's batches, in train.py's order
  make_optimizer(**hyperparameters)    the optax optimizer of train.py from plain keywords
                                       (total_steps required), optimizer_hyperparameters(cfg)
                                       a config's values of them
  train_program, make_train_step       the jitted, sharded train step train.py runs; the
                                       latter from LossSpec, UpdateSpec, CompileTarget and
                                       BatchSplit, for another loss or optimizer
  create_state, TrainState             its state
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable, Union

import jax
import jax.numpy as jnp

from jaxsim import sharding
from jaxsim.data.batching import tokenize_examples
from jaxsim.data.pipeline import StreamIterator
from jaxsim.data.tokenize import TokenBatch, tokenize
from jaxsim.model import SentenceModel
from jaxsim.models import st_head
from jaxsim.models.encoder import init_params
from jaxsim.objectives import check_kwargs, get_objective
from jaxsim.train import build
from jaxsim.train import step as step_lib
from jaxsim.train.build import init_key, train_program
from jaxsim.train.config import TrainConfig
from jaxsim.train.config_files import load_config_file
from jaxsim.train.optim import build_optimizer as make_optimizer
from jaxsim.train.optim import hyperparameters as optimizer_hyperparameters
from jaxsim.train.state import TrainState, create_state
from jaxsim.train.step import (
    BatchSplit,
    CompileTarget,
    LossSpec,
    UpdateSpec,
    configure_jax,
    make_loss_fn,
    make_train_step,
)

__all__ = ["BatchSplit", "CompileTarget", "HEAD_KEY", "LossSpec", "TokenBatch", "TrainConfig",
           "TrainState", "UpdateSpec", "batches", "configure_jax", "create_state",
           "dropout_key", "embed_fn", "init_key", "initial_model", "load_config",
           "make_loss_fn", "make_optimizer", "make_train_step", "objective_loss",
           "objective_params", "optimizer_hyperparameters", "step_key", "tokenize",
           "tokenize_examples", "train_program"]

HEAD_KEY = st_head.HEAD_KEY  # where embed_fn's params hold the Dense modules' weights


def load_config(path: Union[str, Path], **overrides) -> TrainConfig:
    """A config file (`configs/*.py`, or `path.py:arg`) with fields replaced by `overrides`,
    validated, as `train.py --config path --config.key=value` reads it."""
    return TrainConfig.from_dict({**load_config_file(str(path)), **overrides}, source=str(path))


def dropout_key(seed: int, prng_impl: str = "threefry2x32") -> jax.Array:
    """The run's dropout key (`train_program(...).dropout_key`, the state's `rng`)."""
    return step_lib.dropout_key(jax.random.key(seed), prng_impl)


def step_key(key: jax.Array, step) -> jax.Array:
    """The dropout key of update `step` (0-based: the state's step before the update), as the
    train step derives it from `dropout_key`."""
    return jax.random.fold_in(key, step)


def initial_model(cfg: TrainConfig) -> SentenceModel:
    """The model a run of `cfg` starts from: its encoder (compute dtype, pooler, dropout), the
    base checkpoint's weights where it has them and the rest drawn from `init_key(cfg.seed)`,
    and its tokenizer: the parameters `train.py` starts with."""
    base = build.load_base(cfg)
    encoder = build.make_encoder(cfg, base.config)
    params = init_params(encoder, init_key(cfg.seed), bert_params=base.bert_params,
                         mlm_params=base.mlm_params)
    return SentenceModel(encoder=encoder, params=params, tokenizer=base.tokenizer,
                         path=base.path, max_seq_length=cfg.max_len, head=base.head)


def objective_loss(cfg: TrainConfig) -> tuple[Callable, int]:
    """(`loss(z [B, V, H]) -> (scalar, aux)` with the config's objective_kwargs bound, V: the
    views it takes), the objective `train.py` optimizes (without the masked-LM term)."""
    objective = get_objective(cfg.objective)
    kwargs = check_kwargs(objective, cfg.objective_kwargs)
    return functools.partial(objective.loss, **kwargs), objective.views


def objective_params(cfg: TrainConfig) -> dict:
    """The parameters the configured objective owns, as a run of `cfg` starts them ({} when
    none; e.g. `{'log_temp': log(temp)}` with `learn_temperature`). Training keeps them
    beside the encoder's, under 'objective': `{**model.params, 'objective': ...}` is the tree
    `make_loss_fn`'s loss and the optimizer take (`jaxsim.objectives.owned.join`)."""
    objective = get_objective(cfg.objective)
    return build.owned_params(cfg, objective, check_kwargs(objective, cfg.objective_kwargs))


def batches(cfg: TrainConfig, tokenizer: Any, mesh=None) -> StreamIterator:
    """An iterator over train.py's batches of `cfg`, in its order (a function of the seed):
    this process's rows of each global batch, {'input_ids', 'attention_mask',
    'token_type_ids'}: int32 [rows, sentences per example, max_len]. `mesh` (default: the
    config's) decides the rows each process feeds. `.close()` stops its reader threads."""
    mesh = sharding.config_mesh(cfg) if mesh is None else mesh
    return build.train_batches(cfg, build.open_source(cfg), tokenizer, mesh)


def embed_fn(model: SentenceModel) -> tuple[Callable, Any]:
    """(apply, params): a pure function from token ids to the model's sentence vectors.

    `apply(params, input_ids, attention_mask, token_type_ids=None, key=None)` -> [batch, dim]
    float32: the encoder, its pooler, then the sentence-transformers head (Dense, Normalize)
    in JAX, as `jaxsim.encode` computes them. ids are [batch, len] int32; `key` turns dropout
    on (training mode, the pooler's training-only head included). `params` is the model's
    parameter tree, plus the Dense modules' weights under 'st_head' when it has any (so they
    can be differentiated too). jit, grad and vmap apply as to any JAX function.
    """
    encoder, head = model.encoder, tuple(model.head)
    st_head.check_jax_form(head, "embed_fn")
    params = dict(model.params)
    weights = st_head.head_weights(head)
    if weights:
        params[HEAD_KEY] = jax.tree.map(jnp.asarray, weights)

    def apply(params, input_ids, attention_mask, token_type_ids=None, key=None):
        params, weights = st_head.split_weights(params)
        x = encoder.apply({"params": params}, input_ids, attention_mask, token_type_ids,
                          train=key is not None, rngs={} if key is None else {"dropout": key})
        return st_head.apply_jax(head, weights, x)

    return apply, params
