"""From a TrainConfig to what training starts with: the base encoder and the examples.

Host-side only: nothing here compiles or places arrays on devices, so every input is read and
checked before any tracing (bad input fails in seconds, naming the file).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh

from jaxsim import distributed, sharding
from jaxsim.cpu import warn_if_bf16_emulated
from jaxsim.data import readers, sources
from jaxsim.data.packing import pack_batch
from jaxsim.data.pipeline import StreamIterator
from jaxsim.errors import ConfigError
from jaxsim.formats.hf_folder import bundled_model_path, load_tokenizer, resolve_model_path
from jaxsim.formats.pretrained import load_pretrained
from jaxsim.models import st_head
from jaxsim.models.architectures import MASK_TOKENS, known_architecture
from jaxsim.models.bert import BertConfig
from jaxsim.models.encoder import SentenceEncoder, param_shapes
from jaxsim.models.poolers import get_pooler
from jaxsim.objectives import Objective, ObjectiveError, owned
from jaxsim.objectives.mlm import MlmSettings
from jaxsim.train import optim
from jaxsim.train import state as state_lib
from jaxsim.train import step as step_lib
from jaxsim.train.config import TrainConfig

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
      head: a sentence-transformers folder's modules after pooling, kept (`keep_head`):
        `jaxsim.models.st_head` Dense / Normalize; () when none or dropped.
    """

    config: BertConfig
    tokenizer: Any
    bert_params: Optional[Any]
    path: str
    mlm_params: Optional[Any] = None
    head: tuple = ()

    def without_weights(self) -> 'BaseModel':
        """This base without its weight arrays, so they can be freed once the train state
        holds its own copy (else they stay resident for the whole run). The head's structure
        stays (its Dense weights are small)."""
        return dataclasses.replace(self, bert_params=None, mlm_params=None)


def load_base(cfg: TrainConfig) -> BaseModel:
    """Reads the base model named by `cfg.model` (weights unless `random_init`)."""
    path = bundled_model_path() if cfg.model == 'bundled' else resolve_model_path(cfg.model)
    head = ()
    if cfg.random_init:
        config = BertConfig.from_json(Path(path) / 'config.json')
        tokenizer, bert_params, mlm_params = load_tokenizer(Path(path)), None, None
    else:
        model = load_pretrained(path)
        config, tokenizer = model.config, model.tokenizer
        bert_params = jax.tree.map(np.asarray, model.params['bert'])
        mlm_params = (jax.tree.map(np.asarray, model.params['mlm_head'])
                      if 'mlm_head' in model.params else None)
        if cfg.keep_head and model.head:
            try:
                st_head.check_jax_form(model.head, str(path))
            except st_head.HeadError as e:
                raise ConfigError(f'train config: {e}: training cannot keep it; set '
                                  f'keep_head=False to train without the head') from None
            head = tuple(model.head)
    return BaseModel(config=configured_architecture(cfg, config), tokenizer=tokenizer,
                     bert_params=bert_params, path=str(path), mlm_params=mlm_params, head=head)


def architecture(cfg: TrainConfig) -> BertConfig:
    """The encoder architecture a config trains, without weights or tokenizer: a known model
    name (`jaxsim.models.architectures`), else the `config.json` of the model's folder."""
    config = known_architecture(cfg.model)
    if config is None:
        path = bundled_model_path() if cfg.model == 'bundled' else resolve_model_path(cfg.model)
        config = BertConfig.from_json(Path(path) / 'config.json')
    return configured_architecture(cfg, config)


def configured_architecture(cfg: TrainConfig, config: BertConfig) -> BertConfig:
    """`config` with the train config's `model_overrides` and dropout applied, checked."""
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
    except ConfigError as e:
        raise ConfigError(f'train config: model_overrides: {e}') from None
    # Positions past the table are read out of range: the loss turns NaN, no error is raised.
    if cfg.max_len > config.max_length:
        raise ConfigError(f'train config: max_len {cfg.max_len} is more than the '
                          f'{config.max_length} tokens the model takes '
                          f'(max_position_embeddings {config.max_position_embeddings})')
    return config


def make_encoder(cfg: TrainConfig, config: BertConfig) -> SentenceEncoder:
    """The SentenceEncoder trained (compute dtype from the config; params stay float32)."""
    get_pooler(cfg.pooler)
    dtype = jnp.bfloat16 if cfg.dtype == 'bfloat16' else jnp.float32
    warn_if_bf16_emulated(dtype, {d.platform for d in jax.devices()})
    return SentenceEncoder(config, pooler=cfg.pooler, mlp_only_train=cfg.mlp_only_train,
                           mlm=cfg.mlm_weight > 0,
                           dtype=dtype, remat=cfg.remat, kernels=cfg.kernels)


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


