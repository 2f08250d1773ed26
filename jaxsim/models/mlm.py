"""Masked-language-model head and masking, for SimCSE's auxiliary MLM objective (`--do_mlm`).

The head is BERT's LM prediction head: dense -> activation -> LayerNorm, then logits against the
(tied) word-embedding matrix plus a per-token bias, as `BertForMaskedLM` / `RobertaForMaskedLM`
compute them. Masking follows BERT (and transformers' `DataCollatorForLanguageModeling`): 15%
of the real, non-special tokens are chosen; of those 80% become [MASK], 10% a random token and
10% stay; only chosen positions carry a label.
"""
from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxsim.models.bert import _ACTIVATIONS, BertConfig, _layer_norm

IGNORE = -100  # label of positions that carry no MLM loss


class MlmHead(nn.Module):
    """Hidden states [B, L, H] + word embeddings [V, H] -> logits [B, L, V] (float32).

    Parameter names follow the Hugging Face heads: BERT `cls.predictions.transform.dense`,
    `.transform.LayerNorm`, `.bias`; RoBERTa `lm_head.dense`, `lm_head.layer_norm`, `lm_head.bias`
    (both map to this one tree in `jaxsim.formats.hf`).
    """

    config: BertConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, hidden: jax.Array, word_embeddings: jax.Array) -> jax.Array:
        cfg = self.config
        x = nn.Dense(cfg.hidden_size, dtype=self.dtype, param_dtype=jnp.float32,
                     kernel_init=nn.initializers.normal(0.02), name="dense")(hidden)
        # RoBERTa's head always uses exact GELU; BERT's uses the config's activation.
        act = "gelu" if cfg.model_type == "roberta" else cfg.hidden_act
        x = _ACTIVATIONS[act](x)
        x = _layer_norm(cfg, self.dtype)(x)
        bias = self.param("bias", nn.initializers.zeros, (cfg.vocab_size,), jnp.float32)
        logits = jnp.einsum("blh,vh->blv", x.astype(jnp.float32),
                            word_embeddings.astype(jnp.float32))
        return logits + bias


def mask_tokens(key: jax.Array, input_ids: jax.Array, attention_mask: jax.Array,
                special_ids: Sequence[int], mask_id: int, vocab_size: int,
                probability: float = 0.15) -> tuple[jax.Array, jax.Array]:
    """BERT masking of a batch.

    Args:
      key: PRNG key.
      input_ids: [..., L] int32.
      attention_mask: [..., L], 1 = real token.
      special_ids: ids never chosen ([CLS], [SEP], padding...).
      mask_id: the [MASK] id.
      vocab_size: random replacements are drawn from [0, vocab_size).
      probability: share of eligible tokens chosen.

    Returns:
      (masked input ids, labels): labels hold the original id at chosen positions and IGNORE
      elsewhere.
    """
    k_choose, k_kind, k_random = jax.random.split(key, 3)
    eligible = attention_mask.astype(bool)
    for sid in special_ids:
        eligible &= input_ids != sid
    chosen = eligible & (jax.random.uniform(k_choose, input_ids.shape) < probability)
    kind = jax.random.uniform(k_kind, input_ids.shape)
    random_ids = jax.random.randint(k_random, input_ids.shape, 0, vocab_size, input_ids.dtype)
    masked = jnp.where(chosen & (kind < 0.8), mask_id, input_ids)
    masked = jnp.where(chosen & (kind >= 0.8) & (kind < 0.9), random_ids, masked)
    labels = jnp.where(chosen, input_ids, IGNORE)
    return masked, labels


def mlm_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean cross-entropy over labelled positions (0 when none is labelled).

    logits [..., L, V], labels [..., L] with IGNORE for unlabelled positions.
    """
    valid = labels != IGNORE
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, jnp.where(valid, labels, 0)[..., None], axis=-1)[..., 0]
    return -jnp.sum(jnp.where(valid, picked, 0.0)) / jnp.maximum(jnp.sum(valid), 1)
