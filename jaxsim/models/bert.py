"""BERT and RoBERTa encoders as pure Flax linen modules.

Module and parameter names follow the Hugging Face PyTorch layout (`embeddings`,
`encoder/layer_N/attention/self/query`, ...), so converting a checkpoint is a name table plus a
transpose (see `jaxsim/formats/hf.py`).
The numerical reference is `transformers.BertModel` / `RobertaModel` in float32.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Tuple

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from jaxsim.errors import ConfigError
from jaxsim.models import attention_ops, dropout, ops, packed
from jaxsim.models import kernels as kernels_lib
from jaxsim.storage import store

SUPPORTED_MODEL_TYPES = ("bert", "roberta")

# Hugging Face activation names -> functions. BERT's "gelu" is the exact erf GELU, not Flax's
# default tanh approximation (STACK.md).
_ACTIVATIONS = {
    "gelu": lambda x: nn.gelu(x, approximate=False),
    "gelu_new": lambda x: nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: nn.gelu(x, approximate=True),
    "relu": nn.relu,
    "tanh": jnp.tanh,
}


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Architecture of a BERT-family encoder, read from a Hugging Face `config.json`."""

    vocab_size: int
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    model_type: str = "bert"

    def __post_init__(self):
        for f in dataclasses.fields(self):  # a hand-edited "32", null or 0: named, not in flax
            v, kinds = getattr(self, f.name), {"int": (int,), "float": (int, float)}.get(f.type)
            least = int(f.type == "int" and f.name != "pad_token_id")  # a pad id may be 0
            if kinds and (isinstance(v, bool) or not isinstance(v, kinds) or not v >= least):
                raise ConfigError(f"{f.name}: expected {f.type} >= {least}, got {v!r}")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unknown model_type {self.model_type!r}; jaxsim supports {SUPPORTED_MODEL_TYPES}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}")
        if self.hidden_act not in _ACTIVATIONS:
            raise ConfigError(
                f"unsupported hidden_act {self.hidden_act!r}; known: {sorted(_ACTIVATIONS)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def max_length(self) -> int:
        """Longest token sequence the position table allows (RoBERTa counts positions from
        pad_token_id + 1; BERT from 0)."""
        offset = self.pad_token_id + 1 if self.model_type == "roberta" else 0
        return self.max_position_embeddings - offset

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> "BertConfig":
        """Builds a config from a Hugging Face config dict; unknown keys are ignored."""
        if "model_type" not in d:
            raise ConfigError("config has no 'model_type' (expected 'bert' or 'roberta')")
        kwargs = {f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d}
        if "vocab_size" not in kwargs:
            raise ConfigError("config has no 'vocab_size'")
        if kwargs.get("pad_token_id") is None:
            kwargs["pad_token_id"] = 1 if d["model_type"] == "roberta" else 0
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path) -> "BertConfig":
        d = store.read_json(path, ConfigError, "config file")
        try:
            return cls.from_hf_dict(d)
        except (ConfigError, TypeError) as e:
            raise ConfigError(f"{path}: {e}") from None

    def to_hf_dict(self) -> dict:
        """The Hugging Face `config.json` content for this architecture."""
        arch = "RobertaModel" if self.model_type == "roberta" else "BertModel"
        return {**dataclasses.asdict(self), "architectures": [arch],
                "position_embedding_type": "absolute", "initializer_range": 0.02}


class BertOutput(flax.struct.PyTreeNode):
    """Encoder outputs: num_hidden_layers + 1 `hidden_states` [batch, len, hidden] (index 0 the
    embedding output, -1 the last layer: Hugging Face's `output_hidden_states=True` convention)
    and the `pooler_output` [batch, hidden] (dense+tanh over CLS; None without a pooler)."""

    hidden_states: Tuple[jax.Array, ...]
    pooler_output: Optional[jax.Array]

    @property
    def last_hidden_state(self) -> jax.Array:
        return self.hidden_states[-1]


class DenseParams(nn.Module):
    """The kernel [in, features] and bias [features] of a dense layer, under flax Dense's names
    and initializers (so the Hugging Face name map is unchanged); the caller applies them, which
    lets a layer fuse products (query/key/value) or fuse the bias into its activation."""

    features: int

    @nn.compact
    def __call__(self, in_features: int) -> tuple[jax.Array, jax.Array]:
        kernel = self.param("kernel", nn.initializers.normal(0.02),
                            (in_features, self.features), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,), jnp.float32)
        return kernel, bias


