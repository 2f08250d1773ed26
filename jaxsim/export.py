"""The export workflow: a `SentenceModel` as a Hugging Face or sentence-transformers folder
(docs/export.md).

It sits above encode and calibrate (it encodes fit sentences and fits a calibration to bake
in) and writes through jaxsim/formats/: hf.py (PyTorch names), st_folder.py (modules.json and
the module folders), st_flow.py (a flow's PyTorch form). `hf` writes BERT's pooler layer for a
pooler whose parameters ARE that layer (`Pooler.hf_pooler`) and whenever the model carries it
unused, and refuses a pooler with parameters of its own. `sentence-transformers` adds the
pooler's export rule's modules, the model's head, a calibration (a Dense for an affine one, a
PyTorch module file for a flow) and Normalize; a pooler's own parameters also go, as jaxsim
names them, into `jaxsim_pooler.safetensors` (a rule has no inverse). Every export records its
choices and provenance in `jaxsim_export.json`, which `jaxsim.load_pretrained` reads back.
"""
from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import flax.traverse_util
import numpy as np

from jaxsim import calibrate
from jaxsim.calibrate.flow import BERT_FLOW_AS_RUN, FlowCalibration, resolve_config
from jaxsim.data.readers import read_sentences
from jaxsim.encode import encode
from jaxsim.errors import JaxsimError
from jaxsim.flows.config import FlowError
from jaxsim.formats import st_flow
from jaxsim.formats.hf import encoder_params_to_hf
from jaxsim.formats.pretrained import describe_provenance, load_pretrained, provenance
from jaxsim.formats.st_folder import (
    POOLER_FILE,
    RECORD_FILE,
    ends_with_normalize,
    has_normalize_module,
    head_modules,
    save_tensors,
    write_modules,
)
from jaxsim.formats.st_modules import IDENTITY, StModule, st_dense, st_normalize
from jaxsim.formats.workdir import is_train_workdir
from jaxsim.model import SentenceModel
from jaxsim.models import st_head
from jaxsim.models.encoder import param_shapes
from jaxsim.models.poolers import get_pooler
from jaxsim.models.st_head import HeadError
from jaxsim.storage import store

FORMATS = ("hf", "sentence-transformers")

# sentence-transformers modules that read every layer's output: the Transformer module passes
# them on only when the Hugging Face config sets output_hidden_states.
_READS_ALL_LAYERS = ("WeightedLayerPooling",)


def _version() -> str:
    try:
        return importlib.metadata.version("jaxsim")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


class ExportError(JaxsimError):
    """An export that cannot be done as asked; the message says why and what to do."""


# ------------------------------------------------------------------------------ the output
def _is_previous_export(folder) -> None:
    """The only non-empty folder `overwrite` replaces: a previous export."""
    if any(folder.iterdir()) and not (folder / RECORD_FILE).exists():
        raise ExportError(f"--out {folder} is not empty and holds no {RECORD_FILE}: not a "
                          f"previous export, so --overwrite will not delete it")


def check_out(out: Union[str, os.PathLike], overwrite: bool,
              sources: Sequence[Union[str, os.PathLike]] = ()) -> store.Path:
    """Refuses an output that would destroy something: a source model, an existing target
    (without `overwrite`), or, even with it, a non-empty folder that is not a jaxsim export."""
    target = store.as_path(out, "--out")
    if not store.is_remote(target):
        absolute = Path(os.fspath(target)).absolute()
        for src in sources:
            src = Path(src).absolute()
            if absolute == src or absolute in src.parents:
                raise ExportError(f"--out {absolute} would overwrite the model being exported "
                                  f"({src})")
    store.refuse_existing(target, overwrite, "--out")
    if target.exists() and not target.is_dir():
        raise ExportError(f"--out {target} exists and is not a folder")
    if target.exists():
        _is_previous_export(target)
    store.check_reachable(target, "--out")
    return target


# ------------------------------------------------------------------ sentence-transformers
def is_flow(calibration_class: type) -> bool:
    """Whether export writes calibrations of this class as a flow's PyTorch module."""
    return isinstance(calibration_class, type) and issubclass(calibration_class, FlowCalibration)


