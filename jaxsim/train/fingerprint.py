"""What makes two configs the same run: the run-defining fields, their fingerprint, the changes.

A rerun in an existing workdir must compute the same thing; settings in OPERATIONAL_KEYS change
only how it is executed or logged. Code counts too: `code_digests` hashes the source of the
objective's loss and of the pooler, so an edited loss or pooler is another run. Imports no JAX.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import json
import types
from typing import Any, Callable, Mapping, Sequence

from jaxsim.errors import ConfigError
from jaxsim.train.config import DEFAULTS, TrainConfig, to_plain, unknown_key_message

# Settings that change how a run is executed or logged, not what it computes: a rerun in the
# same workdir may change them freely (e.g. resume an 8-device run on 4 devices).
OPERATIONAL_KEYS = frozenset({
    'mesh_data', 'mesh_fsdp', 'mesh_tensor', 'log_every', 'checkpoint', 'checkpoint_every',
    'keep_checkpoints', 'eval_batch_size', 'fast_compile', 'mesh_dcn_data', 'mesh_dcn_fsdp',
    'mesh_dcn_tensor', 'remat', 'micro_batch_size', 'tensorboard', 'logical_axis_rules',
    'replicate_indivisible', 'shard_optimizer_state'})


def run_defining(cfg: TrainConfig | Mapping[str, Any]) -> dict[str, Any]:
    """The fields that determine what a run computes (all but OPERATIONAL_KEYS)."""
    d = cfg.to_dict() if isinstance(cfg, TrainConfig) else to_plain(cfg)
    return {k: v for k, v in sorted(d.items()) if k not in OPERATIONAL_KEYS}


def fingerprint(values: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of `values`."""
    text = json.dumps(to_plain(values), sort_keys=True, separators=(',', ':'), allow_nan=False)
    return 'sha256:' + hashlib.sha256(text.encode()).hexdigest()


def differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Keys whose values differ (a key missing on one side counts as a difference)."""
    old, new = to_plain(old), to_plain(new)
    return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k)}


def parse_key_list(text: str | Sequence[str], extra: Sequence[str] = ()) -> tuple[str, ...]:
    """'a,b' -> ('a', 'b'), every name a config key (or one of `extra`)."""
    items = text.split(',') if isinstance(text, str) else list(text)
    keys = tuple(k.strip() for k in items if k.strip())
    for key in keys:
        if key not in DEFAULTS and key not in extra:
            raise ConfigError(unknown_key_message(key))
    return keys


_CONSTANTS = (int, float, complex, str, bytes, bool, type(None))


def _code_objects(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _text(obj: Any) -> str:
    """The source of a function or class; without one (defined in a string, a REPL), its
    bytecode and constants, which still change when it is edited."""
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        code = getattr(obj, '__code__', None)
        if code is None:
            return f'{getattr(obj, "__module__", "?")}.{getattr(obj, "__qualname__", obj)!r}'
        return repr([(c.co_code.hex(), c.co_names,
                      [k for k in c.co_consts if isinstance(k, _CONSTANTS)])
                     for c in _code_objects(code)])


def source_digest(fn: Callable) -> str:
    """sha256 of `fn`'s source and of what it uses from its own module: the functions and
    classes it names (and so on, transitively) and the plain constants (`_EPS = 1e-8`).

    Code elsewhere (jax, numpy, another module) is not followed: a helper moved to another
    module is not seen. `functools.partial` and decorators are unwrapped.
    """
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = inspect.unwrap(fn)
    if not (inspect.isfunction(fn) or inspect.ismethod(fn) or inspect.isclass(fn)):
        fn = type(fn)  # a callable object: its class holds the code
    module = getattr(fn, '__module__', None)
    parts, seen, todo = [], set(), [fn]
    while todo:
        obj = todo.pop(0)
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        parts.append(_text(obj))
        names = getattr(obj, '__globals__', {})
        codes = [getattr(obj, '__code__', None)]
        if inspect.isclass(obj):  # a class: what its methods use
            methods = [inspect.unwrap(getattr(m, '__func__', m)) for m in vars(obj).values()]
            methods = [m for m in methods if inspect.isfunction(m)]
            codes = [m.__code__ for m in methods]
            names = methods[0].__globals__ if methods else {}
        used = [n for code in codes if code for c in _code_objects(code) for n in c.co_names]
        for name in dict.fromkeys(used):  # first-use order: the same code, the same digest
            if name not in names:
                continue
            value = names[name]
            if isinstance(value, _CONSTANTS):
                parts.append(f'{name}={value!r}')
            elif ((inspect.isfunction(value) or inspect.isclass(value))
                  and getattr(value, '__module__', None) == module):
                todo.append(value)
    return 'sha256:' + hashlib.sha256('\0'.join(parts).encode()).hexdigest()


def code_digests(objective: Any, pooler: Any = None) -> dict[str, str]:
    """The run record's 'code' entry: {'objective': source_digest of its loss (and of its
    `init_params`, when it owns parameters), 'pooler': of the registered pooler's class or
    function}. A train run uses no calibration or flow layer: those apply after training."""
    digests = {'objective': source_digest(objective.loss)}
    init = getattr(objective, 'init_params', None)
    if init is not None:
        digests['objective_params'] = source_digest(init)
    if pooler is not None and getattr(pooler, 'source', None) is not None:
        digests['pooler'] = source_digest(pooler.source)
    return digests
