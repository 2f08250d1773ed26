"""jaxsim's plug points used from outside the package, end to end: a new objective, a pooler
with parameters and its export rule, a calibration and a flow layer, each registered here
without touching jaxsim/. Train 3 steps with the objective and pooler, evaluate with the
calibration, fit a flow with the layer, export, and reload with sentence-transformers."""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