def own_pooler_params(model: SentenceModel) -> Optional[dict]:
    """The parameters of the model's pooler other than BERT's pooler layer (a user pooler's,
    e.g. a scale and shift), flat by '/' path; None for a pooler without any, or an
    `hf_pooler` one ('cls'), whose parameters are BERT's pooler layer in model.safetensors."""
    if get_pooler(model.pooler).hf_pooler or "pooler" not in param_shapes(model.encoder):
        return None
    return flax.traverse_util.flatten_dict(dict(model.params["pooler"]), sep="/")


def _hf_refusal(model: SentenceModel, own: Mapping) -> str:
    """Why --format hf cannot carry a pooler's own parameters, and what can."""
    names = ", ".join(f"pooler/{k}" for k in sorted(own))
    carrier = ("export it with --format sentence-transformers, whose export rule writes them"
               if get_pooler(model.pooler).export is not None else
               "give the pooler a sentence-transformers export rule (register_pooler(..., "
               "export=rule)) and export it with --format sentence-transformers")
    where = f"{model.path}: " if model.path else ""
    return (f"{where}pooler {model.pooler!r} has parameters of its own ({names}), which a "
            f"Hugging Face model folder has no place for (it holds BERT's pooler layer only): "
            f"{carrier}")


def pooler_modules(model: SentenceModel) -> list[StModule]:
    """The sentence-transformers modules reproducing the model's pooler, by its export rule."""
    pooler = get_pooler(model.pooler)
    if pooler.export is None:
        # --format hf refuses a pooler's own parameters too: do not send the user there.
        other = ("export --format hf, or choose a pooler that has one"
                 if own_pooler_params(model) is None else "or choose another pooler")
        raise ExportError(f"pooler {model.pooler!r} has no sentence-transformers export rule "
                          f"(register it with register_pooler(..., export=rule)); {other}")
    use_head = not model.encoder.mlp_only_train
    return list(pooler.export(model.params.get("pooler"), model.config, use_head))


def affine_of(calibration: calibrate.Calibration) -> tuple[np.ndarray, np.ndarray]:
    """(mu [D], W [D, K]) of an affine calibration; an ExportError for any other."""
    pair = calibration.affine()
    if pair is None:
        raise ExportError(f"calibration {calibration.describe()!r} is not affine: "
                          f"sentence-transformers has no stock module for it; export accepts "
                          f"{', '.join(exportable_calibrations())}")
    return tuple(np.asarray(a, np.float64) for a in pair)


def calibration_module(calibration: calibrate.Calibration, dim: int) -> StModule:
    """A Dense module computing z = (x - mu) W = x W + (-mu W), exactly the calibration; a
    flow's PyTorch module for a flow."""
    if is_flow(type(calibration)):
        return st_flow.flow_module(calibration, dim, ExportError)
    mu, w = affine_of(calibration)
    if mu.shape != (dim,) or w.ndim != 2 or w.shape[0] != dim:
        raise ExportError(f"the calibration maps {w.shape[0]}-dim vectors (mu {mu.shape}, W "
                          f"{w.shape}); the model gives {dim}-dim vectors")
    return st_dense(w, -(mu @ w), IDENTITY)  # kernel W [D, K], bias -mu W


def st_modules(model: SentenceModel, calibration: Any = None,
               normalize: bool = False) -> list[StModule]:
    """Modules after the Transformer: pooler rule, the model's own head, then calibration
    Dense, then Normalize."""
    modules = pooler_modules(model) + head_modules(model.head)
    if calibration is not None:
        width = st_head.output_size(model.head, model.hidden_size)
        modules.append(calibration_module(calibration, width))
    if normalize and not ends_with_normalize(modules):
        modules.append(st_normalize())
    return modules


# ---------------------------------------------------------------------------- the export
def _is_bert_pooler_layer(params: Mapping, hidden: int) -> bool:
    flat = flax.traverse_util.flatten_dict(dict(params.get("pooler") or {}))
    return {k: tuple(np.shape(v)) for k, v in flat.items()} == {
        ("dense", "kernel"): (hidden, hidden), ("dense", "bias"): (hidden,)}


