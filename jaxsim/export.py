"""Export a trained (or any loaded) encoder to Hugging Face and sentence-transformers folders.

    python -m jaxsim export --checkpoint WORKDIR_OR_HF_FOLDER --out DIR
        [--format hf|sentence-transformers] [--pooler NAME] [--step best|latest|N]
        [--post whitening[:K]|sn|natsv:K --fit-data SENTENCES.txt] [--normalize] [--overwrite]

`hf` writes `config.json`, `model.safetensors` (PyTorch `BertModel`/`RobertaModel` names and
layouts, via `jaxsim.convert.hf_bert.params_to_hf`) and the tokenizer files, so
`transformers.AutoModel.from_pretrained(DIR)` gives jaxsim's hidden states. A SimCSE head
trained over CLS is stored as `pooler.dense`, so `pooler_output` is jaxsim's 'cls' vector.

`sentence-transformers` adds the modules that make `SentenceTransformer(DIR).encode` return
jaxsim's sentence vectors for the pooler the model was trained/evaluated with, built only from
stock modules (no custom code), each one exact:
  cls                -> Pooling(cls) + Dense(pooler dense, Tanh)
  cls_before_pooler  -> Pooling(cls)
  avg                -> Pooling(mean)
  avg_top2 / avg_first_last / avg_embed_last
                     -> WeightedLayerPooling (0/1 weights picking the two layers) + Pooling(mean)
then an optional Dense carrying an affine calibration z = (x - mu) W (weight W^T, bias -mu W,
identity activation) and an optional Normalize. The choices are recorded in
`jaxsim_export.json`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

FORMATS = ("hf", "sentence-transformers")
# Poolers averaging two hidden layers: (first, second) indices into hidden_states, as pooling.py.
_LAYER_PAIRS = {"avg_top2": (-2, -1), "avg_first_last": (1, -1), "avg_embed_last": (0, -1)}
_TANH = "torch.nn.modules.activation.Tanh"
_IDENTITY = "torch.nn.modules.linear.Identity"


class ExportError(ValueError):
    """An export that cannot be done as asked; the message says why and what to do."""


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def _save_tensors(path: Path, tensors: dict) -> None:
    from safetensors.numpy import save_file
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()},
              str(path), metadata={"format": "pt"})


def _check_out(out: Path, overwrite: bool, sources: Sequence[Path]) -> None:
    """Refuses a non-empty output folder (unless overwrite) and one that holds a source."""
    out = out.absolute()
    for src in sources:
        src = Path(src).absolute()
        if out == src or out in src.parents:
            raise ExportError(f"--out {out} would overwrite the model being exported ({src})")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"--out {out} is not empty; pass --overwrite to replace its contents")


def layer_weights(pooler: str, num_layers: int) -> tuple[int, np.ndarray]:
    """(layer_start, weights) for ST WeightedLayerPooling reproducing a two-layer average.

    WeightedLayerPooling computes sum_i w_i h[start + i] / sum_i w_i over hidden_states[start:];
    unit weights on the two chosen layers (2 if they coincide) give exactly (h_a + h_b) / 2.
    """
    n_states = num_layers + 1
    first, second = (i % n_states for i in _LAYER_PAIRS[pooler])
    start = min(first, second)
    weights = np.zeros(n_states - start, np.float32)
    weights[first - start] += 1.0
    weights[second - start] += 1.0
    return start, weights


def _st_modules(model, folder: Path, pooler: str, whitening, normalize: bool,
                max_length: int) -> list[dict]:
    """Writes the sentence-transformers module folders; returns the modules.json entries."""
    hidden = model.config.hidden_size
    modules = [("sentence_transformers.models.Transformer", "")]
    _write_json(folder / "sentence_bert_config.json",
                {"max_seq_length": int(max_length), "do_lower_case": False})
    if pooler in _LAYER_PAIRS:
        start, weights = layer_weights(pooler, model.config.num_hidden_layers)
        sub = f"{len(modules)}_WeightedLayerPooling"
        _write_json(folder / sub / "config.json", {
            "word_embedding_dimension": hidden, "layer_start": start,
            "num_hidden_layers": model.config.num_hidden_layers})
        _save_tensors(folder / sub / "model.safetensors", {"layer_weights": weights})
        modules.append(("sentence_transformers.models.WeightedLayerPooling", sub))
    sub = f"{len(modules)}_Pooling"
    mean = pooler not in ("cls", "cls_before_pooler")
    _write_json(folder / sub / "config.json", {
        "word_embedding_dimension": hidden,
        "pooling_mode_cls_token": not mean,
        "pooling_mode_mean_tokens": mean,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False})
    modules.append(("sentence_transformers.models.Pooling", sub))
    if pooler == "cls":
        # BERT's pooler (or the SimCSE head folded into it): tanh(CLS @ kernel + bias).
        dense = model.params["pooler"]["dense"]
        sub = f"{len(modules)}_Dense"
        _write_json(folder / sub / "config.json", {
            "in_features": hidden, "out_features": hidden, "bias": True,
            "activation_function": _TANH})
        _save_tensors(folder / sub / "model.safetensors", {
            "linear.weight": np.asarray(dense["kernel"]).T, "linear.bias": dense["bias"]})
        modules.append(("sentence_transformers.models.Dense", sub))
    if whitening is not None:
        mu = np.asarray(whitening.mu, np.float64)  # [D]
        w = np.asarray(whitening.W, np.float64)  # [D, K]
        sub = f"{len(modules)}_Dense"
        _write_json(folder / sub / "config.json", {
            "in_features": int(w.shape[0]), "out_features": int(w.shape[1]), "bias": True,
            "activation_function": _IDENTITY})
        # (x - mu) W = x W + (-mu W): torch Linear weight is W^T [K, D], bias -mu W [K].
        _save_tensors(folder / sub / "model.safetensors",
                      {"linear.weight": w.T, "linear.bias": -(mu @ w)})
        modules.append(("sentence_transformers.models.Dense", sub))
    if normalize:
        sub = f"{len(modules)}_Normalize"
        (folder / sub).mkdir(parents=True, exist_ok=True)
        modules.append(("sentence_transformers.models.Normalize", sub))
    _write_json(folder / "config_sentence_transformers.json", {
        "__version__": {"jaxsim": _version()}, "similarity_fn_name": "cosine",
        "prompts": {}, "default_prompt_name": None})
    entries = [{"idx": i, "name": str(i), "path": p, "type": t} for i, (t, p) in enumerate(modules)]
    _write_json(folder / "modules.json", entries)
    return entries


def _version() -> str:
    try:
        from jaxsim import __version__
        return __version__
    except ImportError:  # pragma: no cover
        return "unknown"


def export_model(model, out: Union[str, os.PathLike], format: str = "hf",
                 pooler: Optional[str] = None, whitening=None, normalize: bool = False,
                 max_length: Optional[int] = None, overwrite: bool = False,
                 source: Optional[str] = None) -> Path:
    """Writes `model` (a `jaxsim.pretrained.Pretrained`) as a Hugging Face / ST folder.

    Args:
      model: the encoder (config, params, tokenizer).
      out: output folder; must be absent or empty unless `overwrite`.
      format: 'hf' or 'sentence-transformers'.
      pooler: the sentence pooler (default: `model.default_pooler`); required for the ST format.
      whitening: an affine `jaxsim.calibration.Whitening` (mu [D], W [D, K]) applied after pooling.
      normalize: L2-normalize the final vectors (ST format).
      max_length: token limit recorded for ST (default: jaxsim.encode's default for the model).
      overwrite: replace a non-empty `out`.
      source: where the model came from (recorded in jaxsim_export.json).

    Returns:
      The output folder.
    """
    from jaxsim.convert.hf_bert import params_to_hf
    from jaxsim.models.pooling import PoolerError, check_pooler

    if format not in FORMATS:
        raise ExportError(f"unknown --format {format!r}; choose one of {FORMATS}")
    out = Path(out)
    sources = [Path(model.path)] if model.path and Path(model.path).exists() else []
    _check_out(out, overwrite, sources)
    pooler = pooler or model.default_pooler
    if format == "sentence-transformers" and pooler is None:
        raise ExportError(f"{model.path}: the model records no pooler; pass --pooler "
                          "(cls, cls_before_pooler, avg, avg_top2, avg_first_last, avg_embed_last)")
    if pooler is not None:
        try:
            check_pooler(pooler, model.has_pooler)
        except PoolerError as e:
            raise ExportError(str(e)) from None
    if format == "hf" and (whitening is not None or normalize):
        raise ExportError("--post / --normalize need --format sentence-transformers "
                          "(a plain Hugging Face folder has no place for them)")
    if whitening is not None and whitening.dim_in != model.config.hidden_size:
        raise ExportError(f"whitening expects {whitening.dim_in}-dim vectors, the model gives "
                          f"{model.config.hidden_size}")
    if max_length is None:
        from jaxsim.encode import default_max_length
        max_length = default_max_length(model)

    tensors = params_to_hf(model.params, model.config)  # raises naming mismatched tensors
    hf_config = model.config.to_hf_dict()
    if format == "sentence-transformers" and pooler in _LAYER_PAIRS:
        hf_config["output_hidden_states"] = True  # ST passes all layers only when this is set

    out.absolute().parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temp folder and swap it in, so a failure never leaves a half export.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.absolute().parent))
    try:
        _write_json(tmp / "config.json", hf_config)
        _save_tensors(tmp / "model.safetensors", tensors)
        model.tokenizer.save_pretrained(str(tmp))
        record = {"jaxsim_version": _version(), "format": format, "pooler": pooler,
                  "source": source or model.path, "normalize": bool(normalize),
                  "post": None if whitening is None else {
                      "kind": whitening.kind, "dim_in": whitening.dim_in,
                      "dim_out": whitening.dim_out}}
        if format == "sentence-transformers":
            record["modules"] = _st_modules(model, tmp, pooler, whitening, normalize, max_length)
            record["max_seq_length"] = int(max_length)
        _write_json(tmp / "jaxsim_export.json", record)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _load_source(checkpoint: Path, step: str):
    """A train workdir or an HF/ST folder -> (Pretrained, whether it is a workdir)."""
    from jaxsim import checkpoint as ckpt_lib
    from jaxsim.pretrained import is_train_workdir, load_pretrained

    if not checkpoint.exists():
        raise ExportError(f"--checkpoint {checkpoint}: no such folder")
    if is_train_workdir(checkpoint):
        which = int(step) if step.isdigit() else step
        return ckpt_lib.load_pretrained_from_workdir(checkpoint, which=which), True
    if (checkpoint / "checkpoints").is_dir() and not (checkpoint / "config.json").is_file():
        raise ExportError(f"{checkpoint / 'config.json'}: train config not found (the workdir has "
                          "checkpoints/ but no config.json naming the base model and pooler)")
    if not (checkpoint / "config.json").is_file():
        raise ExportError(f"{checkpoint / 'config.json'}: not found; --checkpoint must be a train "
                          "workdir (config.json + checkpoints/) or a Hugging Face model folder")
    return load_pretrained(checkpoint), False


def _has_normalize(folder: Path) -> bool:
    modules = folder / "modules.json"
    if not modules.is_file():
        return False
    try:
        entries = json.loads(modules.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return False
    return any(str(e.get("type", "")).endswith("Normalize") for e in entries)


def fit_affine_post(model, pooler: str, spec: str, fit_data: Optional[Path], batch_size: int,
                    max_length: Optional[int]):
    """Encodes the fit sentences with jaxsim and fits the `--post` calibration on them."""
    from jaxsim.calibration import fit_post, parse_post
    from jaxsim.data.senteval import load_sentences
    from jaxsim.encode import encode

    kind, _ = parse_post(spec)
    if kind == "none":
        return None
    if kind == "flow":
        raise ExportError("--post flow is not affine: sentence-transformers has no stock module "
                          "for it; export without --post and apply the flow in jaxsim")
    if fit_data is None:
        raise ExportError(f"--post {spec} needs --fit-data FILE (one sentence a line) to fit on")
    sentences = load_sentences(fit_data)
    x = encode(model, sentences, pooler=pooler, batch_size=batch_size, max_length=max_length)
    return fit_post(spec, x)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxsim export",
        description="Export a jaxsim train workdir or a Hugging Face folder to HF / "
                    "sentence-transformers format.")
    p.add_argument("--checkpoint", required=True, type=Path,
                   help="train workdir (config.json + checkpoints/) or a Hugging Face model folder")
    p.add_argument("--out", required=True, type=Path, help="output folder (absent or empty)")
    p.add_argument("--format", default="hf", choices=FORMATS)
    p.add_argument("--pooler", default=None,
                   help="sentence pooler; default: the one the run was trained/evaluated with "
                        "(a workdir refuses a different one)")
    p.add_argument("--step", default="best", help="workdir checkpoint: best | latest | N")
    p.add_argument("--post", default="none",
                   help="affine calibration baked in as a Dense module: "
                        "whitening[:K] | sn | natsv:K")
    p.add_argument("--fit-data", type=Path, default=None,
                   help="sentences (one a line) to fit --post on")
    p.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="append Normalize (default: as the source ST folder, else off)")
    p.add_argument("--max-length", type=int, default=None, help="token limit (ST max_seq_length)")
    p.add_argument("--batch-size", type=int, default=64, help="encoding batch for --post fitting")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return p


def run(args: argparse.Namespace) -> Path:
    """The export command on parsed arguments; returns the output folder."""
    # Cheap checks first: a bad --out or --post must fail before any model loading or tracing.
    _check_out(args.out, args.overwrite, [args.checkpoint])
    from jaxsim.calibration import parse_post
    kind, _ = parse_post(args.post)
    if kind != "none" and args.format != "sentence-transformers":
        raise ExportError("--post needs --format sentence-transformers")
    model, is_workdir = _load_source(args.checkpoint, args.step)
    pooler = args.pooler
    if is_workdir and pooler is not None and pooler != model.default_pooler:
        raise ExportError(
            f"{args.checkpoint} was trained and evaluated with pooler {model.default_pooler!r}; "
            f"exporting it with --pooler {pooler!r} would give different vectors")
    pooler = pooler or model.default_pooler
    if pooler is None and args.format == "hf":
        pooler = "cls" if model.has_pooler else "cls_before_pooler"
    normalize = args.normalize if args.normalize is not None else (
        args.format == "sentence-transformers" and not is_workdir
        and _has_normalize(args.checkpoint))
    whitening = None
    if kind != "none":
        if pooler is None:
            raise ExportError("--post needs a pooler: pass --pooler")
        whitening = fit_affine_post(model, pooler, args.post, args.fit_data, args.batch_size,
                                    args.max_length)
    return export_model(model, args.out, format=args.format, pooler=pooler, whitening=whitening,
                        normalize=normalize, max_length=args.max_length,
                        overwrite=args.overwrite, source=str(args.checkpoint))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m jaxsim export ...`; returns the exit status (errors are one clear line)."""
    from jaxsim.checkpoint import CheckpointError
    from jaxsim.convert.hf_bert import CheckpointMismatchError
    from jaxsim.models.bert import ConfigError

    args = build_parser().parse_args(argv)
    known = (ExportError, CheckpointError, CheckpointMismatchError, ConfigError, ValueError,
             FileNotFoundError)
    try:
        from jaxsim.pretrained import ModelLoadError
        known = known + (ModelLoadError,)
        out = run(args)
    except known as e:
        print(f"jaxsim export: error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} -> {out} ({args.format})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
