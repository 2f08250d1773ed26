"""The one encode path: sentences -> vectors, batched, jitted and sharded over a device mesh.

`jaxsim.encode`, evaluation, the dev evaluation inside training, search and flow fitting all
call `encode`. Why it is fast on XLA:
  - short sentences of mixed lengths are packed end to end in rows, attention kept within each
    sentence, so almost no padding is computed; otherwise sentences are sorted by token
    length, so a batch pads to little more than its own longest (`jaxsim.data.encode_layout`
    plans either, per chunk, whichever computes fewer tokens);
  - lengths are padded up to a few buckets (`bucket_length`) and every batch of a bucket has
    the same row count (a packed chunk: one shape), so XLA compiles only a handful of shapes,
    once each (the jitted function is cached);
  - on CPU a batch holds at most `CPU_TOKENS_PER_BATCH` padded tokens (fewer rows for long
    texts), so the layer's intermediates stay in cache;
  - tokenization of the next chunk runs in a background thread while the devices compute, and
    the next batch is placed while the previous ones run, so host work overlaps device work;
  - on a single CPU device two batches run at once (`concurrent_batches`);
  - each batch is split over the mesh's data axes, so every device encodes its share.
"""
from __future__ import annotations

import collections
import concurrent.futures
import functools
from typing import Any, Callable, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
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
# XLA:CPU only: padded tokens per batch at most (rows are cut for long buckets). XLA:CPU runs
# each layer's products and elementwise work over the whole batch, so the [tokens, 4 * hidden]
# float32 intermediate of a 64 x 128 batch (50 MB for MiniLM) streams through memory; at 1,024
# tokens it stays in cache. all-MiniLM-L6-v2, 2 threads, process CPU time for 64 texts of
# 96-128 tokens: bf16 1186 ms at 64 rows a batch, 697 at 16, 626 at 8; float32 2785 / 1946
# (8 rows). Accelerators want big batches: they keep `batch_size`.
CPU_TOKENS_PER_BATCH = 1024


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
    """A jitted `(params, TokenBatch, key, packing=None) -> [batch, hidden]` (packing: the
    batch's packed layout, see `jaxsim.data.encode_layout`), replicated output, cached."""
    replicated = NamedSharding(mesh, P())

    def encode_batch(params, batch: TokenBatch, key, packing=None):
        rngs = {"dropout": key} if train else {}
        vectors = encoder.apply({"params": params}, batch.input_ids, batch.attention_mask,
                                batch.token_type_ids, train=train, rngs=rngs, packing=packing)
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
    specs = sharding_lib.param_specs(params, mesh)

    def put(x, spec):
        sharding = NamedSharding(mesh, spec)
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        if isinstance(x, jax.Array) and x.is_fully_addressable:
            return jax.device_put(x, sharding)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    return jax.tree.map(put, params, specs, is_leaf=lambda x: isinstance(x, P))


def _to_mesh(tree: Any, mesh: Mesh) -> Any:
    """Host arrays [batch, ...] split over the mesh's batch axes."""
    def put(x):
        sharding = sharding_lib.batch_sharding(mesh, x.ndim)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    return jax.tree.map(put, tree)


def token_budget(mesh: Mesh) -> Optional[int]:
    """Padded tokens per global batch at most: `CPU_TOKENS_PER_BATCH` per batch shard on CPU
    devices (XLA:CPU-only, see there), None (no limit) on accelerators."""
    if any(d.platform != "cpu" for d in mesh.devices.flat):
        return None
    return CPU_TOKENS_PER_BATCH * sharding_lib.batch_shards(mesh)


def _chunk_batches(model: SentenceModel, sentences: list[str], batch_size: int,
                   max_length: int, shards: int, budget: Optional[int],
                   pack: bool) -> list[encode_layout.Batch]:
    """Tokenizes a chunk and lays it out in batches (run in the background thread)."""
    ids = token_ids(model.tokenizer, sentences, max_length=max_length)
    return encode_layout.plan_batches(ids, model.config.pad_token_id, batch_size, max_length,
                                      shards, budget, pack)


def _batches(model: SentenceModel, sentences: list[str], batch_size: int, max_length: int,
             executor: concurrent.futures.Executor, shards: int = 1,
             budget: Optional[int] = None,
             pack: bool = True) -> Iterator[tuple[np.ndarray, encode_layout.Batch]]:
    """Yields (the sentence index of each padded row, -1 for padding; the batch), chunk by
    chunk, each chunk's batches planned while the devices encode the previous ones."""
    plan = functools.partial(_chunk_batches, model, batch_size=batch_size,
                             max_length=max_length, shards=shards, budget=budget, pack=pack)
    starts = range(0, len(sentences), _CHUNK)
    futures = [executor.submit(plan, sentences[s: s + _CHUNK]) for s in starts[:2]]
    for n, start in enumerate(starts):
        batches = futures[n].result()
        if n + 2 < len(starts):  # keep two chunks in flight ahead of the devices
            nxt = starts[n + 2]
            futures.append(executor.submit(plan, sentences[nxt: nxt + _CHUNK]))
        for batch in batches:
            yield np.where(batch.indices >= 0, start + batch.indices, -1), batch


