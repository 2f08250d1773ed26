"""The one tokenize/pad path: host-side tokenization to padded int32 NumPy batches."""
from __future__ import annotations

import math
from typing import Sequence

import flax.struct
import numpy as np

from jaxsim.errors import JaxsimError


class TokenizeError(JaxsimError):
    """Token ids that cannot be padded as asked."""


class TokenBatch(flax.struct.PyTreeNode):
    """A padded batch of token ids, all [batch, len] int32."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    token_type_ids: np.ndarray


def bucket_length(n: int, max_length: int) -> int:
    """Smallest bucket >= n: multiples of 4 up to 32, of 8 up to 64, of 16 up to 128, then 128.

    Finer buckets waste fewer padded tokens (most STS sentences are 8-30 tokens) but compile more
    programs; this grid keeps the waste under ~15% with at most ~20 shapes."""
    step = 4 if n <= 32 else 8 if n <= 64 else 16 if n <= 128 else 128
    return min(max(step, math.ceil(n / step) * step), max_length)


def check_sentences(sentences: Sequence, what: str = "sentences") -> list[str]:
    """Returns `sentences` as a list, raising TypeError naming the first non-string item."""
    if isinstance(sentences, str):
        raise TypeError(f"{what} must be a sequence of strings, not a single string")
    items = list(sentences)
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise TypeError(f"{what}[{i}] is a {type(s).__name__}, not a string: {s!r:.80}")
    return items


def token_ids(tokenizer, sentences: Sequence[str], max_length: int) -> list[list[int]]:
    """Token ids with special tokens, truncated to `max_length` (no padding)."""
    encoded = tokenizer(list(sentences), add_special_tokens=True, truncation=True,
                        max_length=max_length, padding=False, return_attention_mask=False,
                        return_token_type_ids=False)
    return encoded["input_ids"]


def pad_batch(ids: Sequence[Sequence[int]], pad_id: int, length: int,
              rows: int | None = None) -> TokenBatch:
    """Pads token id lists to [rows, length]; extra rows (beyond len(ids)) are all padding."""
    rows = len(ids) if rows is None else rows
    input_ids = np.full((rows, length), pad_id, dtype=np.int32)
    mask = np.zeros((rows, length), dtype=np.int32)
    for i, seq in enumerate(ids):
        input_ids[i, : len(seq)] = seq
        mask[i, : len(seq)] = 1
    # Single-segment input: segment 0 everywhere (BERT's token_type_ids for one sentence).
    return TokenBatch(input_ids=input_ids, attention_mask=mask,
                      token_type_ids=np.zeros_like(input_ids))


def tokenize(tokenizer, sentences: Sequence[str], max_length: int,
             pad_to: int | None = None) -> TokenBatch:
    """Tokenizes and pads to `pad_to` (default: the longest sequence). Empty strings are fine."""
    ids = token_ids(tokenizer, check_sentences(sentences), max_length)
    length = pad_to if pad_to is not None else max(len(s) for s in ids)
    if any(len(s) > length for s in ids):
        raise TokenizeError(f"pad_to={length} is shorter than a tokenized sentence")
    return pad_batch(ids, tokenizer.pad_token_id or 0, length)
