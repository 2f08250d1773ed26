"""docs/extending.md's four plug-ins in one module, as a researcher's own file would hold them:
an objective (my_infonce), a pooler with parameters (scaled_mean), a calibration with a float
argument (shrinkw:A) and a flow layer (diag_affine). Commands load it with
`--import examples/my_research.py` (tests/plugins_test.py keeps it equal to the page)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxsim.calibrate import CALIBRATIONS, AffineCalibration
from jaxsim.flows import FLOW_LAYERS, FlowOutput
from jaxsim.formats.st_modules import st_dense, st_pooling
from jaxsim.models.poolers import masked_mean, register_pooler
from jaxsim.objectives import register_objective


@register_objective("my_infonce", views=2, from_single=True)   # one sentence, two dropout views
def my_infonce(z, temp=0.1):                                     # z: [batch, views, hidden]
    a = z[:, 0] / jnp.linalg.norm(z[:, 0], axis=-1, keepdims=True)
    b = z[:, 1] / jnp.linalg.norm(z[:, 1], axis=-1, keepdims=True)
    loss = -jnp.mean(jnp.diagonal(jax.nn.log_softmax(a @ b.T / temp, axis=-1)))
    return loss, {"pos_cos": jnp.mean(jnp.sum(a * b, axis=-1))}  # aux is logged as is


def export_scaled_mean(params, config, use_head):   # -> stock sentence-transformers modules
    return [st_pooling(config.hidden_size, "mean"),
            st_dense(np.diag(params["scale"]), params["shift"], "torch.nn.modules.linear.Identity")]

@register_pooler("scaled_mean", export=export_scaled_mean)
class ScaledMean(nn.Module):
    config: object
    dtype: object = jnp.float32
    @nn.compact
    def __call__(self, output, attention_mask, use_head=True):
        h = self.config.hidden_size
        scale = self.param("scale", nn.initializers.ones, (h,))
        shift = self.param("shift", nn.initializers.zeros, (h,))
        return masked_mean(output.hidden_states[-1], attention_mask) * scale + shift


@CALIBRATIONS.register("shrinkw")
class ShrinkWhitening(AffineCalibration):     # z = (x - mu) @ W; affine, so export can bake it in
    arg, arg_type = "required", float          # shrinkw:0.3 shrinks the covariance to its diagonal
    @classmethod
    def fit(cls, x, arg):
        x = np.asarray(x, np.float64)
        cov = np.cov(x, rowvar=False)
        s, u = np.linalg.eigh((1 - arg) * cov + arg * np.diag(np.diag(cov)))
        return cls(mu=x.mean(axis=0), W=u / np.sqrt(np.maximum(s, 1e-12)))


@FLOW_LAYERS.register("diag_affine")
class DiagAffine(nn.Module):
    features: int
    def setup(self):
        self.log_scale = self.param("log_scale", nn.initializers.zeros, (self.features,))
        self.shift = self.param("shift", nn.initializers.zeros, (self.features,))
    def forward(self, x):                      # -> (z, logdet per row)
        return FlowOutput(x * jnp.exp(self.log_scale) + self.shift,
                          jnp.full(x.shape[:1], self.log_scale.sum()))
    def inverse(self, z):
        return (z - self.shift) * jnp.exp(-self.log_scale)
