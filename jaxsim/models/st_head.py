"""What a sentence-transformers folder applies after pooling: Dense and Normalize modules.

`SentenceModel.head` holds them in order and `jaxsim.encode` applies them to the pooled
vectors exactly as sentence-transformers does (float32):
  Dense      activation(x @ W^T + b), W stored as torch's Linear [out, in]
  Normalize  x / max(||x||_2, 1e-12)   (torch.nn.functional.normalize)
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import numpy as np

from jaxsim.errors import JaxsimError


def _special():
    """scipy.special, imported when a Dense head needs it (~11 MB resident otherwise spent by
    every process that imports jaxsim, training included)."""
    from scipy import special
    return special


# sentence-transformers stores a Dense module's activation as its torch class path.
ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "torch.nn.modules.linear.Identity": lambda x: x,
    "torch.nn.modules.activation.Tanh": np.tanh,
    "torch.nn.modules.activation.ReLU": lambda x: np.maximum(x, 0),
    "torch.nn.modules.activation.Sigmoid": lambda x: _special().expit(x).astype(np.float32),
    "torch.nn.modules.activation.GELU": lambda x: (
        0.5 * x * (1 + _special().erf(x / np.sqrt(2)))).astype(np.float32),
}


class HeadError(JaxsimError):
    """A module after pooling that jaxsim cannot reproduce exactly."""


@dataclasses.dataclass(frozen=True, eq=False)
class Dense:
    """activation(x @ weight.T + bias); weight [out, in] as torch stores it."""

    weight: np.ndarray
    bias: Optional[np.ndarray]
    activation: str

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise HeadError(f"Dense activation {self.activation!r} is not supported; jaxsim "
                            f"reproduces {', '.join(sorted(ACTIVATIONS))}")

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def __repr__(self) -> str:
        # Shapes, not the weights (the dataclass repr printed the whole matrix).
        bias = "" if self.bias is None else ", bias"
        return (f"Dense({self.in_features} -> {self.out_features}{bias}, "
                f"activation={self.activation!r})")

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = x @ np.asarray(self.weight, np.float32).T
        if self.bias is not None:
            y = y + np.asarray(self.bias, np.float32)
        return np.asarray(ACTIVATIONS[self.activation](y), np.float32)


@dataclasses.dataclass(frozen=True)
class Normalize:
    """L2 normalization, as torch.nn.functional.normalize(x, p=2, dim=1)."""

    def __call__(self, x: np.ndarray) -> np.ndarray:
        norm = np.linalg.norm(x, axis=1, keepdims=True)
        return (x / np.maximum(norm, 1e-12)).astype(np.float32)


def output_size(head: Sequence, hidden: int) -> int:
    """The width of the vectors after the head, for pooled vectors of width `hidden`."""
    for module in head:
        if isinstance(module, Dense):
            if module.in_features != hidden:
                raise HeadError(f"a Dense module takes {module.in_features}-dim vectors, the "
                                f"pooled vectors have {hidden}")
            hidden = module.out_features
    return hidden


def apply_head(head: Sequence, x: np.ndarray) -> np.ndarray:
    """The pooled vectors [N, D] through every module of `head`, in order."""
    for module in head:
        x = module(x)
    return np.asarray(x, np.float32)
