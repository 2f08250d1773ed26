"""A sentence-transformers module described: its class path, config.json and weights.

The vocabulary a pooler's export rule (`register_pooler(..., export=rule)`) and the
sentence-transformers folder writer (`jaxsim.formats.st_folder`) share. It imports nothing of
jaxsim, so `jaxsim.models.poolers` can build these descriptions at registration time although
formats/ otherwise sits above models/.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import numpy as np

IDENTITY = "torch.nn.modules.linear.Identity"
TANH = "torch.nn.modules.activation.Tanh"
NORMALIZE = "sentence_transformers.models.Normalize"


@dataclasses.dataclass(frozen=True)
class StModule:
    """One sentence-transformers module after the Transformer, as an export rule describes it.

    Attributes:
      type: the module class path, e.g. 'sentence_transformers.models.Pooling'.
      config: its `config.json` content.
      tensors: its `model.safetensors` content (torch layouts), or None for no weights.
    """

    type: str
    config: Mapping[str, Any]
    tensors: Optional[Mapping[str, np.ndarray]] = None

    @property
    def short_name(self) -> str:
        return self.type.rsplit(".", 1)[-1]


def st_pooling(hidden: int, mode: str) -> StModule:
    """A sentence-transformers Pooling module in mode 'cls' or 'mean'."""
    return StModule("sentence_transformers.models.Pooling", {
        "word_embedding_dimension": hidden,
        "pooling_mode_cls_token": mode == "cls",
        "pooling_mode_mean_tokens": mode == "mean",
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False})


def st_dense(kernel: np.ndarray, bias: np.ndarray, activation: str) -> StModule:
    """A sentence-transformers Dense module computing activation(x @ kernel + bias)."""
    kernel = np.asarray(kernel, np.float32)  # [in, out]; torch Linear stores [out, in]
    return StModule("sentence_transformers.models.Dense", {
        "in_features": int(kernel.shape[0]), "out_features": int(kernel.shape[1]), "bias": True,
        "activation_function": activation},
        {"linear.weight": kernel.T, "linear.bias": np.asarray(bias, np.float32)})


def st_layer_average(hidden: int, num_hidden_layers: int, first: int, second: int) -> StModule:
    """WeightedLayerPooling with unit weights on two hidden states: exactly (h_a + h_b) / 2.

    It computes sum_i w_i h[start + i] / sum_i w_i over hidden_states[start:].
    """
    n_states = num_hidden_layers + 1
    first, second = first % n_states, second % n_states
    start = min(first, second)
    weights = np.zeros(n_states - start, np.float32)
    weights[first - start] += 1.0
    weights[second - start] += 1.0
    return StModule("sentence_transformers.models.WeightedLayerPooling", {
        "word_embedding_dimension": hidden, "layer_start": start,
        "num_hidden_layers": num_hidden_layers}, {"layer_weights": weights})


def st_normalize() -> StModule:
    """A sentence-transformers Normalize module (L2, no config, no weights)."""
    return StModule(NORMALIZE, {})
