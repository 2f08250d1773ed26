"""SentenceEncoder: BERT/RoBERTa encoder + registered pooler, one module and one param tree.

Training, encoding, evaluation, checkpoints and export all use this module, so a trained model
is used exactly as it was trained. Parameter tree:
  {'bert': BertModel params (without BERT's pooler layer),
   'pooler': the pooler's own parameters (only for poolers that have some, e.g. 'cls'),
   'mlm_head': the masked-LM head (only with `mlm=True`: SimCSE's auxiliary MLM objective)}
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from jaxsim.errors import running_user_code
from jaxsim.models.bert import BertConfig, BertModel
from jaxsim.models.mlm import MlmHead
from jaxsim.models.poolers import PoolerError, get_pooler

# Parameter subtrees a model may carry without using them for its vectors: another pooler's
# weights (e.g. BERT's own pooler layer under an 'avg' model) and a training-only MLM head.
_OPTIONAL_SUBTREES = ("pooler/", "mlm_head/")


class SentenceEncoder(nn.Module):
    """Token ids -> sentence vectors.

    Attributes:
      config: encoder architecture.
      pooler: a name registered in `jaxsim.models.poolers.POOLERS`.
      mlp_only_train: apply the pooler's head (the 'cls' dense + tanh) only in training, as
        SimCSE's unsupervised recipe does; evaluation then uses the raw [CLS].
      dtype: compute dtype (float32, or bfloat16 with float32 parameters).
      mlm: also create the masked-LM head's parameters (see `mlm_logits`); the vectors do not
        use it.
      remat: activation recomputation per transformer layer in training ('none', 'full',
        'dots'; see `jaxsim.models.bert.remat_layer`): memory for compute, same numbers.
      kernels: 'auto', 'xla' or 'cpu': the form of the layers' hot operations
        (`jaxsim.models.kernels`): the same function, laid out for TPU/GPU or for XLA:CPU.
    """

    config: BertConfig
    pooler: str = "avg"
    mlp_only_train: bool = False
    dtype: Any = jnp.float32
    mlm: bool = False
    remat: str = "none"
    kernels: str = "auto"

    @nn.compact
    def __call__(self, input_ids, attention_mask, token_type_ids=None, train: bool = False,
                 packing=None):
        """Sentence vectors.

        Args:
          input_ids: [batch, len] int32.
          attention_mask: [batch, len] int32, 1 = real token.
          token_type_ids: [batch, len] int32, or None for zeros.
          train: dropout on (pass `rngs={'dropout': key}`) and the head always applied.
          packing: None, or the packed layout of these rows (see `BertModel`): the same
            vectors, computed without the padding (only the dropout masks differ).

        Returns:
          [batch, hidden] float32.
        """
        bert = BertModel(self.config, dtype=self.dtype, add_pooler=False, remat=self.remat,
                         kernels=self.kernels, name="bert")
        pooler = get_pooler(self.pooler)
        pooling = pooler.build(self.config, self.dtype, "pooler")
        output = bert(input_ids, attention_mask, token_type_ids, deterministic=not train,
                      packing=packing)
        if self.mlm and self.is_initializing():
            word_embeddings = bert.variables["params"]["embeddings"]["word_embeddings"]
            MlmHead(self.config, self.dtype, name="mlm_head")(output.hidden_states[-1],
                                                             word_embeddings["embedding"])
        with running_user_code(f'pooler {self.pooler!r}', pooler.source):
            vectors = pooling(output, attention_mask, use_head=train or not self.mlp_only_train)
        shape = getattr(vectors, 'shape', None)
        if shape is None or len(shape) != 2 or shape[0] != input_ids.shape[0]:
            got = f'shape {tuple(shape)}' if shape is not None else type(vectors).__name__
            raise PoolerError(f"pooler {self.pooler!r} must return one vector a sentence, "
                              f"[{input_ids.shape[0]}, hidden], got {got}")
        return vectors


def mlm_logits(encoder: SentenceEncoder, params: Mapping, input_ids, attention_mask,
               token_type_ids, key: jax.Array) -> jax.Array:
    """Masked-LM logits [batch, len, vocab] (float32), in training mode (dropout from `key`).

    The same BERT weights as the vectors, then the MLM head against the tied word embeddings.
    """
    bert = BertModel(encoder.config, dtype=encoder.dtype, add_pooler=False, remat=encoder.remat)
    output = bert.apply({"params": params["bert"]}, input_ids, attention_mask, token_type_ids,
                        deterministic=False, rngs={"dropout": key})
    embeddings = params["bert"]["embeddings"]["word_embeddings"]["embedding"]
    return MlmHead(encoder.config, encoder.dtype).apply(
        {"params": params["mlm_head"]}, output.hidden_states[-1], embeddings)


def param_shapes(encoder: SentenceEncoder) -> dict:
    """The parameter tree of `encoder` as ShapeDtypeStructs (nothing allocated or compiled)."""
    ids = jnp.zeros((1, 2), jnp.int32)
    return jax.eval_shape(lambda: encoder.init(jax.random.key(0), ids, ids))["params"]


def check_params(encoder: SentenceEncoder, params: Mapping, source: str,
                 shapes: Optional[Mapping] = None) -> None:
    """Raises PoolerError naming every missing, unexpected or mis-shaped parameter (against
    `shapes`, the encoder's param_shapes when already computed).

    A pooler with parameters (e.g. 'cls') on a model that has none is reported as such.
    """
    shapes = param_shapes(encoder) if shapes is None else shapes
    expected = traverse_util.flatten_dict(dict(shapes), sep="/")
    got = traverse_util.flatten_dict(dict(params), sep="/")
    missing = [k for k in expected if k not in got]
    if missing and all(k.startswith("pooler/") for k in missing) and not any(
            k.startswith("pooler/") for k in got):
        raise PoolerError(f"{source}: pooler {encoder.pooler!r} needs parameters this model does "
                          f"not have ({', '.join(missing)}); use 'cls_before_pooler' or an "
                          f"average pooler")
    problems = [f"missing {k} {tuple(expected[k].shape)}" for k in missing]
    problems += [f"unexpected {k}" for k in got if k not in expected
                 and not k.startswith(_OPTIONAL_SUBTREES)]
    problems += [f"{k} has shape {tuple(got[k].shape)}, expected {tuple(expected[k].shape)}"
                 for k in expected if k in got and tuple(got[k].shape) != tuple(expected[k].shape)]
    if problems:
        raise PoolerError(f"{source}: parameters do not fit the model ({encoder.config.model_type}"
                          f", {encoder.config.num_hidden_layers} layers, hidden "
                          f"{encoder.config.hidden_size}, pooler {encoder.pooler!r}): "
                          + "; ".join(problems[:8])
                          + (f"; ... {len(problems) - 8} more" if len(problems) > 8 else ""))


def init_fn(encoder: SentenceEncoder, skip: Sequence[str] = ()) -> Callable[[jax.Array], dict]:
    """key -> the encoder's random initial parameters, without the top-level subtrees in `skip`.

    The values are those of the full `encoder.init` for the same key (each module draws from its
    own folded key). Under jit, a skipped subtree is not computed at all: it is not an output, so
    XLA drops its initializers (and the forward pass `init` runs).
    """
    ids = jnp.zeros((1, 2), jnp.int32)

    def init(key: jax.Array) -> dict:
        params = encoder.init(key, ids, ids)["params"]
        return {name: tree for name, tree in params.items() if name not in skip}

    return init


def _place(values: Mapping, shardings: Optional[Mapping]) -> dict:
    """Places host arrays (held in full by every process) with `shardings` (None: default
    device), as float32."""
    where = traverse_util.flatten_dict(dict(shardings)) if shardings is not None else {}
    placed = {}
    for path, value in traverse_util.flatten_dict(dict(values)).items():
        host = np.asarray(value, np.float32)
        placed[path] = (jax.device_put(host) if shardings is None else
                        jax.make_array_from_callback(host.shape, where[path],
                                                     lambda idx, host=host: host[idx]))
    return traverse_util.unflatten_dict(placed)


def init_params(encoder: SentenceEncoder, key: jax.Array, shardings: Optional[Any] = None,
                bert_params: Optional[Mapping] = None,
                mlm_params: Optional[Mapping] = None) -> dict:
    """Initial parameters, created where they live by each module's own initializers.

    Only the subtrees not supplied are drawn; their values do not depend on what is supplied.

    Args:
      encoder: the module.
      key: PRNG key of the 'init' use.
      shardings: a tree of NamedShardings matching the param tree (None: default device).
      bert_params: pretrained encoder weights for the 'bert' subtree (the pooler keeps its
        fresh initialization, as SimCSE starts its MLP head from scratch).
      mlm_params: pretrained masked-LM head for the 'mlm_head' subtree (ignored without `mlm`).

    Returns:
      The param tree of jax.Arrays.

    Raises:
      PoolerError: supplied weights that do not fit the model.
    """
    shapes = param_shapes(encoder)
    supplied = {name: tree for name, tree in (("bert", bert_params), ("mlm_head", mlm_params))
                if tree is not None and name in shapes}
    check_params(encoder, {**shapes, **supplied}, "pretrained encoder", shapes)
    drawn = [name for name in shapes if name not in supplied]
    params = {}
    if drawn:
        out_shardings = None if shardings is None else {name: shardings[name] for name in drawn}
        params = jax.jit(init_fn(encoder, skip=tuple(supplied)),
                         out_shardings=out_shardings)(key)
    for name, values in supplied.items():
        params[name] = _place(values, None if shardings is None else shardings[name])
    return {name: params[name] for name in shapes}
