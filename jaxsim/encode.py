"""The one encode path: sentences -> vectors, batched, jitted and sharded over a device mesh.

Why it is fast on XLA (docs/encoding.md): length-sorted sentences padded to a few buckets
(`jaxsim.data.encode_layout`), so few compiled shapes; the next chunk tokenized in a
background thread and the next batch placed while the previous one runs; each batch split
over the mesh's data axes.
"""
from __future__ import annotations

import collections
import concurrent.futures
import functools
from typing import Any, Callable, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsim import sharding as sharding_lib
from jaxsim.cpu import warn_if_bf16_emulated
from jaxsim.data import encode_layout
from jaxsim.data.tokenize import TokenBatch, check_sentences, token_ids
from jaxsim.errors import JaxsimError
from jaxsim.model import SentenceModel
from jaxsim.models.encoder import SentenceEncoder
from jaxsim.models.st_head import Normalize, apply_head, output_size
from jaxsim.progress import progress_bar

# Sentences tokenized per background job; big enough to sort well, small enough to overlap.
_CHUNK = 4096
# Inputs at least this long get a progress bar by default.
_PROGRESS_THRESHOLD = 5000
# encode(sentences) -> [n, dim] float32: what evaluation and the search service call.
EncodeFn = Callable[[list[str]], np.ndarray]


class NonFiniteVectorsError(JaxsimError):
    """A model that gave NaN / inf vectors (e.g. diverged or corrupted weights)."""


def check_finite(vectors: np.ndarray, sentences: Sequence[str], model: str) -> None:
    """Raises NonFiniteVectorsError naming the first sentence whose vector is not finite."""
    bad = ~np.isfinite(vectors).all(axis=1)
    if bad.any():
        first = int(np.argmax(bad))
        text = sentences[first] if len(sentences[first]) <= 80 else sentences[first][:77] + "..."
        raise NonFiniteVectorsError(
            f"{model} gives non-finite (NaN/inf) vectors for {int(bad.sum())} of {len(bad)} "
            f"sentences, the first for sentence {first + 1}: {text!r}; its weights are probably "
            f"NaN or inf")


@functools.lru_cache(maxsize=None)
def make_encode_fn(encoder: SentenceEncoder, normalize: bool, train: bool,
                   mesh: Mesh) -> Callable:
    """A jitted `(params, TokenBatch, key) -> [batch, hidden]`, replicated output, cached."""
    replicated = NamedSharding(mesh, P())

    def encode_batch(params, batch: TokenBatch, key):
        rngs = {"dropout": key} if train else {}
        vectors = encoder.apply({"params": params}, batch.input_ids, batch.attention_mask,
                                batch.token_type_ids, train=train, rngs=rngs)
        if normalize:
            vectors = vectors / jnp.maximum(jnp.linalg.norm(vectors, axis=-1, keepdims=True),
                                            1e-12)
        return jax.lax.with_sharding_constraint(vectors, replicated)

    return jax.jit(encode_batch, out_shardings=replicated)


def default_mesh() -> Mesh:
    """All devices on the data axis (every process must then encode the same sentences)."""
    return sharding_lib.make_mesh()


def _place_params(params: Any, mesh: Mesh) -> Any:
    """Params on the mesh by the rules table (replicated unless fsdp/tensor axes > 1).

    Arrays already placed that way (training state) are not copied."""
    def put(x, sharding):
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        if isinstance(x, jax.Array) and x.is_fully_addressable:
            return jax.device_put(x, sharding)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    return jax.tree.map(put, params,
                        sharding_lib.named(mesh, sharding_lib.param_specs(params, mesh)))


def _to_mesh(tree: Any, mesh: Mesh) -> Any:
    """Host arrays [batch, ...] split over the mesh's batch axes."""
    def put(x):
        sharding = sharding_lib.batch_sharding(mesh, x.ndim)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    return jax.tree.map(put, tree)


def _batches(model: SentenceModel, sentences: list[str], batch_size: int, max_length: int,
             executor: concurrent.futures.Executor, shards: int = 1,
             budget: Optional[int] = None) -> Iterator[tuple[np.ndarray, encode_layout.Batch]]:
    """Yields (the sentence index of each padded row, -1 for padding; the batch), chunk by
    chunk, each chunk's batches planned while the devices encode the previous ones."""
    def plan(chunk: list[str]) -> list[encode_layout.Batch]:  # in the background thread
        ids = token_ids(model.tokenizer, chunk, max_length=max_length)
        return encode_layout.plan_batches(ids, model.config.pad_token_id, batch_size,
                                          max_length, shards, budget)

    starts = range(0, len(sentences), _CHUNK)
    futures = [executor.submit(plan, sentences[s: s + _CHUNK]) for s in starts[:2]]
    for n, start in enumerate(starts):
        batches = futures[n].result()
        if n + 2 < len(starts):  # keep two chunks in flight ahead of the devices
            nxt = starts[n + 2]
            futures.append(executor.submit(plan, sentences[nxt: nxt + _CHUNK]))
        for batch in batches:
            yield np.where(batch.indices >= 0, start + batch.indices, -1), batch