def _dropout(module: nn.Module, x: jax.Array, rate: float, deterministic: bool) -> jax.Array:
    """Dropout with a key from the module's 'dropout' stream (nothing drawn when off)."""
    if deterministic or rate == 0.0:
        return x
    return dropout.dropout(x, rate, module.make_rng("dropout"))


def _layer_norm(config: BertConfig, dtype) -> nn.LayerNorm:
    return nn.LayerNorm(epsilon=config.layer_norm_eps, dtype=dtype, param_dtype=jnp.float32,
                        name="LayerNorm")


def position_ids_for(config: BertConfig, input_ids: jax.Array) -> jax.Array:
    """Position ids [batch, len]: 0..L-1 for BERT; for RoBERTa, counted over non-pad tokens
    starting at pad_token_id + 1 (pads keep pad_token_id), as fairseq/transformers do."""
    if config.model_type == "roberta":
        not_pad = (input_ids != config.pad_token_id).astype(jnp.int32)
        return jnp.cumsum(not_pad, axis=1) * not_pad + config.pad_token_id
    return jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)


class _Part(nn.Module):
    """The fields every part of the encoder takes: architecture, compute dtype, kernel form."""

    config: BertConfig
    dtype: Any = jnp.float32
    kernels: str = "auto"  # see jaxsim.models.kernels


class RowCastEmbed(nn.Embed):
    """`nn.Embed` that gathers the rows from the float32 table and casts only those to the
    compute dtype. `nn.Embed` casts the whole table first: under bf16 a [vocab, hidden] read and
    write every step, and backward the gradient scattered into a bf16 table of that size, then
    converted to float32. Forward values are the same (a cast commutes with a gather); backward,
    repeated tokens' gradients are summed in float32 rather than bf16."""

    def __call__(self, inputs: jax.Array) -> jax.Array:
        if self.num_embeddings == 1:
            rows = jnp.broadcast_to(self.embedding, inputs.shape + (self.features,))
        else:
            rows = jnp.take(self.embedding, inputs, axis=0)
        return rows.astype(self.dtype)


class BertEmbeddings(_Part):
    @nn.compact
    def __call__(self, input_ids, token_type_ids, deterministic: bool, position_ids=None):
        cfg = self.config

        def embed(n, size):
            return RowCastEmbed(size, cfg.hidden_size, embedding_init=nn.initializers.normal(0.02),
                                param_dtype=jnp.float32, dtype=self.dtype, name=n)

        if position_ids is None:
            position_ids = position_ids_for(cfg, input_ids)
        x = embed("word_embeddings", cfg.vocab_size)(input_ids)
        x = x + embed("position_embeddings", cfg.max_position_embeddings)(position_ids)
        x = x + embed("token_type_embeddings", cfg.type_vocab_size)(token_type_ids)
        x = _layer_norm(cfg, self.dtype)(x)
        return _dropout(self, x, cfg.hidden_dropout_prob, deterministic)