def hf_tensors(model: SentenceModel) -> dict[str, np.ndarray]:
    """The model's PyTorch state dict, with BERT's pooler layer for an `hf_pooler` pooler and
    whenever the model carries one (the source checkpoint's, unused by e.g. 'avg'): it is part
    of the Hugging Face model, and without it transformers reports it missing and initializes
    it at random on every load. A pooler's own parameters are not that layer."""
    include = get_pooler(model.pooler).hf_pooler or (
        own_pooler_params(model) is None and _is_bert_pooler_layer(model.params, model.hidden_size))
    return encoder_params_to_hf(model.params, model.config, include_pooler=include)


def describe_calibration(calibration: calibrate.Calibration) -> dict:
    """The record's description of a calibration (never its parameters)."""
    common = {"spec": calibration.spec, "describe": calibration.describe(),
              "note": calibration.note}
    if is_flow(type(calibration)):
        return {"kind": "flow", **common, "dim_in": calibration.dim, "dim_out": calibration.dim}
    mu, w = affine_of(calibration)
    # The spec's name, not parse_spec: a saved calibration of a kind not registered here
    # (calibrate.load's affine fallback) is exported all the same.
    kind = calibration.spec.partition(":")[0] if calibration.spec else type(calibration).__name__
    return {"kind": kind, **common, "dim_in": int(w.shape[0]), "dim_out": int(w.shape[1])}


def export_model(model: SentenceModel, out: Union[str, os.PathLike], format: str = "hf", *,
                 calibration: Any = None, normalize: bool = False,
                 max_length: Optional[int] = None, overwrite: bool = False,
                 source: Optional[str] = None, provenance: Optional[Mapping] = None) -> Path:
    """Writes `model` (with its own pooler) as a Hugging Face or sentence-transformers folder.

    Args:
      model: the encoder (e.g. `jaxsim.load_pretrained(WORKDIR)`); `model.with_pooler(name)`
        exports another pooler.
      out: output folder: absent, empty, or a previous export when `overwrite`.
      format: 'hf' or 'sentence-transformers'.
      calibration: an affine calibration or a flow applied after pooling
        (sentence-transformers only).
      normalize: L2-normalize the final vectors (sentence-transformers only).
      max_length: token limit (sentence-transformers `max_seq_length`); default: the model's.
      overwrite: replace a previous export in `out`.
      source: where the model came from, for the record (default: `model.path`).
      provenance: recorded as is under 'provenance' (e.g. a workdir's step and metric).

    Returns:
      The output folder.
    """
    if format not in FORMATS:
        raise ExportError(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}")
    if format == "hf" and any(isinstance(m, st_head.Dense) for m in model.head):
        raise ExportError(f"{model.path} applies a Dense module after pooling: export it with "
                          f"--format sentence-transformers (a Hugging Face model folder has no "
                          f"place for it)")
    if format == "hf" and (calibration is not None or normalize):
        raise ExportError("a calibration or normalize needs --format sentence-transformers "
                          "(a Hugging Face model folder has no place for them)")
    own = own_pooler_params(model)
    if format == "hf" and own is not None:
        raise ExportError(_hf_refusal(model, own))
    sources = [model.path] if model.path and Path(model.path).exists() else []
    out = check_out(out, overwrite, sources)
    max_length = model.max_length() if max_length is None else int(max_length)
    if not 2 <= max_length <= model.config.max_length:
        raise ExportError(f"max_length must be in [2, {model.config.max_length}], got {max_length}")
    # Everything that can fail on bad input is computed before anything is written.
    tensors = hf_tensors(model)
    modules = st_modules(model, calibration, normalize) if format != "hf" else []
    hf_config = model.config.to_hf_dict()
    if any(m.short_name in _READS_ALL_LAYERS for m in modules):
        hf_config["output_hidden_states"] = True
    record = {"jaxsim_version": _version(), "format": format, "pooler": model.pooler,
              "mlp_only_train": bool(model.encoder.mlp_only_train),
              "source": source or model.path, "normalize": bool(normalize),
              "post": None if calibration is None else describe_calibration(calibration),
              "max_seq_length": max_length,
              # The modules after the pooler's own (head, calibration, Normalize), for loading.
              "head_modules": len(modules) - len(pooler_modules(model)) if modules else 0}
    if own is not None:  # jaxsim's copy: the rule's modules cannot be read back as parameters
        record["pooler_params"] = POOLER_FILE
    if provenance:
        record["provenance"] = dict(provenance)
    with store.replace_dir(out, overwrite, "--out", keep=_is_previous_export) as tmp:
        store.write_json(tmp / "config.json", hf_config, indent=2)
        save_tensors(tmp / "model.safetensors", tensors)
        if own is not None:
            save_tensors(tmp / POOLER_FILE, own)
        model.tokenizer.save_pretrained(os.fspath(tmp))
        if modules:
            record["modules"] = write_modules(tmp, modules, max_length, _version())
        store.write_json(tmp / RECORD_FILE, record, indent=2)
    return out if store.is_remote(out) else Path(os.fspath(out))


