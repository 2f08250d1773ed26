"""What a sentence-transformers folder applies after pooling: Dense and Normalize modules.

`SentenceModel.head` holds them in order and `jaxsim.encode` applies them to the pooled
vectors exactly as sentence-transformers does (float32):
  Dense      activation(x @ W^T + b), W stored as torch's Linear [out, in]
  Normalize  x / max(||x||_2, 1e-12)   (torch.nn.functional.normalize)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

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


# ---------------------------------------------------------------- the head in training
# Training from a sentence-transformers folder keeps its head: the Dense weights join the
# trainable tree under HEAD_KEY ({'0': {'weight', 'bias'}}, keyed by the module's position),
# the modules are applied in JAX after the pooler (`apply_jax`), and a workdir's model.json
# records the head's structure (`head_record`) so the checkpoint's weights rebuild it.

HEAD_KEY = "st_head"

def jax_activation(name: str) -> Callable:
    """The JAX form of the activation `name` (a torch class path of ACTIVATIONS, the NumPy
    form)."""
    import jax
    import jax.numpy as jnp

    return {"torch.nn.modules.linear.Identity": lambda v: v,
            "torch.nn.modules.activation.Tanh": jnp.tanh,
            "torch.nn.modules.activation.ReLU": jax.nn.relu,
            "torch.nn.modules.activation.Sigmoid": jax.nn.sigmoid,
            "torch.nn.modules.activation.GELU": lambda v: jax.nn.gelu(v, approximate=False),
            }[name]


def check_jax_form(head: Sequence, where: str) -> None:
    """HeadError unless every module of `head` is a Dense or Normalize (what `apply_jax`
    computes; a Dense's activation is one of ACTIVATIONS, each with a JAX form); `where` names
    the caller in the message."""
    for module in head:
        if not isinstance(module, (Dense, Normalize)):
            raise HeadError(f"{where}: no JAX form of the head module {module!r}")


def head_weights(head: Sequence) -> dict:
    """The Dense modules' weights as a parameter tree ({} for a head without Dense)."""
    return {str(i): {"weight": np.asarray(m.weight, np.float32),
                     **({} if m.bias is None else {"bias": np.asarray(m.bias, np.float32)})}
            for i, m in enumerate(head) if isinstance(m, Dense)}


def _dense(w: dict, activation: str) -> Dense:
    """A Dense module from one entry of a `head_weights` tree."""
    return Dense(np.asarray(w["weight"], np.float32),
                 np.asarray(w["bias"], np.float32) if "bias" in w else None, activation)


def with_weights(head: Sequence, weights: Optional[dict]) -> tuple:
    """`head` with its Dense modules' weights replaced by those of `weights` (a `head_weights`
    tree, e.g. trained)."""
    return tuple(_dense(weights[str(i)], m.activation) if isinstance(m, Dense) and weights else m
                 for i, m in enumerate(head))


def split_weights(params: dict) -> tuple[dict, dict]:
    """A trainable tree -> (the encoder's parameters, the head's weights ({} when none))."""
    params = dict(params)
    return params, dict(params.pop(HEAD_KEY, None) or {})


def apply_jax(head: Sequence, weights: Optional[dict], x):
    """`head` on pooled vectors x [N, D] in JAX (differentiable in `weights`, a `head_weights`
    tree), as `apply_head` computes it in NumPy. float32."""
    import jax.numpy as jnp

    x = x.astype(jnp.float32)
    for i, module in enumerate(head):
        if isinstance(module, Dense):
            dense = weights[str(i)]
            x = x @ dense["weight"].T
            if "bias" in dense:
                x = x + dense["bias"]
            x = jax_activation(module.activation)(x)
        else:  # Normalize: torch.nn.functional.normalize
            x = x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
    return x


def head_record(head: Sequence) -> list:
    """The head's structure as JSON (a workdir's model.json); the weights live in the
    checkpoints."""
    return [{"type": "Dense", "in_features": m.in_features, "out_features": m.out_features,
             "bias": m.bias is not None, "activation": m.activation}
            if isinstance(m, Dense) else {"type": "Normalize"} for m in head]


def head_from_record(record: Any, weights: dict, source: str) -> tuple:
    """The head `head_record` describes, with the Dense weights of `weights` (a
    `head_weights` tree); HeadError naming `source` when they do not fit."""
    if not isinstance(record, list):
        raise HeadError(f"{source}: head: expected a list of modules, got {record!r}")
    head = []
    for i, entry in enumerate(record):
        kind = entry.get("type") if isinstance(entry, dict) else None
        if kind == "Normalize":
            head.append(Normalize())
        elif kind == "Dense":
            w = weights.get(str(i))
            shape = (entry.get("out_features"), entry.get("in_features"))
            if w is None or tuple(np.shape(w.get("weight"))) != shape or (
                    ("bias" in w) != bool(entry.get("bias"))):
                raise HeadError(f"{source}: the checkpoint has no Dense module {i} of shape "
                                f"{shape} (bias {bool(entry.get('bias'))}) as the head record says")
            head.append(_dense(w, str(entry.get("activation"))))
        else:
            raise HeadError(f"{source}: head module {i}: unknown type {kind!r}")
    return tuple(head)
