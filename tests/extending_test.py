"""jaxsim's plug points used from outside the package, end to end: a new objective, a pooler
with parameters and its export rule, a calibration and a flow layer, each registered here
without touching jaxsim/. Train 3 steps with the objective and pooler, evaluate with the
calibration, fit a flow with the layer, export, and reload with sentence-transformers and with
jaxsim (the pooler's parameters included; `--format hf` refuses them)."""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxsim
from jaxsim import calibrate
from jaxsim.calibrate import CALIBRATIONS, AffineCalibration
from jaxsim.eval.runner import CachedEncoder, evaluate_rows
from jaxsim.export import export_model
from jaxsim.flows import FLOW_LAYERS, FlowConfig, FlowOutput, layer
from jaxsim.formats.st_modules import st_dense, st_pooling
from jaxsim.models.bert import BertConfig
from jaxsim.models.poolers import masked_mean, register_pooler
from jaxsim.objectives import register_objective
from jaxsim.storage.paths import SENTEVAL_ROOT
from jaxsim.train.loop import train_and_evaluate
from jaxsim.train.step import configure_jax
from tests.conftest import tiny_run_config, write_snli_corpus

configure_jax()
_IDENTITY = "torch.nn.modules.linear.Identity"


# (a) An objective: InfoNCE between two dropout views, with its own hyperparameter and aux.
@register_objective("test_ext_infonce", views=2, from_single=True, replace=True)
def infonce(z, temp=0.1):
    a = z[:, 0] / jnp.linalg.norm(z[:, 0], axis=-1, keepdims=True)
    b = z[:, 1] / jnp.linalg.norm(z[:, 1], axis=-1, keepdims=True)
    logits = a @ b.T / temp
    loss = -jnp.mean(jnp.diagonal(jax.nn.log_softmax(logits, axis=-1)))
    return loss, {"pos_cos": jnp.mean(jnp.sum(a * b, axis=-1))}


# (b) A pooler with parameters: the mean, scaled and shifted per dimension; it exports to
# stock sentence-transformers modules (mean Pooling + an identity-activation Dense).
def _export_scaled_mean(params, config, use_head):
    kernel = np.diag(np.asarray(params["scale"], np.float32))
    return [st_pooling(config.hidden_size, "mean"),
            st_dense(kernel, np.asarray(params["shift"]), _IDENTITY)]


@register_pooler("test_ext_scaled_mean", export=_export_scaled_mean, replace=True)
class ScaledMean(nn.Module):
    config: BertConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, output, attention_mask, use_head=True):
        h = self.config.hidden_size
        scale = self.param("scale", nn.initializers.ones, (h,))
        shift = self.param("shift", nn.initializers.zeros, (h,))
        return masked_mean(output.hidden_states[-1], attention_mask) * scale + shift


# (c) A calibration: centering (affine, so export could bake it in too).
@CALIBRATIONS.register("test_ext_center", replace=True)
class Center(AffineCalibration):
    @classmethod
    def fit(cls, x, arg=None):
        x = np.asarray(x, np.float64)
        return cls(mu=x.mean(axis=0), W=np.eye(x.shape[1]))


# (d) A flow layer: a learned per-dimension affine map, logdet = sum(log_scale).
@FLOW_LAYERS.register("test_ext_diag_affine", replace=True)
class DiagAffine(nn.Module):
    features: int

    def setup(self):
        self.log_scale = self.param("log_scale", nn.initializers.zeros, (self.features,))
        self.shift = self.param("shift", nn.initializers.zeros, (self.features,))

    def forward(self, x):
        z = x * jnp.exp(self.log_scale) + self.shift
        return FlowOutput(z, jnp.full(x.shape[:1], jnp.sum(self.log_scale)))

    def inverse(self, z):
        return (z - self.shift) * jnp.exp(-self.log_scale)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ext")
    lines = write_snli_corpus(tmp / "corpus.txt", 64)
    cfg = tiny_run_config(tmp / "corpus.txt", objective="test_ext_infonce",
                          objective_kwargs={"temp": 0.2}, pooler="test_ext_scaled_mean",
                          mlp_only_train=False, max_steps=3)
    result = train_and_evaluate(cfg, tmp / "run", progress=False)
    return tmp, result, lines


def test_train_with_user_objective_and_pooler(trained):
    tmp, result, _ = trained
    assert result.steps == 3 and np.isfinite(result.final_loss)
    log = (tmp / "run" / "metrics.jsonl").read_text()
    assert '"pos_cos"' in log  # the objective's own aux reaches the log
    model = jaxsim.load_pretrained(tmp / "run")
    assert model.pooler == "test_ext_scaled_mean"
    scale = np.asarray(model.params["pooler"]["scale"])
    assert np.abs(scale - 1.0).max() > 0  # the pooler's parameters were trained


def test_evaluate_with_user_calibration(trained):
    tmp, _, _ = trained
    model = jaxsim.load_pretrained(tmp / "run")
    encode = CachedEncoder(lambda s: jaxsim.encode(model, s))
    rows = evaluate_rows(encode, "stsb", SENTEVAL_ROOT, posts=("none", "test_ext_center"),
                         split="dev", diagnostics=False)
    assert [r.post for r in rows] == ["none", "test_ext_center"]
    assert all(np.isfinite(r.avg) for r in rows)
    # Centering changes cosines, so the two rows differ.
    assert rows[0].avg != rows[1].avg