# ------------------------------------------------------------- the command: source -> folder
def _exportable(cls) -> bool:
    """Affine calibrations become a Dense module, flows a PyTorch module file."""
    return bool(getattr(cls, "linear", False)) or is_flow(cls)


def exportable_calibrations() -> list[str]:
    """The --post values export accepts: the registered affine (`linear`) calibrations and the
    flow."""
    accepted = []
    for name in calibrate.CALIBRATIONS.names():
        cls = calibrate.CALIBRATIONS.get(name)
        if not _exportable(cls):
            continue
        arg = "CONFIG" if is_flow(cls) else "K" if getattr(cls, "arg_type", int) is int else "ARG"
        accepted.append({"none": name, "optional": f"{name}[:{arg}]"}.get(
            getattr(cls, "arg", "none"), f"{name}:{arg}"))
    return accepted


def check_post(spec: str, format: str) -> Optional[str]:
    """Validates `--post` before any model is loaded; returns the spec, or None for 'none'."""
    name, arg = calibrate.parse_spec(spec)
    if name == "none":
        return None
    cls = calibrate.CALIBRATIONS.get(name)
    if not _exportable(cls):
        raise ExportError(f"--post {spec} cannot be exported: {name} is not an affine map, and "
                          f"sentence-transformers has no stock module for it; export accepts "
                          f"--post {', '.join(exportable_calibrations())}")
    if format != "sentence-transformers":
        raise ExportError("--post needs --format sentence-transformers (a Hugging Face model "
                          "folder has no place for it)")
    if is_flow(cls):  # a layer without a PyTorch form, before the fit
        try:
            config = resolve_config(arg if arg is not None else BERT_FLOW_AS_RUN)
            st_flow.check_layers(config, f"--post {spec}")
        except (calibrate.CalibrationError, FlowError, HeadError) as e:
            raise ExportError(str(e)) from None
    return spec


def fit_calibration(model: SentenceModel, spec: str, fit_data: Optional[Path],
                    batch_size: int = 64, max_length: Optional[int] = None
                    ) -> calibrate.Calibration:
    """Encodes the fit sentences (one a line, blank lines skipped) and fits `spec` on them; a
    flow as eval.py fits it (seed 0, dropout-noised vectors of the same sentences)."""
    if fit_data is None:
        raise ExportError(f"--post {spec} needs --fit-data FILE (one sentence a line) to fit on")
    sentences = read_sentences(fit_data)
    vectors = encode(model, sentences, batch_size=batch_size, max_length=max_length)
    if not is_flow(calibrate.CALIBRATIONS.get(calibrate.parse_spec(spec)[0])):
        return calibrate.fit(spec, vectors)

    def noised(key):
        return encode(model, sentences, batch_size=batch_size, max_length=max_length,
                      progress=False, dropout_key=key)

    return calibrate.fit(spec, vectors, seed=0, embed=noised)


