"""Sentence poolers: the registry that turns encoder outputs into one vector per sentence.

A pooler is a linen module `__call__(output: BertOutput, attention_mask, use_head) -> [B, H]`
(float32), registered under a name together with its sentence-transformers export rule. A
parameter-free pooler can be registered as a plain function `fn(output, attention_mask)`.
Padding never counts: every average is over the real tokens only. Layer choices follow the
SimCSE / BERT-flow evaluation code:
  - `avg_first_last` averages hidden_states[1] (the FIRST TRANSFORMER LAYER's output) and
    hidden_states[-1], as SimCSE's `avg_first_last` and BERT-flow's `first-last-avg` do.
  - `avg_embed_last` averages hidden_states[0] (embedding output) and hidden_states[-1], the
    variant behind the SimCSE paper's original table.
  - `cls` is [CLS] through dense + tanh: BERT's own pooler layer for a pretrained model, the
    SimCSE MLP head in training (`use_head=False` skips it: SimCSE's `mlp_only_train`).
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Mapping, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxsim.errors import JaxsimError

# The rules build sentence-transformers module descriptions; the leaf module imports no jaxsim.
from jaxsim.formats.st_modules import TANH, StModule, st_dense, st_layer_average, st_pooling
from jaxsim.models.bert import BertConfig, BertOutput
from jaxsim.registry import Registry, binds, describe


class PoolerError(JaxsimError):
    """A pooler that cannot be computed or exported for this model."""


# export(pooler_params or None, config, use_head) -> the sentence-transformers modules that
# reproduce the pooler exactly, built from stock modules only (`jaxsim.formats.st_modules`).
ExportRule = Callable[[Optional[Mapping], BertConfig, bool], Sequence[StModule]]


@dataclasses.dataclass(frozen=True)
class Pooler:
    """A registered pooler.

    Attributes:
      name: the registry name.
      build: `build(config, dtype, name) -> nn.Module` making the pooling module.
      export: the sentence-transformers export rule, or None (export is then refused).
      hf_pooler: its parameters are BERT's own pooler layer (Hugging Face `pooler.*`), so a
        checkpoint's pooler weights load into it and a Hugging Face export writes them back.
      source: the registered Module class or function (whose source a run record hashes).
    """

    name: str
    build: Callable[[BertConfig, Any, str], nn.Module]
    export: Optional[ExportRule] = None
    hf_pooler: bool = False
    source: Any = None


def _check_pooler(entry: Any) -> Optional[str]:
    """A registered pooler: made by `register_pooler`, buildable and callable as a model uses
    it."""
    if not isinstance(entry, Pooler):
        return f"must be registered with @register_pooler, got {describe(entry)}"
    source = entry.source
    if inspect.isclass(source):
        if not issubclass(source, nn.Module):
            return f"must be a flax.linen Module class or a function, got {describe(source)}"
        if not binds(source, config=None, dtype=None, name=None):  # how a model builds it
            return (f"must be a Module with fields `config` and `dtype` (and no other field "
                    f"without a default); {source.__qualname__} is not")
    elif not binds(source, None, None):  # a function pooler is called fn(output, mask)
        return f"must be a function fn(output, attention_mask), got {describe(source)}"
    return None


POOLERS: Registry[Pooler] = Registry("pooler", error=PoolerError, check=_check_pooler)


class FunctionPooler(nn.Module):
    """Wraps a parameter-free `fn(output, attention_mask) -> [B, H]` as a pooling module."""

    fn: Callable

    def __call__(self, output: BertOutput, attention_mask, use_head: bool = True):
        vectors = self.fn(output, attention_mask)
        if not hasattr(vectors, 'astype'):
            raise PoolerError(f"pooler function {getattr(self.fn, '__name__', self.fn)!r} must "
                              f"return an array [batch, hidden], got {type(vectors).__name__}")
        return vectors.astype(jnp.float32)


def register_pooler(name: str, *, export: Optional[ExportRule] = None, hf_pooler: bool = False,
                    replace: bool = False):
    """Decorator registering a pooler: a linen Module class with fields `config` and `dtype`,
    or a plain function `fn(output: BertOutput, attention_mask) -> [B, H]`.

    Example (a user's file):
      @register_pooler('max', export=my_rule)
      def max_pool(output, mask):
          return jnp.max(jnp.where(mask[..., None] > 0, output.hidden_states[-1], -1e9), axis=1)
    """

    def add(obj):
        if inspect.isclass(obj) and issubclass(obj, nn.Module):
            build = lambda config, dtype, name: obj(config=config, dtype=dtype, name=name)  # noqa
        elif callable(obj):
            build = lambda config, dtype, name: FunctionPooler(fn=obj, name=name)  # noqa: E731
        else:
            raise PoolerError(f"pooler {name!r} must be a linen Module class or a function")
        POOLERS.register(name, replace=replace)(
            Pooler(name=name, build=build, export=export, hf_pooler=hf_pooler, source=obj))
        return obj

    return add


def get_pooler(name: str) -> Pooler:
    """The registered pooler `name`; unknown names are a PoolerError listing the known ones."""
    return POOLERS.get(name)


def masked_mean(hidden: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """Mean over real tokens. hidden [batch, len, dim], mask [batch, len] -> [batch, dim]."""
    mask = attention_mask.astype(jnp.float32)[:, :, None]
    total = jnp.sum(hidden.astype(jnp.float32) * mask, axis=1)
    # max(.., 1) keeps an all-padding row finite (zeros) instead of NaN.
    return total / jnp.maximum(jnp.sum(mask, axis=1), 1.0)


# ------------------------------------------------------------------ sentence-transformers rules
def _export_pooling(mode: str) -> ExportRule:
    def rule(params, config, use_head):
        return [st_pooling(config.hidden_size, mode)]
    return rule


# The decorators below name these two: a pooler's source, its decorator line included, is in a
# run's fingerprint (train/fingerprint.py), and an edited line makes existing runs refuse to resume.
_export_mean = _export_pooling("mean")
_export_cls_token = _export_pooling("cls")


def _export_cls(params, config, use_head):
    modules = [st_pooling(config.hidden_size, "cls")]
    if use_head:
        dense = params["dense"]
        modules.append(st_dense(dense["kernel"], dense["bias"], TANH))
    return modules


# ------------------------------------------------------------------------ the built-in poolers
@register_pooler("cls", export=_export_cls, hf_pooler=True)
class ClsPooler(nn.Module):
    """[CLS] -> dense -> tanh; with `use_head=False`, the raw [CLS] (SimCSE's mlp_only_train)."""

    config: BertConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, output: BertOutput, attention_mask, use_head: bool = True):
        cls = output.hidden_states[-1][:, 0]  # [batch, hidden]
        # Created even when skipped, so the parameter tree never depends on the mode.
        dense = nn.Dense(self.config.hidden_size, dtype=self.dtype, param_dtype=jnp.float32,
                         kernel_init=nn.initializers.normal(0.02), name="dense")
        if use_head or self.is_initializing():
            pooled = jnp.tanh(dense(cls))
            if use_head:
                cls = pooled
        return cls.astype(jnp.float32)


@register_pooler("cls_before_pooler", export=_export_cls_token)
def cls_before_pooler(output: BertOutput, attention_mask):
    """The last layer's [CLS] vector."""
    return output.hidden_states[-1][:, 0]


@register_pooler("avg", export=_export_mean)
def avg(output: BertOutput, attention_mask):
    """Mean of the last layer over real tokens."""
    return masked_mean(output.hidden_states[-1], attention_mask)


def _register_layer_average(name: str, first: int, second: int) -> None:
    def pool(output: BertOutput, attention_mask):
        # Average of the two layers' token states, then the masked mean (SimCSE's order).
        states = output.hidden_states
        mixed = (states[first].astype(jnp.float32) + states[second].astype(jnp.float32)) / 2.0
        return masked_mean(mixed, attention_mask)

    def export(params, config, use_head):
        return [st_layer_average(config.hidden_size, config.num_hidden_layers, first, second),
                st_pooling(config.hidden_size, "mean")]

    register_pooler(name, export=export)(pool)


for _name, (_first, _second) in {"avg_top2": (-2, -1), "avg_first_last": (1, -1),
                                 "avg_embed_last": (0, -1)}.items():
    _register_layer_average(_name, _first, _second)

# The poolers jaxsim itself defines (the registry may grow with user registrations).
BUILTIN_POOLERS = POOLERS.names()
