"""The training state: everything a step reads and writes, as one pytree."""
from __future__ import annotations

from typing import Any

import flax.struct
import jax


class TrainState(flax.struct.PyTreeNode):
    """State of a training run.

    Attributes:
      step: scalar int32, number of optimizer updates applied.
      params: the model's parameter tree (float32 master copy).
      opt_state: the optax optimizer state for `params`.
      rng: raw uint32 PRNG key data (`jax.random.key_data`), so checkpoints hold plain arrays.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
