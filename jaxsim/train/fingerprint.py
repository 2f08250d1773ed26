"""What makes two configs the same run: the run-defining fields, their fingerprint, the changes.

A rerun in an existing workdir must compute the same thing; settings in OPERATIONAL_KEYS change
only how it is executed or logged. Imports no JAX.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping, Sequence

from jaxsim.errors import ConfigError
from jaxsim.train.config import DEFAULTS, TrainConfig, to_plain, unknown_key_message

# Settings that change how a run is executed or logged, not what it computes: a rerun in the
# same workdir may change them freely (e.g. resume an 8-device run on 4 devices).
OPERATIONAL_KEYS = frozenset({
    'mesh_data', 'mesh_fsdp', 'mesh_tensor', 'log_every', 'checkpoint', 'checkpoint_every',
    'keep_checkpoints', 'eval_batch_size', 'fast_compile', 'mesh_dcn_data', 'mesh_dcn_fsdp',
    'mesh_dcn_tensor', 'remat', 'micro_batch_size', 'tensorboard', 'logical_axis_rules',
    'replicate_indivisible'})


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
