"""A sentence-transformers folder's pipeline (`modules.json`): the modules after pooling, read
and written.

sentence-transformers runs Transformer -> Pooling -> any Dense / Normalize modules; jaxsim's
encoder and pooler cover the first two, and `head_of` reads the rest into
`SentenceModel.head` (`jaxsim.models.st_head`). In a jaxsim export the pooler's own modules are
the pooler, and its record says which modules follow. `write_modules` lays out the module
folders for a list of `StModule`s; what goes into the list is `jaxsim.export`'s choice.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import numpy as np
from safetensors.numpy import save as safetensors_bytes

from jaxsim.formats import st_flow
from jaxsim.formats.st_flow import MODULE_TYPE as FLOW_MODULE_TYPE
from jaxsim.formats.st_flow import read_flow
from jaxsim.formats.st_modules import NORMALIZE, TANH, StModule, st_dense, st_normalize
from jaxsim.models.st_head import Dense, HeadError, Normalize
from jaxsim.storage import store

MODULES_FILE = "modules.json"
RECORD_FILE = "jaxsim_export.json"  # a jaxsim export's record
# A pooler's own parameters (a user pooler's, not BERT's pooler layer), as jaxsim names them:
# its export rule writes them into modules jaxsim cannot read back (a rule has no inverse).
POOLER_FILE = "jaxsim_pooler.safetensors"
# What to do about a jaxsim export changed since jaxsim wrote it.
_REDO = (f"export it again with jaxsim, or delete {RECORD_FILE} to load the folder by "
         f"{MODULES_FILE} alone")


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
    config = store.read_json(module_dir / "config.json", HeadError, "Dense module config")
    tensors, source = read_state_dict(module_dir)
    weight = np.asarray(tensors.get("linear.weight"), np.float32)
    bias = tensors.get("linear.bias")
    shape = (config.get("out_features"), config.get("in_features"))
    if weight.ndim != 2 or tuple(weight.shape) != shape:
        raise HeadError(f"{source}: linear.weight has shape {weight.shape}, the module's "
                        f"config says {shape}")
    return Dense(weight=weight, bias=None if bias is None else np.asarray(bias, np.float32),
                 activation=str(config.get("activation_function", TANH)))


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
                            f"modules); {_REDO}")
        if count is None:  # an export from before the record counted them
            count = int(record.get("post") is not None) + int(bool(record.get("normalize")))
        after = entries[1:]
        return after[len(after) - count:] if count else []
    own = len(recorded) - int(count or 0)  # the Transformer and the pooler's own modules
    if _layout(entries[:own]) != _layout(recorded[:own]):
        names = ", ".join(_kind(e) for e in entries)
        exported = ", ".join(_kind(e) for e in recorded[:own])
        raise HeadError(f"{folder / MODULES_FILE}: modules {names} do not begin with the "
                        f"modules jaxsim exported ({exported}, {RECORD_FILE}); {_REDO}")
    return entries[own:]


def head_of(folder: Path, read_state_dict: Callable, record: Optional[dict] = None) -> tuple:
    """The modules a sentence-transformers folder applies after pooling, as `st_head` modules;
    a HeadError for one jaxsim cannot reproduce, or a broken one.

    `read_state_dict`: `folder -> (tensors, file)`. `record`: a jaxsim export's record, whose
    'modules' and 'head_modules' say which modules are the pooler's own.
    """
    entries = read_modules(folder)
    if not entries:
        return ()
    if _kind(entries[0]) != "Transformer":
        raise HeadError(f"{folder / MODULES_FILE}: the first module is {entries[0]['type']}, "
                        f"not a Transformer")
    if record is not None:
        trailing = _recorded_head(folder, entries, record)
    else:
        kinds = [_kind(e) for e in entries[1:]]
        if "Pooling" not in kinds:
            raise HeadError(f"{folder / MODULES_FILE}: no Pooling module")
        if kinds[0] != "Pooling":
            raise HeadError(f"{folder / MODULES_FILE}: module {entries[1]['type']} before "
                            f"Pooling is not supported by jaxsim")
        trailing = entries[2:]
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


def check_pooler_modules(folder: Path, record: dict, modules: Sequence[StModule],
                         read_state_dict: Callable) -> None:
    """Refuses an export whose pooler modules no longer hold what the pooler's export rule
    makes of its POOLER_FILE parameters (`modules`), e.g. a Dense fine-tuned and re-saved by
    sentence-transformers: jaxsim applies the parameters, so it would give other vectors."""
    own = (read_modules(folder) or [])[1:1 + len(modules)]
    redo = (f"export it again with jaxsim, or delete {RECORD_FILE} and {POOLER_FILE} to load "
            f"the folder by {MODULES_FILE} alone")
    if [_kind(e) for e in own] != [m.short_name for m in modules]:
        raise HeadError(f"{folder / MODULES_FILE}: the modules after the Transformer are not "
                        f"the {len(modules)} pooler {record.get('pooler')!r} exports; {redo}")
    for entry, module in zip(own, modules):
        if not module.tensors:
            continue
        tensors, source = read_state_dict(folder / entry.get("path", ""))
        for name, want in module.tensors.items():
            got = tensors.get(name)
            if got is None or not np.array_equal(np.asarray(got, np.float32),
                                                 np.asarray(want, np.float32)):
                raise HeadError(f"{source}: {name} is not what pooler {record.get('pooler')!r} "
                                f"makes of {folder / POOLER_FILE} (changed after the export); "
                                f"{redo}")


# ------------------------------------------------------------------------------ writing
def save_tensors(path, tensors: Mapping[str, np.ndarray]) -> None:
    """Writes a safetensors file through open(), so its mode follows the umask
    (`safetensors.numpy.save_file` creates files 0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = safetensors_bytes({k: np.ascontiguousarray(v, dtype=np.float32)
                              for k, v in tensors.items()}, metadata={"format": "pt"})
    path.write_bytes(data)


def head_modules(head: Sequence) -> list[StModule]:
    """A model's own modules after pooling (a loaded sentence-transformers folder's Dense /
    Normalize / flow), as they were."""
    out = []
    for module in head:
        if isinstance(module, Dense):
            bias = module.bias if module.bias is not None else np.zeros(module.out_features)
            out.append(st_dense(module.weight.T, bias, module.activation))
        elif isinstance(module, st_flow.FlowHead):
            out.append(st_flow.flow_module(module.calibration, module.calibration.dim))
        else:
            out.append(st_normalize())
    return out


def ends_with_normalize(modules: Sequence[StModule]) -> bool:
    return bool(modules) and modules[-1].type == NORMALIZE


def write_modules(folder: Path, modules: Sequence[StModule], max_length: int,
                  version: str) -> list[dict]:
    """Writes sentence-transformers' files and module folders after the Transformer (the
    model folder itself); returns modules.json. `version`: jaxsim's, for
    config_sentence_transformers.json."""
    entries = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"}]
    for idx, module in enumerate(modules, start=1):
        sub = f"{idx}_{module.short_name}"
        (folder / sub).mkdir()
        if module.config:
            store.write_json(folder / sub / "config.json", dict(module.config), indent=2)
        if module.tensors:
            save_tensors(folder / sub / "model.safetensors", module.tensors)
        entries.append({"idx": idx, "name": str(idx), "path": sub, "type": module.type})
        if module.type == st_flow.MODULE_TYPE:  # the flow's code, where modules.json names it
            (folder / st_flow.SOURCE_FILE).write_text(st_flow.source_text(), encoding="utf-8")
    store.write_json(folder / MODULES_FILE, entries, indent=2)
    store.write_json(folder / "sentence_bert_config.json",
                     {"max_seq_length": int(max_length), "do_lower_case": False}, indent=2)
    store.write_json(folder / "config_sentence_transformers.json", {
        "__version__": {"jaxsim": version}, "similarity_fn_name": "cosine",
        "prompts": {}, "default_prompt_name": None}, indent=2)
    return entries
