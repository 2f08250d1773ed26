"""A sentence-transformers folder's pipeline (`modules.json`): the modules after pooling.

sentence-transformers runs Transformer -> Pooling -> any Dense / Normalize modules; jaxsim's
encoder and pooler cover the first two, and `head_of` reads the rest into
`SentenceModel.head` (`jaxsim.models.st_head`) so `jaxsim.encode` gives the vectors
`SentenceTransformer(folder).encode` gives. In a jaxsim export the pooler's own modules (e.g.
'cls': Pooling + the head's Dense(tanh)) are the pooler; its record says which modules follow
(a calibration's Dense or flow, Normalize). A jaxsim flow module (`jaxsim.formats.st_flow`) is read
back as a `FlowHead` applying the same flow with jaxsim's code.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import numpy as np

from jaxsim.storage import store
from jaxsim.formats.st_flow import MODULE_TYPE as FLOW_MODULE_TYPE
from jaxsim.formats.st_flow import read_flow
from jaxsim.models.st_head import Dense, HeadError, Normalize

MODULES_FILE = "modules.json"
RECORD_FILE = "jaxsim_export.json"  # a jaxsim export's record
_PREFIX = "sentence_transformers.models."


def read_modules(folder: Path) -> Optional[list[dict]]:
    """modules.json's entries in pipeline order, or None for a folder without one."""
    path = folder / MODULES_FILE
    if not path.is_file():
        return None
    entries = store.read_json(path, HeadError, expect=None)
    if not isinstance(entries, list) or not all(
            isinstance(e, dict) and isinstance(e.get("type"), str) for e in entries):
        raise HeadError(f"{path}: expected a list of modules with a 'type' each")
    return sorted(entries, key=lambda e: int(e.get("idx", 0)))


def _kind(entry: dict) -> str:
    return entry["type"].rsplit(".", 1)[-1]


def has_normalize_module(folder: Path) -> bool:
    """Whether a sentence-transformers folder ends its pipeline with a Normalize module."""
    return any(_kind(e) == "Normalize" for e in read_modules(folder) or ())


def _dense(folder: Path, entry: dict, read_state_dict: Callable) -> Dense:
    module_dir = folder / entry.get("path", "")
    config_file = module_dir / "config.json"
    config = store.read_json(config_file, HeadError, "Dense module config")
    tensors, source = read_state_dict(module_dir)
    weight = np.asarray(tensors.get("linear.weight"), np.float32)
    bias = tensors.get("linear.bias")
    shape = (config.get("out_features"), config.get("in_features"))
    if weight.ndim != 2 or tuple(weight.shape) != shape:
        raise HeadError(f"{source}: linear.weight has shape {weight.shape}, the module's "
                        f"config says {shape}")
    return Dense(weight=weight, bias=None if bias is None else np.asarray(bias, np.float32),
                 activation=str(config.get("activation_function",
                                           "torch.nn.modules.activation.Tanh")))


def _layout(entries: list[dict]) -> list[tuple[str, str]]:
    return [(_kind(e), str(e.get("path", ""))) for e in entries]


def _recorded_head(folder: Path, entries: list[dict], record: dict) -> list[dict]:
    """The modules after the pooler's own in a jaxsim export. modules.json wins over the
    record: a folder sentence-transformers re-saved with modules added after the exported
    ones applies them too; any other change is refused (the record's pooler no longer holds)."""
    count = record.get("head_modules")
    recorded = record.get("modules")
    if recorded is None:  # an hf export, or an export from before the record listed modules
        if record.get("format") == "hf":
            raise HeadError(f"{folder / MODULES_FILE}: written after jaxsim's hf export "
                            f"({folder / RECORD_FILE} records no sentence-transformers "
                            f"modules); export it again with jaxsim, or delete {RECORD_FILE} "
                            f"to load the folder by {MODULES_FILE} alone")
        if count is None:  # an export from before the record counted them
            count = int(record.get("post") is not None) + int(bool(record.get("normalize")))
        after = entries[1:]
        return after[len(after) - count:] if count else []
    own = len(recorded) - int(count or 0)  # the Transformer and the pooler's own modules
    if _layout(entries[:own]) != _layout(recorded[:own]):
        names = ", ".join(_kind(e) for e in entries)
        exported = ", ".join(_kind(e) for e in recorded[:own])
        raise HeadError(f"{folder / MODULES_FILE}: modules {names} do not begin with the "
                        f"modules jaxsim exported ({exported}, {RECORD_FILE}); export it again "
                        f"with jaxsim, or delete {RECORD_FILE} to load the folder by "
                        f"{MODULES_FILE} alone")
    return entries[own:]


def head_of(folder: Path, read_state_dict: Callable,
            record: Optional[dict] = None) -> tuple:
    """The modules a sentence-transformers folder applies after pooling, as `st_head` modules.

    Args:
      folder: the model folder.
      read_state_dict: `folder -> (tensors, file)` (the model loader's weight reader).
      record: a jaxsim export's jaxsim_export.json, whose 'modules' and 'head_modules' say
        which modules are the pooler's own; modules listed after them are applied too.

    Raises:
      HeadError: a module jaxsim cannot reproduce (named with its folder), or a broken one.
    """
    entries = read_modules(folder)
    if not entries:
        return ()
    if _kind(entries[0]) != "Transformer":
        raise HeadError(f"{folder / MODULES_FILE}: the first module is {entries[0]['type']}, "
                        f"not a Transformer")
    after = entries[1:]
    if record is not None:
        trailing = _recorded_head(folder, entries, record)
    else:
        kinds = [_kind(e) for e in after]
        if "Pooling" not in kinds:
            raise HeadError(f"{folder / MODULES_FILE}: no Pooling module")
        at = kinds.index("Pooling")
        if at:
            raise HeadError(f"{folder / MODULES_FILE}: module {after[0]['type']} before "
                            f"Pooling is not supported by jaxsim")
        trailing = after[at + 1:]
    head = []
    for entry in trailing:
        kind = _kind(entry)
        if kind == "Dense":
            head.append(_dense(folder, entry, read_state_dict))
        elif kind == "Normalize":
            head.append(Normalize())
        elif entry["type"] == FLOW_MODULE_TYPE:
            head.append(read_flow(folder / entry.get("path", ""), read_state_dict))
        else:
            raise HeadError(f"{folder / MODULES_FILE}: module {entry['type']} after pooling "
                            f"is not supported by jaxsim (it reproduces Dense, Normalize and its "
                            f"own flow module)")
    return tuple(head)
