"""Hugging Face PyTorch BERT/RoBERTa tensors <-> jaxsim Flax parameters, both ways.

The mapping is one rule applied to the Flax parameter tree, so import and export are exact
inverses by construction:
  encoder/layer_3/attention/self/query/kernel  <->  encoder.layer.3.attention.self.query.weight
                                                    (transposed)
  embeddings/word_embeddings/embedding          <->  embeddings.word_embeddings.weight
  .../LayerNorm/scale                           <->  .../LayerNorm.weight
Every expected tensor must be present with the expected shape; anything else is an error naming
the tensor, except buffers (`position_ids`) and task heads (`cls.*`, `lm_head.*`, ...), which are
ignored and reported.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Mapping, Tuple

import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from jaxsim.errors import JaxsimError
from jaxsim.models.bert import BertConfig, BertModel

# Prefixes that wrap the base model in task checkpoints (BertForMaskedLM,
# RobertaForSequenceClassification...).
_BASE_PREFIX = re.compile(r"^(bert|roberta|model)\.")
# Task heads and buffers that are not part of the encoder.
_IGNORED = re.compile(r"^(cls|lm_head|classifier|qa_outputs|mlp|pre_classifier)\.|position_ids$")
# Old TF-converted checkpoints call LayerNorm parameters gamma/beta.
_LEGACY_SUFFIX = {".gamma": ".weight", ".beta": ".bias"}


class CheckpointMismatchError(JaxsimError):
    """Checkpoint tensors that do not match the architecture."""


@dataclasses.dataclass(frozen=True)
class ImportReport:
    """What an import did besides the mapped tensors."""

    ignored: Tuple[str, ...]


def flax_to_hf_name(path: Tuple[str, ...]) -> str:
    """('encoder', 'layer_0', ..., 'kernel') -> 'encoder.layer.0.....weight'."""
    parts = [re.sub(r"^layer_(\d+)$", r"layer.\1", p) for p in path[:-1]]
    leaf = "bias" if path[-1] == "bias" else "weight"
    return ".".join(parts + [leaf])


def _to_hf(path: Tuple[str, ...], value: np.ndarray) -> np.ndarray:
    # Flax Dense kernels are [in, out]; torch Linear weights are [out, in].
    return value.T if path[-1] == "kernel" else value


def param_shapes(config: BertConfig, add_pooler: bool = True) -> Dict[Tuple[str, ...], tuple]:
    """Flat {flax path: shape} of the parameters of `BertModel(config)`, without allocating them."""
    ids = jnp.zeros((1, 2), jnp.int32)
    abstract = jax.eval_shape(
        lambda: BertModel(config, add_pooler=add_pooler).init(jax.random.key(0), ids, ids))
    flat = flax.traverse_util.flatten_dict(abstract["params"])
    return {k: tuple(v.shape) for k, v in flat.items()}


def normalize_hf_names(state_dict: Mapping[str, np.ndarray]
                       ) -> Tuple[Dict[str, np.ndarray], List[str]]:
    """Strips base-model prefixes and legacy suffixes; splits off ignored heads and buffers."""
    kept, ignored = {}, []
    for name, value in state_dict.items():
        name = _BASE_PREFIX.sub("", name, count=1)
        for old, new in _LEGACY_SUFFIX.items():
            name = name.removesuffix(old) + new if name.endswith(old) else name
        if _IGNORED.search(name):
            ignored.append(name)
        else:
            kept[name] = value
    return kept, ignored


def hf_to_params(state_dict: Mapping[str, np.ndarray], config: BertConfig,
                 source: str = "checkpoint") -> Tuple[dict, ImportReport]:
    """Maps PyTorch-named tensors to a Flax parameter tree (float32 numpy leaves).

    Args:
      state_dict: tensor name -> array, e.g. from `safetensors.numpy.load_file`.
      config: the architecture the tensors must fit.
      source: file name used in error messages.

    Returns:
      (params, report): params for `BertModel(config, add_pooler="pooler" in params)`.

    Raises:
      CheckpointMismatchError: naming every missing, unexpected or mis-shaped tensor.
    """
    tensors, ignored = normalize_hf_names(state_dict)
    expected = param_shapes(config, add_pooler=any(n.startswith("pooler.") for n in tensors))
    problems, flat = [], {}
    for path, shape in expected.items():
        name = flax_to_hf_name(path)
        if name not in tensors:
            problems.append(f"missing tensor {name!r} (shape {shape})")
            continue
        # The transpose is its own inverse.
        value = _to_hf(path, np.asarray(tensors[name], dtype=np.float32))
        if value.shape != shape:
            hf_shape = shape[::-1] if path[-1] == "kernel" else shape
            problems.append(f"tensor {name!r} has shape {tuple(np.shape(tensors[name]))}, "
                            f"expected {hf_shape}")
            continue
        flat[path] = value
    wanted = {flax_to_hf_name(p) for p in expected}
    problems += [f"unexpected tensor {name!r}" for name in sorted(set(tensors) - wanted)]
    if problems:
        raise CheckpointMismatchError(
            f"{source} does not match the {config.model_type} architecture "
            f"({config.num_hidden_layers} layers, hidden {config.hidden_size}):\n  "
            + "\n  ".join(problems))
    return flax.traverse_util.unflatten_dict(flat), ImportReport(ignored=tuple(sorted(ignored)))


def params_to_hf(params: Mapping, config: BertConfig) -> Dict[str, np.ndarray]:
    """Flax parameters -> PyTorch `BertModel`/`RobertaModel` state dict (contiguous float32)."""
    expected = param_shapes(config, add_pooler="pooler" in params)
    flat = flax.traverse_util.flatten_dict(dict(params))
    if set(flat) != set(expected):
        missing = sorted("/".join(p) for p in set(expected) - set(flat))
        extra = sorted("/".join(p) for p in set(flat) - set(expected))
        raise CheckpointMismatchError(
            f"parameters do not match the architecture: missing {missing}, unexpected {extra}")
    out = {}
    for path, value in flat.items():
        value = np.asarray(value, dtype=np.float32)
        if value.shape != expected[path]:
            raise CheckpointMismatchError(
                f"parameter {'/'.join(path)} has shape {value.shape}, expected {expected[path]}")
        out[flax_to_hf_name(path)] = np.ascontiguousarray(_to_hf(path, value))
    return out


def hf_to_encoder_params(state_dict: Mapping[str, np.ndarray], config: BertConfig,
                         source: str = "checkpoint") -> Tuple[dict, ImportReport]:
    """A checkpoint's tensors -> a `SentenceEncoder` tree {'bert': ..., 'pooler': ...}.

    BERT's own pooler layer, when the checkpoint has one, lands under 'pooler' (the 'cls'
    pooler's dense + tanh), and its masked-LM head under 'mlm_head'.
    """
    bert, report = hf_to_params(state_dict, config, source)
    pooler = bert.pop("pooler", None)
    tree = {"bert": bert, "pooler": pooler, "mlm_head": hf_to_mlm_params(state_dict, config)}
    return {k: v for k, v in tree.items() if v is not None}, report


def encoder_params_to_hf(params: Mapping, config: BertConfig,
                         include_pooler: bool = True) -> Dict[str, np.ndarray]:
    """A `SentenceEncoder` tree {'bert', 'pooler'} -> a PyTorch `BertModel`/`RobertaModel`
    state dict; `include_pooler` writes params['pooler'] as BERT's pooler layer."""
    tree = dict(params["bert"])
    if include_pooler and "pooler" in params:
        tree["pooler"] = params["pooler"]
    return params_to_hf(tree, config)


