"""SimCSE's auxiliary masked-language-model term (`--do_mlm`, weight `mlm_weight`).

The reference adds `mlm_weight * MLM loss` to the contrastive loss, the MLM loss computed on
BERT-masked copies of the same batch's sentences (every view, each masked independently)
through the same encoder and an LM head. The term is an add-on of the train step, so any
objective can have it: a config turns it on with `mlm_weight > 0`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from jaxsim.models.encoder import SentenceEncoder, mlm_logits
from jaxsim.models.mlm import mask_tokens, mlm_loss


@dataclasses.dataclass(frozen=True)
class MlmSettings:
    """What the MLM term needs besides the batch.

    Attributes:
      weight: its weight in the total loss (0.1 in the SimCSE paper).
      probability: share of real, non-special tokens masked (BERT's 0.15).
      special_ids: token ids never masked ([CLS], [SEP], padding ...).
      mask_id: the [MASK] token id.
      vocab_size: random replacements are drawn below it.
    """

    weight: float
    probability: float
    special_ids: tuple[int, ...]
    mask_id: int
    vocab_size: int

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, weight: float, probability: float,
                       vocab_size: int) -> "MlmSettings":
        if tokenizer.mask_token_id is None:
            raise ValueError("the MLM term needs a tokenizer with a mask token")
        return cls(weight=float(weight), probability=float(probability),
                   special_ids=tuple(sorted(set(int(i) for i in tokenizer.all_special_ids))),
                   mask_id=int(tokenizer.mask_token_id), vocab_size=int(vocab_size))


def mlm_term(encoder: SentenceEncoder, params: Any, arrays: Mapping[str, jax.Array],
             key: jax.Array, settings: MlmSettings) -> jax.Array:
    """Mean masked-LM cross-entropy over one batch of [rows, len] `arrays` ('input_ids',
    'attention_mask', 'token_type_ids'), through `encoder` built with `mlm=True`; `key` draws
    the masking and the dropout."""
    k_mask, k_dropout = jax.random.split(key)
    ids, mask = arrays["input_ids"], arrays["attention_mask"]
    masked, labels = mask_tokens(k_mask, ids, mask, settings.special_ids, settings.mask_id,
                                 settings.vocab_size, settings.probability)
    logits = mlm_logits(encoder, params, masked, mask, arrays["token_type_ids"], k_dropout)
    return mlm_loss(logits, labels).astype(jnp.float32)
