"""The SimCSE model: BERT encoder + sentence pooler + MLP head (dense + tanh over CLS).

Parameter tree: `{'encoder': <BertModel params, no pooler>,
                 'mlp': {'kernel': [H, H], 'bias': [H]}}`.
The head is used in training when the pooler is 'cls'. At evaluation it is kept unless
`mlp_only_train` (the reference's flag for unsupervised runs, which then evaluate with
'cls_before_pooler'). Exported, the head becomes BERT's pooler dense, so 'cls' at evaluation
time is exactly "CLS -> MLP" (reference: princeton-nlp/SimCSE `simcse_to_huggingface.py`).
"""
from __future__ import annotations

from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from jaxsim.models.bert import BertConfig, BertModel, BertOutput
from jaxsim.models.pooling import POOLERS, pool


class SimCSEModel(nn.Module):
    """Encoder + pooler + optional MLP head.

    Attributes:
      config: encoder architecture.
      pooler: one of `jaxsim.models.pooling.POOLERS`.
      mlp_only_train: with pooler 'cls', drop the head at evaluation (unsupervised SimCSE).
      dtype: compute dtype (float32 or bfloat16); parameters stay float32.
    """

    config: BertConfig
    pooler: str = 'cls'
    mlp_only_train: bool = False
    dtype: Any = jnp.float32

    def setup(self):
        if self.pooler not in POOLERS:
            raise ValueError(f'unknown pooler {self.pooler!r}; choose one of {POOLERS}')
        self.encoder = BertModel(self.config, dtype=self.dtype, add_pooler=False)
        # Fresh head with BERT's N(0, 0.02) init, as the reference's `init_weights()`.
        self.mlp = nn.Dense(self.config.hidden_size, dtype=self.dtype, param_dtype=jnp.float32,
                            kernel_init=nn.initializers.normal(0.02), name='mlp')

    def uses_mlp(self, train: bool) -> bool:
        """Whether the head is applied (reference `cl_forward` / `sentemb_forward`)."""
        return self.pooler == 'cls' and (train or not self.mlp_only_train)

    def __call__(self, input_ids, attention_mask, token_type_ids=None, train: bool = False):
        """Sentence embeddings.

        Args:
          input_ids: [batch, len] int32.
          attention_mask: [batch, len] int32, 1 = real token.
          token_type_ids: [batch, len] int32 or None.
          train: dropout on (needs `rngs={'dropout': key}`) and the head used for 'cls'.

        Returns:
          [batch, hidden] float32 embeddings.
        """
        out: BertOutput = self.encoder(input_ids, attention_mask, token_type_ids,
                                       deterministic=not train)
        if self.is_initializing():
            # The head always exists in the tree (fixed layout for checkpoints and export),
            # even when this pooler never applies it.
            self.mlp(out.hidden_states[-1][:, 0])
        if self.pooler in ('cls', 'cls_before_pooler'):
            z = out.hidden_states[-1][:, 0]  # [batch, hidden]
            if self.uses_mlp(train):
                z = jnp.tanh(self.mlp(z))
            return z.astype(jnp.float32)
        return pool(self.pooler, out, attention_mask)


def eval_pooler(pooler: str, mlp_only_train: bool) -> str:
    """The pooler name an exported checkpoint is evaluated with (head folded into 'pooler')."""
    if pooler == 'cls' and mlp_only_train:
        return 'cls_before_pooler'
    return pooler


def init_params(model: SimCSEModel, rng: jax.Array, encoder_params: Mapping | None = None):
    """Initial parameters; the encoder part comes from `encoder_params` when given.

    Random values follow BERT's init (the reference's `init_weights()`): N(0, 0.02) for
    kernels and embeddings, zeros for biases, ones for LayerNorm scales. They are drawn with
    NumPy from the key's data: the tree structure comes from `jax.eval_shape`, so no XLA
    compilation is needed (a jitted `init` of even a tiny BERT compiles for seconds on CPU).

    Args:
      model: the module.
      rng: PRNG key for the head (and the encoder when `encoder_params` is None).
      encoder_params: pretrained `BertModel` params; a 'pooler' entry is dropped (the reference
        builds BertModel with `add_pooling_layer=False` and a fresh MLP).

    Returns:
      `{'encoder': ..., 'mlp': ...}` float32 numpy params.
    """
    ids = jnp.zeros((1, 4), jnp.int32)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, jnp.ones_like(ids)))
    flat = traverse_util.flatten_dict(dict(shapes['params']), sep='/')
    gen = np.random.default_rng(np.asarray(jax.random.key_data(rng)).ravel().tolist())
    params = {}
    for path, leaf in sorted(flat.items()):
        if path.endswith('bias'):
            params[path] = np.zeros(leaf.shape, np.float32)
        elif path.endswith('scale'):
            params[path] = np.ones(leaf.shape, np.float32)
        else:
            params[path] = (0.02 * gen.standard_normal(leaf.shape)).astype(np.float32)
    params = traverse_util.unflatten_dict(params, sep='/')
    if encoder_params is not None:
        enc = {k: v for k, v in dict(encoder_params).items() if k != 'pooler'}
        expected = traverse_util.flatten_dict(params['encoder'], sep='/')
        got = traverse_util.flatten_dict(enc, sep='/')
        for name in sorted(set(expected) | set(got)):
            if name not in got or name not in expected or \
                    tuple(got[name].shape) != expected[name].shape:
                raise ValueError(
                    f'pretrained encoder param {name!r} does not fit the model config: '
                    f'expected {getattr(expected.get(name), "shape", None)}, '
                    f'got {getattr(got.get(name), "shape", None)}')
        params['encoder'] = jax.tree.map(lambda x: np.asarray(x, np.float32), enc)
    return params


def to_bert_params(params: Mapping) -> dict:
    """SimCSE params -> `BertModel(add_pooler=True)` params with the head as the pooler dense."""
    enc = dict(params['encoder'])
    enc['pooler'] = {'dense': dict(params['mlp'])}
    return enc