def check_loss_batch(cfg: TrainConfig, objective: Objective) -> None:
    """The examples each loss sees (the batch, or one of its grad_accum_steps pieces; cached
    micro-batches see the whole batch) against the fewest the objective takes."""
    rows = cfg.batch_size // cfg.grad_accum_steps
    if rows < objective.min_batch:
        pieces = f' in {cfg.grad_accum_steps} accumulated pieces' if cfg.grad_accum_steps > 1 \
            else ''
        raise ObjectiveError(f'objective {objective.name!r} needs at least '
                             f'{objective.min_batch} examples a loss; global batch '
                             f'{cfg.batch_size}{pieces} gives {rows}')


def check_batch_split(cfg: TrainConfig, mesh, config: BertConfig) -> None:
    """The global batch splits evenly over the mesh's batch shards (and the accumulation steps
    and micro-batches), else a ConfigError that also names, where there is one, the mesh that
    takes the batch as it is (the papers' batch 64 on a 256-chip pod): the batch split as far
    as it goes, the model over the devices left."""
    try:
        sharding.check_global_batch(cfg.batch_size, mesh, cfg.grad_accum_steps,
                                    cfg.micro_batch_size)
    except ValueError as e:
        raise ConfigError(f'{e}{_model_split_hint(cfg, mesh, config)}') from None


def _model_split_hint(cfg: TrainConfig, mesh, config: BertConfig) -> str:
    # Only the default mesh (data over every chip of each slice) is re-planned: a mesh the
    # user chose is theirs. Slices keep their data split; within each, the rows take what
    # they can and the model splits over the chips left.
    slices = cfg.mesh_dcn_data
    if (cfg.mesh_fsdp, cfg.mesh_tensor, cfg.mesh_dcn_fsdp, cfg.mesh_dcn_tensor) != (1, 1, 1, 1) \
            or cfg.batch_size % cfg.grad_accum_steps:
        return ''
    shards = sharding.batch_shards(mesh)
    data = math.gcd(cfg.batch_size // cfg.grad_accum_steps, cfg.micro_batch_size or shards,
                    shards)
    tensor = shards // data
    if data % slices or tensor == 1 or any(
            n % tensor for n in (config.num_attention_heads, config.intermediate_size,
                                 config.hidden_size)):
        return ''
    flags = f'--config.mesh_data={data // slices} --config.mesh_tensor={tensor}'
    rules, strict = param_rules(cfg)
    try:  # a parameter the rules split but `tensor` does not divide (BERT's 30,522-row vocab)
        sharding.param_specs(param_shapes(make_encoder(cfg, config)),
                             AbstractMesh((data, 1, tensor), sharding.MESH_AXES), rules, strict)
    except sharding.ShardingError:
        flags += ' --config.replicate_indivisible=True'
    return f'; or keep the batch and split the model over the other devices: {flags}'


def grad_divisor(cfg: TrainConfig, mesh) -> float:
    """What the gradient is divided by (see the config's `grad_reduction`)."""
    if cfg.grad_reduction == 'global_mean':
        return 1.0
    return float(cfg.grad_replicas or sharding.batch_shards(mesh))


def batch_split(cfg: TrainConfig) -> step_lib.BatchSplit:
    """How the config's step takes its batch: packed (`pack_length`), cached micro-batches
    (`micro_batch_size`), accumulated (`grad_accum_steps` > 1) or whole. The BatchSplit refuses
    a config that sets more than one."""
    mode = ('packed' if cfg.pack_length else 'cached' if cfg.micro_batch_size
            else 'accumulate' if cfg.grad_accum_steps > 1 else 'whole')
    return step_lib.BatchSplit(mode=mode, grad_accum_steps=cfg.grad_accum_steps,
                               micro_batch_size=cfg.micro_batch_size)