# Hugging Face names of the masked-LM head -> modules in `jaxsim.models.mlm.MlmHead`'s tree, and
# their leaves. The decoder weight is tied to the word embeddings in both families, so it is not
# stored here: the output bias has no weight.
_MLM_LEAVES = {("dense",): ("kernel", "bias"), ("LayerNorm",): ("scale", "bias"), (): ("bias",)}
_MLM_NAMES = {
    "bert": {"cls.predictions.transform.dense": ("dense",),
             "cls.predictions.transform.LayerNorm": ("LayerNorm",),
             "cls.predictions": ()},
    "roberta": {"lm_head.dense": ("dense",), "lm_head.layer_norm": ("LayerNorm",),
                "lm_head": ()},
}


def hf_to_mlm_params(state_dict: Mapping[str, np.ndarray], config: BertConfig):
    """The checkpoint's masked-LM head as an `MlmHead` tree, or None when it has none.

    Returns None unless every head tensor is present (a partial head is not a head).
    """
    flat = {}
    for hf_prefix, module in _MLM_NAMES[config.model_type].items():
        for leaf in _MLM_LEAVES[module]:
            value = state_dict.get(f"{hf_prefix}.{flax_to_hf_name((leaf,))}")
            if value is None:
                return None
            flat[module + (leaf,)] = _to_hf((leaf,), np.asarray(value, np.float32))
    return flax.traverse_util.unflatten_dict(flat)
