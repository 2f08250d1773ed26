"""A flow exported to sentence-transformers as a PyTorch module file (`jaxsim_flow.py`):
every shipped layer's PyTorch forward equals jaxsim's, `export --post flow` loads with
trust_remote_code and gives jaxsim's flow-calibrated vectors, `jaxsim.load_pretrained` reads
the folder back, and a layer without a PyTorch form is refused in one line."""
from __future__ import annotations

import importlib.util
import json

import jax
import numpy as np
import pytest
import torch
import transformers.dynamic_module_utils
from safetensors.numpy import load_file
from sentence_transformers import SentenceTransformer

import jaxsim
from jaxsim import calibrate
from jaxsim import export as export_lib
from jaxsim.calibrate.flow import FlowCalibration, resolve_config
from jaxsim.cli.main import main as cli_main
from jaxsim.flows import FLOW_LAYERS, layer
from jaxsim.flows.layers import Reverse
from jaxsim.flows.models import make_flow
from jaxsim.formats import st_flow
from jaxsim.models.st_head import HeadError
from tests.conftest import write_tiny_model
from tests.export_test import SENTENCES, _corpus, _fails

ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A tiny random BERT folder (export_test's), loaded by jaxsim."""
    folder = tmp_path_factory.mktemp("tiny-bert")
    write_tiny_model(folder, "bert")
    return jaxsim.load_pretrained(folder)


def _torch_module():
    """jaxsim_flow.py imported as the exported file is (a file, not a jaxsim module)."""
    spec = importlib.util.spec_from_file_location("jaxsim_flow_under_test", st_flow.SOURCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", autouse=True)
def hf_modules_cache(tmp_path_factory):
    """transformers copies a folder's module file into its modules cache: a temporary one, the
    same for the whole process (the imported package keeps its first path), never $HOME."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformers.dynamic_module_utils, "HF_MODULES_CACHE",
                      str(tmp_path_factory.getbasetemp() / "hf-modules"))
        yield


def _random_flow(config, dim: int, seed: int) -> FlowCalibration:
    """A flow of `config` with every trainable parameter moved off its init (a zero-init
    coupling is the identity, which would hide a wrong network)."""
    params = make_flow(config, dim).init(jax.random.key(seed), np.zeros((2, dim), np.float32),
                                         method="forward")["params"]
    rng = np.random.default_rng(seed)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]

    def move(path, leaf):
        name = jax.tree_util.keystr(path)
        if "perm" in name or "sign_s" in name:  # fixed: a permutation and signs
            return np.asarray(leaf)
        noise = rng.standard_normal(leaf.shape).astype(np.float32)
        if "log" in name:  # small log-scales: many exp(3 logs) in a row would blow up
            return 0.05 * noise
        return np.asarray(leaf) + 0.1 * noise

    moved = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params),
                                         [move(p, v) for p, v in flat])
    cal = FlowCalibration(config, dim, moved)
    cal.spec = "flow"
    return cal


CONFIGS = {
    "bert_flow": resolve_config("bert_flow"),  # actnorm (input bias, x3), reverse, glow net
    "glow": resolve_config("glow"),  # actnorm (output bias), linear_lu, additive mlp
    "realnvp": resolve_config("realnvp"),  # affine tanh, parity mask, flip
    "linear_sigmoid": resolve_config("glow").replace(
        name="linear_sigmoid", levels=2, depth=2,
        step=(layer("linear"), layer("affine_coupling", scale="sigmoid", net="glow", width=8),
              layer("affine_coupling", scale="tanh", mask="parity", flip=True, hidden_layers=1,
                    width=8))),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_shipped_layer_forward_in_torch_equals_jaxsim(name):
    dim = 12 if name != "realnvp" else 13  # odd: the parity mask's gather path
    config = CONFIGS[name]
    if name == "realnvp":
        config = config.replace(levels=1)
    cal = _random_flow(config, dim, seed=len(name))
    module = st_flow.flow_module(cal, dim)
    assert module.type == st_flow.MODULE_TYPE == "jaxsim_flow.JaxsimFlow"
    x = np.random.default_rng(1).standard_normal((7, dim)).astype(np.float32)
    want = cal.apply(x)
    torch_flow = _torch_module().JaxsimFlow(json.loads(json.dumps(module.config)),
                                            module.tensors)
    with torch.no_grad():
        got = torch_flow.flow(torch.from_numpy(x)).numpy()
    assert got.dtype == np.float32 and got.shape == want.shape
    scale = max(1.0, float(np.abs(want).max()))
    print(f"{name}: max |torch - jaxsim| = {np.abs(got - want).max():.2e} (|z| up to "
          f"{np.abs(want).max():.1f})")
    # float32 rounding grows with the latents' size (exp of moved log-scales).
    assert np.abs(got - want).max() <= ATOL * scale, (name, np.abs(got - want).max())
    assert np.abs(want - x).max() > 0.1  # the flow moves the vectors


def test_export_post_flow_loads_in_sentence_transformers_and_back(tiny_bert, tmp_path):
    model = tiny_bert.with_pooler("avg")
    fit = tmp_path / "fit.txt"
    fit.write_text("\n".join(_corpus(96)) + "\n")
    out, plain = tmp_path / "st-flow", tmp_path / "st-plain"
    common = ["--checkpoint", model.path, "--pooler", "avg", "--format",
              "sentence-transformers", "--max-length", "64", "--no-normalize"]
    assert cli_main(["export", *common, "--out", str(out), "--post", "flow",
                     "--fit-data", str(fit)]) == 0
    assert cli_main(["export", *common, "--out", str(plain)]) == 0
    entries = json.loads((out / "modules.json").read_text())
    assert [e["type"].rsplit(".", 1)[-1] for e in entries] == [
        "Transformer", "Pooling", "JaxsimFlow"]
    assert (out / st_flow.SOURCE_FILE).read_text() == st_flow.source_text()
    record = json.loads((out / "jaxsim_export.json").read_text())
    assert record["post"]["kind"] == "flow" and record["post"]["dim_out"] == 36

    # jaxsim's vectors through the exported flow, with jaxsim's own code.
    state = json.loads((out / entries[-1]["path"] / "config.json").read_text())["jaxsim"]
    cal = FlowCalibration.from_state(state, load_file(
        str(out / entries[-1]["path"] / "model.safetensors")))
    base = jaxsim.encode(model, SENTENCES, max_length=64)
    want = cal.apply(base)
    # The export's fit is eval.py's: seed 0 on dropout-noised vectors; the same fit again
    # gives the same flow.
    again = export_lib.fit_calibration(model, "flow", fit, max_length=64).apply(base)
    np.testing.assert_allclose(again, want, atol=1e-6)

    with pytest.raises(ValueError, match="trust_remote_code"):
        SentenceTransformer(str(out), device="cpu")
    st_model = SentenceTransformer(str(out), device="cpu", trust_remote_code=True)
    got = st_model.encode(SENTENCES)
    st_plain = SentenceTransformer(str(plain), device="cpu").encode(SENTENCES)
    diff = float(np.abs(got - want).max())
    print(f"max |ST flow - jaxsim flow| = {diff:.2e} (|z| up to {np.abs(want).max():.1f})")
    assert diff <= ATOL
    assert np.abs(got - st_plain).max() > 0.1  # the flow is there

    # Read back by jaxsim: the flow applied, as `python -m jaxsim encode --model <folder>`.
    loaded = jaxsim.load_pretrained(out)
    assert [type(m).__name__ for m in loaded.head] == ["FlowHead"]
    back = jaxsim.encode(loaded, SENTENCES)
    diff_back = float(np.abs(back - got).max())
    print(f"max |jaxsim.load_pretrained(folder) - ST| = {diff_back:.2e}")
    assert diff_back <= ATOL
    sentences = tmp_path / "s.txt"
    sentences.write_text("\n".join(s for s in SENTENCES if s) + "\n")
    assert cli_main(["encode", "--model", str(out), "--input", str(sentences),
                     "--output", str(tmp_path / "v.npy")]) == 0
    np.testing.assert_allclose(np.load(tmp_path / "v.npy"), got[[i for i, s in enumerate(
        SENTENCES) if s]], atol=ATOL)
    # Saved by sentence-transformers itself, it loads again, there and in jaxsim.
    st_model.save(str(tmp_path / "resaved"))
    assert (tmp_path / "resaved" / st_flow.SOURCE_FILE).read_text() == st_flow.source_text()
    np.testing.assert_array_equal(SentenceTransformer(
        str(tmp_path / "resaved"), device="cpu", trust_remote_code=True).encode(SENTENCES), got)
    np.testing.assert_allclose(jaxsim.encode(jaxsim.load_pretrained(tmp_path / "resaved"),
                                             SENTENCES), got, atol=ATOL)
    # The same flow saved by jaxsim.calibrate and baked in with --calibration.
    cal.spec = "flow"
    cal.save(tmp_path / "cal")
    saved = tmp_path / "st-saved"
    assert cli_main(["export", *common, "--out", str(saved), "--calibration",
                     str(tmp_path / "cal")]) == 0
    np.testing.assert_allclose(SentenceTransformer(str(saved), device="cpu",
                                                   trust_remote_code=True).encode(SENTENCES),
                               got, atol=1e-6)
    # Exported again, the flow goes along.
    re_export = export_lib.export_model(loaded, tmp_path / "again", "sentence-transformers")
    kinds = [m["type"] for m in json.loads((re_export / "modules.json").read_text())]
    assert kinds[-1] == st_flow.MODULE_TYPE and (re_export / st_flow.SOURCE_FILE).is_file()
    np.testing.assert_allclose(SentenceTransformer(str(re_export), device="cpu",
                                                   trust_remote_code=True).encode(SENTENCES),
                               got, atol=ATOL)


def test_a_layer_without_torch_form_is_one_line(tiny_bert, tmp_path, capsys):
    @FLOW_LAYERS.register("mirror", replace=True)
    class Mirror(Reverse):
        """A user's layer (the same map as reverse, but not a shipped class)."""

    try:
        config_file = tmp_path / "flow_mine.py"
        config_file.write_text(
            "from jaxsim.flows import FlowConfig, layer\n"
            "def get_config():\n"
            "    return FlowConfig(name='mine', levels=1, depth=1, step=(layer('mirror'),))\n")
        fit = tmp_path / "fit.txt"
        fit.write_text("a b c\nd e f\n")
        err = _fails(capsys, ["export", "--checkpoint", tiny_bert.path, "--out",
                              str(tmp_path / "out"), "--format", "sentence-transformers",
                              "--post", f"flow:{config_file}", "--fit-data", str(fit)],
                     "flow layer 'mirror' has no PyTorch form")
        assert "additive_coupling" in err and not (tmp_path / "out").exists()
        cal = FlowCalibration(resolve_config(config_file), 4, {})
        with pytest.raises(HeadError, match="flow layer 'mirror' has no PyTorch form"):
            st_flow.flow_module(cal, 4)
        with pytest.raises(ValueError, match="flow layer 'mirror' has no PyTorch form"):
            _torch_module().JaxsimFlow({"dim": 4, "levels": 1, "depth": 1,
                                        "step": [{"layer": "mirror", "options": {}}]})
    finally:
        FLOW_LAYERS._entries.pop("mirror", None)
        FLOW_LAYERS._origins.pop("mirror", None)


def test_post_flow_is_listed_and_other_non_affine_calibrations_are_refused(capsys, tmp_path):
    assert "flow[:CONFIG]" in export_lib.exportable_calibrations()

    @calibrate.CALIBRATIONS.register("squash", replace=True)
    class Squash(calibrate.Calibration):
        @classmethod
        def fit(cls, x, arg=None):
            return cls()

        def apply(self, x):
            return np.tanh(x)

    try:
        with pytest.raises(export_lib.ExportError, match="squash is not an affine map") as e:
            export_lib.check_post("squash", "sentence-transformers")
        accepted = str(e.value).split("export accepts")[1]
        assert "whitening[:K]" in accepted and "flow[:CONFIG]" in accepted
        assert "squash" not in accepted
    finally:
        calibrate.CALIBRATIONS._entries.pop("squash", None)
        calibrate.CALIBRATIONS._origins.pop("squash", None)