def test_flow_with_user_layer(trained):
    tmp, _, lines = trained
    model = jaxsim.load_pretrained(tmp / "run")
    x = jaxsim.encode(model, lines)
    config = FlowConfig(name="diag", levels=1, depth=2, step=(layer("test_ext_diag_affine"),),
                        objective="nats", optimizer="adam", learning_rate=0.05,
                        weight_decay=0.0, batch_size=16, max_epochs=20, val_fraction=0.0)
    flow = calibrate.fit("flow", x, config=config, seed=0)
    z = flow.apply(x)
    assert np.abs(z.mean(0)).mean() < np.abs(x.mean(0)).mean()  # moved towards the prior
    np.testing.assert_allclose(flow.inverse(z), x, atol=1e-4)


def test_export_reloads_in_sentence_transformers(trained):
    tmp, _, lines = trained
    from sentence_transformers import SentenceTransformer

    model = jaxsim.load_pretrained(tmp / "run")
    out = export_model(model, tmp / "export", format="sentence-transformers")
    st = SentenceTransformer(str(out), device="cpu")
    theirs = st.encode(lines[:10], convert_to_numpy=True)
    ours = jaxsim.encode(model, lines[:10])
    np.testing.assert_allclose(theirs, ours, atol=1e-4)


def _with_distinct_pooler(model):
    """The trained model with a scale and shift far from the identity (3 steps barely move
    them), so a reload that dropped or misread them gives visibly other vectors."""
    rng = np.random.default_rng(0)
    h = model.hidden_size
    pooler = {"scale": rng.uniform(0.5, 2.0, h).astype(np.float32),
              "shift": rng.normal(0.0, 1.0, h).astype(np.float32)}
    return model.with_params({**model.params, "pooler": pooler})


def test_export_of_a_pooler_with_parameters_loads_back(trained):
    """The sentence-transformers export of a user pooler with parameters loads back in jaxsim
    as that pooler, its parameters bit for bit, with sentence-transformers' vectors (1e-5);
    its modules changed after the export, or its parameters file missing, are one-line
    errors naming the file."""
    import shutil

    from sentence_transformers import SentenceTransformer

    from jaxsim.formats.hf_folder import ModelLoadError
    from jaxsim.models.st_head import HeadError

    tmp, _, lines = trained
    model = _with_distinct_pooler(jaxsim.load_pretrained(tmp / "run"))
    out = export_model(model, tmp / "export-pooler", format="sentence-transformers")
    theirs = SentenceTransformer(str(out), device="cpu").encode(lines[:10])
    ours = jaxsim.encode(model, lines[:10])
    np.testing.assert_allclose(theirs, ours, atol=1e-4)  # the export rule, as before

    loaded = jaxsim.load_pretrained(out)
    assert loaded.pooler == "test_ext_scaled_mean" and loaded.head == ()
    for name in ("scale", "shift"):
        np.testing.assert_array_equal(np.asarray(loaded.params["pooler"][name]),
                                      model.params["pooler"][name])
    again = jaxsim.encode(loaded, lines[:10])
    np.testing.assert_allclose(again, theirs, atol=1e-5)
    np.testing.assert_allclose(again, ours, atol=1e-6)
    # The scale and shift matter: the plain mean is far from these vectors.
    assert np.abs(jaxsim.encode(model.with_pooler("avg"), lines[:10]) - ours).max() > 0.1

    # A Dense changed after the export (sentence-transformers fine-tuned and re-saved it):
    # jaxsim would apply the parameters file instead, so it refuses.
    stale = shutil.copytree(out, tmp / "export-stale")
    dense = stale / "2_Dense" / "model.safetensors"
    tensors = load_file(str(dense))
    tensors["linear.bias"] = tensors["linear.bias"] + 1e-3
    save_file(tensors, str(dense))
    with pytest.raises(HeadError, match=f"^{dense}: linear.bias is not what pooler "
                                        f"'test_ext_scaled_mean' makes of"):
        jaxsim.load_pretrained(stale)
    missing = shutil.copytree(out, tmp / "export-missing")
    (missing / "jaxsim_pooler.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=f"^{missing}/jaxsim_pooler.safetensors: not found"):
        jaxsim.load_pretrained(missing)
    # Saved by sentence-transformers elsewhere (no jaxsim record): read by modules.json alone,
    # the mean and the rule's Dense; the same vectors.
    SentenceTransformer(str(out), device="cpu").save(str(tmp / "resaved"))
    resaved = jaxsim.load_pretrained(tmp / "resaved")
    assert resaved.pooler == "avg" and [type(m).__name__ for m in resaved.head] == ["Dense"]
    np.testing.assert_allclose(jaxsim.encode(resaved, lines[:10]), theirs, atol=1e-5)


def test_hf_export_refuses_a_pooler_with_parameters(trained, tmp_path, capsys):
    """A Hugging Face folder has no place for a user pooler's parameters: refused in one line
    naming the pooler and the format that carries it, before anything is written. The same
    weights under 'avg' export (the scale and shift are not BERT's pooler layer)."""
    from jaxsim.cli.main import main as cli_main
    from jaxsim.export import ExportError

    tmp, _, _ = trained
    model = jaxsim.load_pretrained(tmp / "run")
    with pytest.raises(ExportError, match=r"pooler 'test_ext_scaled_mean' has parameters of its "
                                          r"own \(pooler/scale, pooler/shift\).*export it with "
                                          r"--format sentence-transformers"):
        export_model(model, tmp_path / "hf", format="hf")
    assert not list(tmp_path.iterdir())
    capsys.readouterr()
    assert cli_main(["export", "--checkpoint", str(tmp / "run"), "--out", str(tmp_path / "hf"),
                     "--format", "hf"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp / 'run'}: pooler 'test_ext_scaled_mean'") and \
        err.count("\n") == 1, err
    assert not (tmp_path / "hf").exists()
    avg = export_model(model.with_pooler("avg"), tmp_path / "avg", format="hf")
    assert not any(k.startswith("pooler.") for k in load_file(str(avg / "model.safetensors")))