class BertSelfAttention(_Part):
    @nn.compact
    def __call__(self, x, attention_bias, deterministic: bool):
        cfg = self.config
        batch, length, hidden = x.shape
        # query, key and value as ONE product with a [hidden, 3, hidden] kernel: one pass over
        # x and a wider dot (3x the output columns) instead of three narrow ones, forward and
        # backward. Stacking on a new axis keeps each kernel's 'heads' sharding intact.
        params = [DenseParams(cfg.hidden_size, name=n)(hidden) for n in ("query", "key", "value")]
        if not kernels_lib.use_cpu_forms(self.kernels):
            return self._xla_form(x, params, attention_bias, deterministic)
        kernel = jnp.stack([k for k, _ in params], axis=1)  # [hidden, 3, hidden]
        bias = jnp.stack([b for _, b in params])  # [3, hidden]
        # Head-major [3, B, heads, L, head_dim] in the compute dtype, written by the pass that
        # adds the bias (and scales the queries by 1/sqrt(head_dim), so the [B, heads, L, L]
        # scores need no scaling pass). Both attention products then read contiguous per-head
        # blocks and their output needs one transpose back, where the token-major layout made
        # XLA copy q, k and v out separately. Under bf16 the products take bf16 operands with
        # float32 accumulation, as the dense layers do; the softmax stays float32 (the additive
        # mask is -inf-like). On XLA:CPU it pays at 64 tokens and more (docs/performance.md).
        scale = jnp.asarray([1.0 / math.sqrt(cfg.head_dim), 1.0, 1.0], jnp.float32)
        qkv = attention_ops.qkv_heads(x, kernel, bias, scale, cfg.num_attention_heads,
                                      self.dtype)
        # Split, not indexed: the gradient of a split is one concatenate of dq, dk, dv, where
        # that of three index slices is three zero-padded [3, ...] arrays summed.
        q, k, v = (part[0] for part in jnp.split(qkv, 3))  # [B, heads, L, head_dim]
        scores = attention_ops.attention_scores(q, k)  # [B, heads, L, L] float32
        probs = jax.nn.softmax(scores + attention_bias, axis=-1)
        probs = _dropout(self, probs, cfg.attention_probs_dropout_prob, deterministic)
        out = attention_ops.attention_mix(probs.astype(self.dtype), v)  # [B, heads, L, d]
        # Back to token-major through a unit axis: XLA then writes the transposed gradient out
        # in the compute dtype, where the plain transpose led it to run both gradient products
        # of `attention_mix` in float32 (operands converted up).
        out = jnp.transpose(out[..., None], (0, 2, 1, 3, 4))
        return out.reshape(batch, length, cfg.hidden_size)

    def _xla_form(self, x, params, attention_bias, deterministic: bool):
        """Plain JAX on the token-major layout [B, L, heads, head_dim]: XLA's TPU compiler
        fuses the head split into the products, where the head-major layout above costs it
        transposes (~0.2 GB per BERT-base layer at 64 x 32 tokens; `jaxsim.models.kernels`)."""
        cfg, dtype = self.config, self.dtype
        batch, length, _ = x.shape
        x = x.astype(dtype)

        def heads(kernel, bias):  # [B, L, heads, head_dim] in the compute dtype
            y = jnp.dot(x, kernel.astype(dtype)) + bias.astype(dtype)
            return y.reshape(batch, length, cfg.num_attention_heads, cfg.head_dim)

        q, k, v = (heads(*p) for p in params)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
        # The softmax in float32: the additive mask is -inf-like.
        probs = jax.nn.softmax(scores / math.sqrt(cfg.head_dim) + attention_bias, axis=-1)
        probs = _dropout(self, probs, cfg.attention_probs_dropout_prob, deterministic)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(dtype), v)
        return out.reshape(batch, length, cfg.hidden_size)


class BertResidualOutput(_Part):
    """dense -> dropout -> LayerNorm(x + residual): HF's `BertSelfOutput` and `BertOutput`."""

    @nn.compact
    def __call__(self, x, residual, deterministic: bool):
        kernel, bias = DenseParams(self.config.hidden_size, name="dense")(x.shape[-1])
        x = kernels_lib.dense_bias(x, kernel, bias, self.dtype, self.kernels)
        x = _dropout(self, x, self.config.hidden_dropout_prob, deterministic)
        return _layer_norm(self.config, self.dtype)(x + residual)


class BertAttention(_Part):
    @nn.compact
    def __call__(self, x, attention_bias, deterministic: bool):
        attended = BertSelfAttention(self.config, self.dtype, self.kernels, name="self")(
            x, attention_bias, deterministic)
        return BertResidualOutput(self.config, self.dtype, self.kernels, name="output")(
            attended, x, deterministic)


class BertIntermediate(_Part):
    @nn.compact
    def __call__(self, x):
        kernel, bias = DenseParams(self.config.intermediate_size, name="dense")(x.shape[-1])
        if self.config.hidden_act == "gelu":  # BERT's exact GELU, fused with the bias add
            return kernels_lib.dense_bias_gelu(x, kernel, bias, self.dtype, self.kernels)
        d = kernels_lib.matmul(x, kernel, self.dtype, self.kernels)  # [B, L, intermediate]
        return _ACTIVATIONS[self.config.hidden_act](d + bias.astype(d.dtype))


class BertLayer(_Part):
    @nn.compact
    def __call__(self, x, attention_bias, deterministic: bool):
        x = BertAttention(self.config, self.dtype, self.kernels, name="attention")(
            x, attention_bias, deterministic)
        h = BertIntermediate(self.config, self.dtype, self.kernels, name="intermediate")(x)
        return BertResidualOutput(self.config, self.dtype, self.kernels, name="output")(
            h, x, deterministic)