def export_source(source: Union[str, os.PathLike], out: Union[str, os.PathLike],
                  format: str = "hf", *, pooler: Optional[str] = None,
                  step: Union[str, int] = "best", post: str = "none",
                  fit_data: Optional[Path] = None,
                  calibration: Optional[Union[str, os.PathLike]] = None,
                  normalize: Optional[bool] = None,
                  max_length: Optional[int] = None, batch_size: int = 64,
                  overwrite: bool = False) -> Path:
    """`python -m jaxsim export`: loads a model source and exports it.

    Cheap checks (output folder, --post, --format) run before the model is loaded.

    Args:
      source: a train workdir, a Hugging Face / sentence-transformers folder, or a hub id.
      out: output folder.
      format: 'hf' or 'sentence-transformers'.
      pooler: the pooler to export; default: the source's own. A train workdir is exported
        with the pooler it was trained and evaluated with (another one is refused).
      step: a workdir's checkpoint: 'best', 'latest' or a step number.
      post: a calibration to bake in ('none', 'whitening[:K]', 'sn', 'natsv:K',
        'flow[:CONFIG]').
      fit_data: sentences to fit `post` on.
      calibration: a saved calibration folder (`Calibration.save`) to bake in instead of
        fitting one; it must be affine or a flow, fitted on this model's vectors.
      normalize: append Normalize; default: as the source sentence-transformers folder.
      max_length: token limit, for the export and for encoding the fit sentences.
      batch_size: encoding batch for the fit.
      overwrite: replace a previous export in `out`.
    """
    if format not in FORMATS:
        raise ExportError(f"unknown --format {format!r}; choose one of {', '.join(FORMATS)}")
    check_out(out, overwrite, [source] if Path(source).exists() else [])
    post = check_post(post, format)
    loaded = None
    if calibration is not None:
        if post is not None:
            raise ExportError("pass either --post (fit a calibration) or --calibration (a "
                              "saved one), not both")
        if format != "sentence-transformers":
            raise ExportError("--calibration needs --format sentence-transformers")
        loaded = calibrate.load(calibration)
        if is_flow(type(loaded)):  # a flow with PyTorch layers, else an error
            st_flow.check_layers(loaded.config, f"--calibration {calibration}", ExportError)
        else:
            affine_of(loaded)  # an affine one, or a clear error before the model is loaded
    if normalize and format == "hf":
        raise ExportError("--normalize needs --format sentence-transformers")
    # Flags a Hugging Face folder (or an export without --post) has no use for are refused,
    # not silently dropped.
    if max_length is not None and format == "hf":
        raise ExportError("--max-length needs --format sentence-transformers (a Hugging Face "
                          "model folder has no place for it)")
    if fit_data is not None and post is None:
        raise ExportError(f"--fit-data {fit_data} has no effect without --post (the "
                          f"calibration fitted on it)")
    workdir = Path(source).is_dir() and is_train_workdir(source)
    if step != "best" and not workdir:
        raise ExportError(f"--step {step}: {source} is not a train workdir (model.json + "
                          f"checkpoints/); --step picks one of a workdir's checkpoints")
    origin = provenance(source, step)
    if origin.get("step") == 0:
        print(f"warning: {describe_provenance(origin)}: the selected checkpoint is step 0, the "
              f"model before any training", file=sys.stderr)
    model = load_pretrained(source, which=origin.get("step", step))
    if pooler is not None and pooler != model.pooler:
        if workdir:
            raise ExportError(f"{source} was trained and evaluated with pooler "
                              f"{model.pooler!r}; exporting it with --pooler {pooler!r} would "
                              f"give other vectors than the ones it was selected on")
        model = model.with_pooler(pooler)
    if normalize is None:
        normalize = format == "sentence-transformers" and not workdir and \
            has_normalize_module(Path(model.path))
    if post is not None:
        loaded = fit_calibration(model, post, fit_data, batch_size, max_length)
        if loaded.note:  # e.g. a singular fit: fewer output dims than asked
            print(f"note: --fit-data {fit_data}: {loaded.note}", file=sys.stderr)
    return export_model(model, out, format, calibration=loaded, normalize=normalize,
                        max_length=max_length, overwrite=overwrite, source=str(source),
                        provenance=origin)
