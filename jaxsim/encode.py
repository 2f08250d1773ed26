"""Fast batched sentence encoding.

Why it is fast on XLA:
  - sentences are sorted by token length, so a batch pads to little more than its own longest;
  - lengths are padded up to a few buckets (`bucket_length`) and every batch has the same row
    count, so XLA compiles only a handful of shapes, once each (the jitted function is cached);
  - tokenization of the next chunk runs in a background thread while the device computes, and
    results are fetched one batch behind dispatch, so host work overlaps device work.
"""
from __future__ import annotations

import concurrent.futures
import functools
import math
from typing import Any, Callable, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxsim.data.tokenize import TokenBatch, check_sentences, pad_batch, token_ids
from jaxsim.models.bert import BertModel
from jaxsim.models.pooling import check_pooler, pool
from jaxsim.pretrained import Pretrained

# Sentences tokenized per background job; big enough to sort well, small enough to overlap.
_CHUNK = 4096
# Inputs at least this long get a progress bar by default.
_PROGRESS_THRESHOLD = 5000


def bucket_length(n: int, max_length: int) -> int:
    """Smallest bucket >= n: multiples of 4 up to 32, of 8 up to 64, of 16 up to 128, then of 128.

    Finer buckets waste fewer padded tokens (most STS sentences are 8-30 tokens) but compile more
    programs; this grid keeps the waste under ~15% with at most ~20 shapes."""
    step = 4 if n <= 32 else 8 if n <= 64 else 16 if n <= 128 else 128
    return min(max(step, math.ceil(n / step) * step), max_length)


@functools.lru_cache(maxsize=None)
def make_encode_fn(module: BertModel, pooler: str, normalize: bool) -> Callable:
    """A jitted `(params, TokenBatch) -> [batch, hidden] float32`, cached per model/pooler."""

    def encode_batch(params, batch: TokenBatch):
        output = module.apply({"params": params}, batch.input_ids, batch.attention_mask,
                              batch.token_type_ids, deterministic=True)
        vectors = pool(pooler, output, batch.attention_mask)
        if normalize:
            vectors = vectors / jnp.maximum(jnp.linalg.norm(vectors, axis=-1, keepdims=True), 1e-12)
        return vectors

    return jax.jit(encode_batch)


def default_max_length(model: Pretrained) -> int:
    """The model's published limit, else the tokenizer's, capped by the position table."""
    limit = (model.max_seq_length or getattr(model.tokenizer, "model_max_length", None)
             or model.config.max_length)
    return int(min(limit, model.config.max_length))


def _batches(model: Pretrained, sentences: list[str], batch_size: int, max_length: int,
             executor: concurrent.futures.Executor) -> Iterator[tuple[np.ndarray, TokenBatch]]:
    """Yields (original indices, padded batch) in length-sorted order, chunk by chunk."""
    pad_id = model.tokenizer.pad_token_id or 0
    tokenize = functools.partial(token_ids, model.tokenizer, max_length=max_length)
    starts = range(0, len(sentences), _CHUNK)
    futures = [executor.submit(tokenize, sentences[s: s + _CHUNK]) for s in starts[:2]]
    for n, start in enumerate(starts):
        ids = futures[n].result()
        if n + 2 < len(starts):  # keep two chunks in flight ahead of the device
            futures.append(executor.submit(tokenize, sentences[starts[n + 2]: starts[n + 2] + _CHUNK]))
        order = np.argsort([len(s) for s in ids], kind="stable")
        for b in range(0, len(order), batch_size):
            rows = order[b: b + batch_size]
            length = bucket_length(max(len(ids[i]) for i in rows), max_length)
            yield start + rows, pad_batch([ids[i] for i in rows], pad_id, length, rows=batch_size)


def encode(model: Pretrained, sentences: Sequence[str], pooler: Optional[str] = None,
           batch_size: int = 64, max_length: Optional[int] = None, normalize: bool = False,
           progress: Optional[bool] = None, params: Any = None, dtype=jnp.float32) -> np.ndarray:
    """Encodes sentences into vectors, in input order.

    Args:
      model: a loaded encoder (`jaxsim.load_pretrained`).
      sentences: strings; empty strings are allowed, longer texts are truncated to max_length.
      pooler: one of `jaxsim.models.pooling.POOLERS`; default: the model's own (else 'avg').
      batch_size: sentences per device batch.
      max_length: token limit including special tokens; default: `default_max_length(model)`.
      normalize: L2-normalize the vectors.
      progress: show a progress bar; default: only for long inputs.
      params: parameters to use instead of `model.params` (e.g. during training).
      dtype: compute dtype (float32 or bfloat16; parameters stay float32).

    Returns:
      float32 array [len(sentences), hidden].
    """
    items = check_sentences(sentences)
    pooler = pooler or model.default_pooler or "avg"
    check_pooler(pooler, model.has_pooler)
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    max_length = default_max_length(model) if max_length is None else int(max_length)
    if not 2 <= max_length <= model.config.max_length:
        raise ValueError(f"max_length must be in [2, {model.config.max_length}], got {max_length}")
    hidden = model.config.hidden_size
    if not items:
        return np.zeros((0, hidden), np.float32)
    # Committed device arrays: numpy leaves would be copied to the device on every batch.
    params = jax.device_put(model.params if params is None else params)
    if dtype != jnp.float32:
        # Cast once here rather than inside every jitted call (22M weights per batch otherwise).
        params = jax.tree.map(lambda p: p.astype(dtype), params)
    module = BertModel(model.config, dtype=dtype, add_pooler="pooler" in params)
    encode_batch = make_encode_fn(module, pooler, normalize)

    out = np.empty((len(items), hidden), np.float32)
    show = len(items) >= _PROGRESS_THRESHOLD if progress is None else progress
    from tqdm.auto import tqdm
    bar = tqdm(total=len(items), unit="sent", disable=not show, desc="encode")
    pending = None  # (indices, device result) of the previous batch: fetched after the next dispatch
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as executor:
        for indices, batch in _batches(model, items, batch_size, max_length, executor):
            result = encode_batch(params, batch)
            if pending is not None:
                out[pending[0]] = np.asarray(pending[1])[: len(pending[0])]
                bar.update(len(pending[0]))
            pending = (indices, result)
        out[pending[0]] = np.asarray(pending[1])[: len(pending[0])]
        bar.update(len(pending[0]))
    bar.close()
    return out