def _store(out: np.ndarray, indices: np.ndarray, vectors: jax.Array, bar) -> None:
    """Copies a batch's vectors (padding rows dropped) into their sentences' rows of `out`."""
    real = indices >= 0
    out[indices[real]] = np.asarray(vectors)[real]
    bar.update(int(real.sum()))


def encode(model: SentenceModel, sentences: Sequence[str], *, pooler: Optional[str] = None,
           batch_size: int = 64, max_length: Optional[int] = None, normalize: bool = False,
           progress: Optional[bool] = None, params: Any = None, dtype=jnp.float32,
           mesh: Optional[Mesh] = None, dropout_key: Optional[jax.Array] = None,
           finite: bool = True) -> np.ndarray:
    """Encodes sentences into vectors, in input order.

    Args:
      model: a loaded encoder (`jaxsim.load_pretrained`).
      sentences: strings; empty strings are allowed, longer texts are truncated to max_length.
      pooler: a registered pooler name; default: the model's own.
      batch_size: sentences per global batch at most (rounded up to a multiple of the mesh's
        batch shards); on CPU, long ones get fewer (`encode_layout.CPU_TOKENS_PER_BATCH`).
      max_length: token limit including special tokens; default: `model.max_length()`.
      normalize: L2-normalize the vectors (after the model's own head, if any).
      progress: show progress (a bar on a terminal, else periodic lines on stderr); default:
        only for long inputs.
      params: parameters to use instead of `model.params` (e.g. a training state's).
      dtype: compute dtype (float32 or bfloat16; parameters stay float32).
      mesh: devices to encode on, the batch split over its data axes (default: all devices).
      dropout_key: encode in training mode (dropout on, the pooler's head applied) with
        per-batch keys folded from this one; None encodes deterministically.
      finite: raise NonFiniteVectorsError, naming the first sentence, when a vector holds NaN
        or inf (False returns them as they are).

    Returns:
      float32 array [len(sentences), hidden].
    """
    items = check_sentences(sentences)
    if pooler is not None:
        model = model.with_pooler(pooler)
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    max_length = model.max_length() if max_length is None else int(max_length)
    if not 2 <= max_length <= model.config.max_length:
        raise ValueError(f"max_length must be in [2, {model.config.max_length}], got {max_length}")
    if not items:
        return np.zeros((0, output_size(model.head, model.hidden_size)), np.float32)
    mesh = default_mesh() if mesh is None else mesh
    warn_if_bf16_emulated(dtype, {d.platform for d in mesh.devices.flat})
    shards = sharding_lib.batch_shards(mesh)
    batch_size = -(-batch_size // shards) * shards
    params = _place_params(model.params if params is None else params, mesh)
    if dtype != jnp.float32:
        # Cast once here rather than inside every jitted call.
        params = jax.tree.map(lambda p: p.astype(dtype), params)
    encoder = model.encoder.clone(dtype=dtype)
    train = dropout_key is not None
    # With a head, normalizing comes after it (on the host, as the head runs there).
    encode_batch = make_encode_fn(encoder, normalize and not model.head, train, mesh)
    key = dropout_key if train else jax.random.key(0)

    out = np.empty((len(items), model.hidden_size), np.float32)
    show = len(items) >= _PROGRESS_THRESHOLD if progress is None else progress
    bar = progress_bar(len(items), "encode", unit="sent", enable=show)
    in_flight: collections.deque = collections.deque()  # (indices, vectors being computed)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as executor:
        batches = _batches(model, items, batch_size, max_length, executor, shards,
                           encode_layout.token_budget(mesh, shards))
        for n, (indices, batch) in enumerate(batches):
            # Only dropout reads the key: deterministic batches share one.
            batch_key = jax.random.fold_in(key, n) if train else key
            # Dispatched asynchronously: the next batch is placed while this one runs.
            in_flight.append((indices, encode_batch(params, _to_mesh(batch.tokens, mesh),
                                                    batch_key)))
            if len(in_flight) > 1:
                _store(out, *in_flight.popleft(), bar)
        while in_flight:
            _store(out, *in_flight.popleft(), bar)
    bar.close()
    if model.head:  # a sentence-transformers folder's Dense / Normalize, as it applies them
        out = apply_head(model.head + ((Normalize(),) if normalize else ()), out)
    if finite:
        check_finite(out, items, model.path or "the model")
    return out
