"""Config files (`path.py` or `path.py:arg`) and `key=value` overrides, as plain dicts of fields.

Config files (configs/*.py) import only ml_collections: their `get_config()` returns the fields
they set, merged here over every field's default. Overrides are the text after `--config.` on
the command line, parsed by the type of the field's default. The result is validated as a whole
by `TrainConfig.from_dict`. Imports no JAX.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, Iterable, Mapping

from jaxsim.config_module import run_get_config
from jaxsim.errors import ConfigError
from jaxsim.train.config import DEFAULTS, check_keys, to_plain, unknown_key_message


def load_config_file(spec: str) -> dict[str, Any]:
    """Loads `path.py` or `path.py:arg` (calling `get_config()` / `get_config(arg)`).

    Returns:
      The file's fields merged over the defaults, as a plain dict (not yet validated as a
      whole: overrides may still follow).
    """
    path_text, _, arg = spec.partition(':') if not Path(spec).is_file() else (spec, '', '')
    path = Path(path_text)
    fields = run_get_config(path, ConfigError, 'config', arg)
    if not isinstance(fields, Mapping) and not hasattr(fields, 'to_dict'):
        raise ConfigError(f'{path}: get_config() must return a ConfigDict or dict, '
                          f'got {type(fields).__name__}')
    fields = to_plain(fields)
    check_keys(fields, str(path))
    return {**to_plain(DEFAULTS), **fields}


def _parse(text: str, like: Any, key: str) -> Any:
    """Parses an override value by the type of the field's default."""
    if isinstance(like, bool):
        low = text.strip().lower()
        if low in ('true', '1', 'yes', 'false', '0', 'no'):
            return low in ('true', '1', 'yes')
        raise ConfigError(f'--config.{key}={text}: expected true or false')
    if isinstance(like, (int, float)):
        try:
            return type(like)(text)
        except ValueError:
            what = 'an integer' if isinstance(like, int) else 'a number'
            raise ConfigError(f'--config.{key}={text}: expected {what}') from None
    if isinstance(like, dict) or (isinstance(like, (list, tuple))
                                  and text.strip().startswith('[')):
        kind = dict if isinstance(like, dict) else list
        value = _literal(text, key)
        if not isinstance(value, kind):
            raise ConfigError(f'--config.{key}={text}: expected a {kind.__name__}')
        return value
    if isinstance(like, (list, tuple)):
        return [s.strip() for s in text.split(',') if s.strip()]
    if like is None:  # an entry of a dict field: a Python literal, else a string
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return text
    return text


def _literal(text: str, key: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ConfigError(f'--config.{key}={text}: not a valid literal') from None


def apply_overrides(fields: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Applies `key=value` / `dict_field.key=value` overrides (the text after `--config.`).

    Raises:
      ConfigError: an unknown key (with a suggestion) or a value of the wrong type.
    """
    out = to_plain(fields)
    for item in overrides:
        key, sep, text = item.partition('=')
        if not sep:
            raise ConfigError(f'--config.{item}: expected --config.KEY=VALUE')
        top, _, sub = key.partition('.')
        if top not in DEFAULTS:
            raise ConfigError(unknown_key_message(top))
        if sub:
            if not isinstance(DEFAULTS[top], dict):
                raise ConfigError(f"--config.{key}: '{top}' is not a dict field")
            current = dict(out.get(top) or {})
            current[sub] = _parse(text, None, key)
            out[top] = current
        else:
            out[top] = _parse(text, DEFAULTS[top], key)
    return out
