"""The model check: an index remembers the model that built it (path, pooler, dimension, its
vector of a probe sentence encoded with every query batch) and refuses any other."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from jaxsim.search.vectors import SearchError, embed, model_ref, normalize_rows

# Encoded beside every query batch; its vector fingerprints the model + pooler.
PROBE_SENTENCE = "A man is playing a guitar on a quiet street."
# The same model on another device or XLA build agrees to ~1e-6; another model is far below.
PROBE_MIN_COSINE = 0.999


class ModelMismatchError(SearchError):
    """A model other than the one that built the index."""


def encode_checked(info: Any, model: Any, sentences: Sequence[str], *,
                   pooler: Optional[str] = None, batch_size: int = 64) -> np.ndarray:
    """Encodes sentences with `model`, first checking it is the model that built the index
    described by `info` (an `IndexInfo`).

    Raises:
      ModelMismatchError: another pooler, width or model (both named); or an index of bare
        vectors, which has no model to encode with.
    """
    if info.pooler is None:
        raise ModelMismatchError("this index was built from bare vectors, not with a "
                                 "model: search it with search_vectors")
    ref = model_ref(model, pooler or info.pooler)  # default: the pooler that built it
    built = f"{info.model} (pooler {info.pooler}, dimension {info.dim})"
    if ref.pooler != info.pooler:
        raise ModelMismatchError(f"the index was built with {built}; pooler {ref.pooler} "
                                 f"of {ref.path} would give other vectors")
    vecs = embed(model, [PROBE_SENTENCE, *sentences], pooler=ref.pooler,
                 batch_size=batch_size)
    if vecs.shape[1] != info.dim:
        raise ModelMismatchError(f"{ref.path} gives {vecs.shape[1]}-dimensional vectors "
                                 f"but the index holds {info.dim}-dimensional ones, from "
                                 f"{built}")
    if info.probe is not None:
        probe = np.asarray(info.probe, np.float32)
        cos = float(normalize_rows(vecs[:1])[0] @ normalize_rows(probe[None])[0])
        if not cos >= PROBE_MIN_COSINE:  # NaN (a non-finite vector) is a mismatch too
            raise ModelMismatchError(
                f"{ref.path} (pooler {ref.pooler}) is not the model that built the index, "
                f"{built}: their vectors of a probe sentence differ (cosine {cos:.4f}); "
                f"search with the index's model")
    return vecs[1:]