# What a rematerialized layer keeps for the backward pass (see `remat_layer`).
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def remat_layer(remat: str) -> type:
    """BertLayer, or BertLayer under `nn.remat` with the named policy.

    'none' keeps every activation; 'full' keeps only each layer's input and recomputes the
    layer in the backward pass; 'dots' also keeps the outputs of the matrix products with no
    batch dimension (the dense layers: most of the FLOPs), recomputing only the cheap
    element-wise work and attention. Parameter names and dropout masks are unchanged.
    """
    if remat == "none":
        return BertLayer
    if remat not in REMAT_POLICIES:
        raise ConfigError(f"unknown remat {remat!r}; known: none, {', '.join(REMAT_POLICIES)}")
    # Argument 3 (after the module, x and the bias) is the Python bool `deterministic`.
    return nn.remat(BertLayer, static_argnums=(3,), policy=REMAT_POLICIES[remat])


class BertEncoder(nn.Module):
    config: BertConfig
    dtype: Any = jnp.float32
    remat: str = "none"  # before kernels, as BertEncoder's positional order has always been
    kernels: str = "auto"

    @nn.compact
    def __call__(self, x, attention_bias, deterministic: bool):
        states = [x]
        layer = remat_layer(self.remat)
        for i in range(self.config.num_hidden_layers):
            x = layer(self.config, self.dtype, self.kernels, name=f"layer_{i}")(
                x, attention_bias, deterministic)
            states.append(x)
        return tuple(states)


class BertPooler(_Part):
    """dense + tanh over the first ([CLS]) token."""

    @nn.compact
    def __call__(self, last_hidden):
        low_precision = jnp.dtype(self.dtype) != jnp.float32
        dense = nn.Dense(self.config.hidden_size, dtype=self.dtype, param_dtype=jnp.float32,
                         dot_general=ops.mixed_precision_dot_general if low_precision else None,
                         kernel_init=nn.initializers.normal(0.02), name="dense")
        return jnp.tanh(dense(last_hidden[:, 0]))


class BertModel(nn.Module):
    """BERT / RoBERTa encoder returning every hidden state and the optional tanh pooler.

    Attributes:
      config: the architecture.
      dtype: compute dtype (float32, or bfloat16 with float32 parameters).
      add_pooler: build the dense+tanh pooler (False for checkpoints that ship none).
      remat: 'none', 'full' or 'dots': activation recomputation per layer (`remat_layer`).
      kernels: 'auto', 'xla' or 'cpu': the form of the layers' products and attention
        (`jaxsim.models.kernels`); the same function either way.
    """

    config: BertConfig
    dtype: Any = jnp.float32
    add_pooler: bool = True
    remat: str = "none"
    kernels: str = "auto"

    @nn.compact
    def __call__(self, input_ids, attention_mask, token_type_ids=None,
                 deterministic: bool = True, packing=None) -> BertOutput:
        """Encodes a padded batch.

        Args:
          input_ids: [batch, len] int32 token ids.
          attention_mask: [batch, len], 1 for real tokens and 0 for padding.
          token_type_ids: [batch, len] segment ids; zeros when None.
          deterministic: disables dropout; pass `rngs={'dropout': key}` to `apply` otherwise.
          packing: None, or (pack_index [S, R, P], unpack_index [batch, len]) from
            `jaxsim.data.packing`: the layers run on packed rows (no padding) and the hidden
            states come back in the padded layout.
        """
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        embeddings = BertEmbeddings(self.config, self.dtype, name="embeddings")
        if packing is None:
            x = embeddings(input_ids, token_type_ids, deterministic)
            # Additive key mask [batch, 1, 1, len]: padded keys get the most negative float, so
            # they receive exactly zero attention weight and cannot influence unpadded positions.
            keep = attention_mask.astype(bool)[:, None, None, :]
            attention_bias = jnp.where(keep, 0.0, jnp.finfo(jnp.float32).min).astype(jnp.float32)
        else:
            pack_index, unpack_index = packing
            x = embeddings(*(packed.gather_packed(a, pack_index) for a in (
                input_ids, token_type_ids)), deterministic, position_ids=packed.gather_packed(
                    position_ids_for(self.config, input_ids), pack_index))
            attention_bias = packed.packed_attention_bias(pack_index, input_ids.shape[1])
        states = BertEncoder(self.config, self.dtype, self.remat, self.kernels, name="encoder")(
            x, attention_bias, deterministic)
        if packing is not None:
            states = tuple(packed.unpack(h, unpack_index, pack_index.shape[0]) for h in states)
        pooled = (BertPooler(self.config, self.dtype, name="pooler")(states[-1])
                  if self.add_pooler else None)
        return BertOutput(hidden_states=states, pooler_output=pooled)