def mlm_settings(cfg: TrainConfig, config: BertConfig, tokenizer: Any = None
                 ) -> Optional[MlmSettings]:
    """The masked-LM term's settings (None when the config has none): from the tokenizer, or,
    for a plan that reads none, from the model family's usual special tokens."""
    if cfg.mlm_weight <= 0:
        return None
    if tokenizer is not None:
        return MlmSettings.from_tokenizer(tokenizer, cfg.mlm_weight, cfg.mlm_probability,
                                          config.vocab_size)
    mask_id, special = MASK_TOKENS[config.model_type]
    return MlmSettings(weight=float(cfg.mlm_weight), probability=float(cfg.mlm_probability),
                       special_ids=special, mask_id=mask_id, vocab_size=config.vocab_size)


def param_rules(cfg: TrainConfig) -> tuple[dict, bool]:
    """(logical-axis rules, strict) of a config, for `state.param_shardings` and
    `state.state_shardings`."""
    return sharding.axis_rules(cfg.logical_axis_rules), not cfg.replicate_indivisible


@dataclasses.dataclass(frozen=True)
class TrainProgram:
    """The jitted `train_step(state, batch) -> (state, metrics)` of a config and what its
    state is built from: the optimizer, the TrainState's shapes and shardings, the keys of the
    parameters' init and of dropout (the state's `rng`), the XLA options both compile with."""

    train_step: Callable
    tx: Any
    state_shape: Any
    shardings: Any
    init_key: jax.Array
    dropout_key: jax.Array
    compiler_options: Optional[dict]


def init_key(seed: int) -> jax.Array:
    """The key a run draws the parameters no checkpoint gives with (its dropout key is
    `step.dropout_key` of the same root)."""
    return jax.random.fold_in(jax.random.key(seed), 1)


def owned_params(cfg: TrainConfig, objective: Objective, objective_kwargs: dict) -> dict:
    """The objective's own parameters a run of `cfg` starts with ({} when it owns none), drawn
    with the root key's use 4 (1: the encoder's init, 2 and 3: dropout)."""
    return owned.init_owned(objective, objective_kwargs,
                            jax.random.fold_in(jax.random.key(cfg.seed), 4))


def train_batches(cfg: TrainConfig, source: Any, tokenizer: Any, mesh) -> StreamIterator:
    """A run's batches in its order (a function of the seed): this process's rows of each
    global batch, read and tokenized ahead of the step."""
    return StreamIterator(
        source, tokenizer, cfg.max_len, cfg.batch_size, seed=cfg.seed,
        rows_fn=functools.partial(sharding.process_batch_rows, mesh),
        process_count=jax.process_count(), last_batch=cfg.last_batch,
        granularity=sharding.batch_granularity(mesh, cfg))


def train_program(cfg: TrainConfig, encoder: SentenceEncoder, objective: Objective,
                  objective_kwargs: dict, mesh, total_steps: int,
                  mlm: Optional[MlmSettings] = None, head: tuple = ()) -> TrainProgram:
    """The one way a config becomes a train step: training runs it, `plan` compiles it.
    `head`: the base model's kept sentence-transformers modules (`BaseModel.head`)."""
    options = step_lib.compiler_options(cfg.fast_compile)
    dropout_key = step_lib.dropout_key(jax.random.key(cfg.seed), cfg.prng_impl)
    tx = optim.make_optimizer(cfg, total_steps)
    owned_shapes = jax.eval_shape(lambda: owned_params(cfg, objective, objective_kwargs))
    head_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                               st_head.head_weights(head))
    shape = state_lib.state_shape(encoder, tx, dropout_key, owned_shapes, head_shapes)
    shardings = state_lib.state_shardings(shape, mesh, *param_rules(cfg),
                                          shard_optimizer_state=cfg.shard_optimizer_state)
    update_at = (state_lib.update_shardings(shape, shardings, mesh)
                 if cfg.shard_optimizer_state else None)
    train_step = step_lib.make_train_step(
        loss=step_lib.LossSpec(encoder=encoder,
                               objective=functools.partial(objective.loss, **objective_kwargs),
                               views=objective.views, mlm=mlm, head=head),
        update=step_lib.UpdateSpec(tx=tx, grad_divisor=grad_divisor(cfg, mesh),
                                   schedule=optim.make_schedule(cfg, total_steps)),
        target=step_lib.CompileTarget(mesh=mesh, state_shardings=shardings,
                                      compiler_options=options, prng_impl=cfg.prng_impl,
                                      update_shardings=update_at),
        split=batch_split(cfg))
    return TrainProgram(train_step=train_step, tx=tx, state_shape=shape, shardings=shardings,
                        init_key=init_key(cfg.seed), dropout_key=dropout_key,
                        compiler_options=options)
