"""Parameters an objective owns (e.g. SimCSE's learnable temperature), beside the encoder's.

An objective registered with `init_params=fn` owns parameters: `fn(key, **hyperparameters)`
returns their pytree (an empty dict: none for these settings), and its loss takes them as
`params=`. In training they live in the trainable tree under KEY,

    {'bert': ..., 'pooler': ..., 'objective': {'log_temp': ...}}

so the one optimizer updates them with the encoder (same schedule and global-norm clipping,
no weight decay), checkpoints hold and restore them, and a model read back from a workdir
drops them (`encoder_params`): no export, encode or evaluation ever sees them. A run whose
objective owns nothing has no KEY at all: its tree is the encoder's, unchanged.
"""
from __future__ import annotations

import inspect
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxsim.errors import UserCodeError, running_user_code

KEY = 'objective'


def init_owned(objective: Any, kwargs: Mapping[str, Any], key: Any) -> dict:
    """The parameters `objective` owns under the hyperparameters `kwargs`, drawn from `key`
    ({} when it owns none). `init_params` gets the hyperparameters its signature names (all of
    them when it takes **kwargs)."""
    init = getattr(objective, 'init_params', None)
    if init is None:
        return {}
    params = list(inspect.signature(init).parameters.values())[1:]
    if not any(p.kind == p.VAR_KEYWORD for p in params):
        named = {p.name for p in params}
        kwargs = {k: v for k, v in kwargs.items() if k in named}
    name = f"init_params of objective {getattr(objective, 'name', '')!r}"
    with running_user_code(name, init):
        made = init(key, **kwargs)
    if made is None:
        return {}
    if not isinstance(made, Mapping):
        raise UserCodeError(f'{name} must return a dict of arrays, got {type(made).__name__}')
    _check_trainable(name, made)
    return dict(made)


def _check_trainable(name: str, tree: Mapping[str, Any]) -> None:
    """The optimizer differentiates every leaf: each must be a floating-point array."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dtype = getattr(leaf, 'dtype', None)
        if dtype is None:
            dtype = np.asarray(leaf).dtype if isinstance(leaf, (int, float)) else None
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):  # bfloat16 too
            raise UserCodeError(f'{name}: {jax.tree_util.keystr(path)} must be a floating-point '
                                f'array (it is trained), got '
                                f'{dtype if dtype is not None else type(leaf).__name__}')


def split(params: Mapping[str, Any]) -> tuple[dict, dict]:
    """A trainable tree -> (the encoder's parameters, the objective's ({} when none))."""
    params = dict(params)
    return params, dict(params.pop(KEY, None) or {})


def join(encoder_params: Mapping[str, Any], owned: Mapping[str, Any]) -> dict:
    """The trainable tree of `encoder_params` and the objective's `owned` (KEY only when the
    objective owns something)."""
    if KEY in encoder_params:
        raise ValueError(f'encoder parameters hold {KEY!r} already')
    return {**encoder_params, KEY: dict(owned)} if owned else dict(encoder_params)


def encoder_params(params: Mapping[str, Any]) -> dict:
    """The encoder's parameters of a trainable tree: what models, exports and evaluation use."""
    return split(params)[0]