def concurrent_batches(mesh: Mesh) -> int:
    """Batches encoded at once: 2 on a single CPU device, else 1 (XLA:CPU only).

    XLA:CPU runs each op of a program over its thread pool, but much of an encode program
    (layer norms, softmax, small products) keeps fewer threads busy than the pool has; two
    programs running at once fill the gaps. MiniLM bf16, 32 x 32 tokens, 2 threads: 27.5-28.4
    ms a batch one at a time, 23.9-24.2 ms two at a time. Programs over several devices hold
    collectives, which must run in one order on every device: those stay one at a time."""
    devices = mesh.devices.flat
    return 2 if mesh.devices.size == 1 and all(d.platform == "cpu" for d in devices) else 1


def _run(encode_batch: Callable, args: tuple) -> np.ndarray:
    return np.asarray(encode_batch(*args))


def _store(out: np.ndarray, indices: np.ndarray, result: concurrent.futures.Future,
           bar) -> None:
    """Copies a batch's vectors (padding rows dropped) into their sentences' rows of `out`."""
    real = indices >= 0
    out[indices[real]] = result.result()[real]
    bar.update(int(real.sum()))


def encode(model: SentenceModel, sentences: Sequence[str], *, pooler: Optional[str] = None,
           batch_size: int = 64, max_length: Optional[int] = None, normalize: bool = False,
           progress: Optional[bool] = None, params: Any = None, dtype=jnp.float32,
           mesh: Optional[Mesh] = None, dropout_key: Optional[jax.Array] = None,
           finite: bool = True, pack: bool = True) -> np.ndarray:
    """Encodes sentences into vectors, in input order.

    Args:
      model: a loaded encoder (`jaxsim.load_pretrained`).
      sentences: strings; empty strings are allowed, longer texts are truncated to max_length.
      pooler: a registered pooler name; default: the model's own.
      batch_size: rows per global batch at most, a sentence each or several in a packed row
        (rounded up to a multiple of the mesh's batch shards); on CPU, long rows get fewer
        (`CPU_TOKENS_PER_BATCH`).
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
      pack: allow packed rows (several sentences a row; the same vectors up to float
        rounding) where they compute fewer tokens; never with `dropout_key` (the masks would
        be drawn over another layout).

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
    packed = np.zeros(len(items), bool)
    lanes = concurrent_batches(mesh)
    in_flight: collections.deque = collections.deque()  # (indices, future of the vectors)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as executor, \
            concurrent.futures.ThreadPoolExecutor(max_workers=lanes) as devices:
        batches = _batches(model, items, batch_size, max_length, executor, shards,
                           token_budget(mesh), pack and not train)
        for n, (indices, batch) in enumerate(batches):
            packing = None if batch.packing is None else _to_mesh(batch.packing, mesh)
            packed[indices[indices >= 0]] = packing is not None
            # Only dropout reads the key: deterministic batches share one.
            batch_key = jax.random.fold_in(key, n) if train else key
            args = (params, _to_mesh(batch.tokens, mesh), batch_key, packing)
            in_flight.append((indices, devices.submit(_run, encode_batch, args)))
            # One batch more than the lanes in flight: the next is placed while they run.
            if len(in_flight) > lanes:
                _store(out, *in_flight.popleft(), bar)
        while in_flight:
            _store(out, *in_flight.popleft(), bar)
    bar.close()
    if model.head:  # a sentence-transformers folder's Dense / Normalize, as it applies them
        out = apply_head(model.head + ((Normalize(),) if normalize else ()), out)
    redo = np.flatnonzero(packed & ~np.isfinite(out).all(axis=1))
    if len(redo):
        # In a packed row a NaN / inf token reaches the other sentences through attention
        # (a zero weight times NaN is NaN): those sentences are encoded again, each alone in
        # its own padded row, so only the sentences that are non-finite by themselves stay so.
        out[redo] = encode(model, [items[i] for i in redo], batch_size=batch_size,
                           max_length=max_length, normalize=normalize, progress=False,
                           params=params, dtype=dtype, mesh=mesh, finite=False, pack=False)
    if finite:
        check_finite(out, items, model.path or "the model")
    return out
