"""A fitted jaxsim flow as a sentence-transformers module in PyTorch (`jaxsim_flow.py`).

jaxsim's sentence-transformers export copies this file, unchanged, into the exported folder as
`jaxsim_flow.py`; modules.json names its class `jaxsim_flow.JaxsimFlow` after Pooling, and
`SentenceTransformer(folder, trust_remote_code=True)` loads it. It needs only torch and
safetensors. The module maps each sentence vector x to the flow's latent z, the direction
jaxsim's `--post flow` applies (`jaxsim.flows.models.Flow.forward`), layer by layer:

  levels x depth steps; after each level but the last, the second half of the channels is set
  aside; z = [set aside after level 0, after level 1, ..., last level's output]
  actnorm            s = logscale_factor * logs; (x + b) * exp(s) (bias 'input'),
                     x * exp(s) + b (bias 'output')
  reverse            channels reversed
  linear             x W
  linear_lu          x[:, src] L U, L unit lower, U upper with diag(sign_s * exp(log_s))
  additive_coupling  z_b = x_b + net(x_a)
  affine_coupling    tanh:    z_b = x_b * exp(tanh(h_s)) + h_t, h = [h_s, h_t]
                     sigmoid: z_b = (x_b + h_t) * sigmoid(h_s + 2), h_t = h[0::2], h_s = h[1::2]
  net 'mlp'          ReLU(x W + b) per hidden layer, then a linear layer
  net 'glow'         ReLU((x W + b) * exp(3 logs)) per hidden layer, then (x W + b) * exp(3 logs)

Files of the module folder: config.json ({"dim", "levels", "depth", "step": the layers with
every option, "jaxsim": what jaxsim reads back}) and model.safetensors (the flow's parameters
under jaxsim's names, each stacked over the `depth` steps of its level).
"""
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file
from torch import nn

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
SOURCE_NAME = "jaxsim_flow.py"
LAYERS = ("actnorm", "reverse", "linear", "linear_lu", "additive_coupling", "affine_coupling")
GLOW_LOGSCALE_FACTOR = 3.0  # the glow net's exp(3 logs)


def coupling_indices(dim, mask, flip):
    """(conditioning channels a, transformed channels b) of a coupling on `dim` channels."""
    idx = list(range(dim))
    if mask == "half":
        a, b = idx[: dim // 2], idx[dim // 2:]
    elif mask == "parity":
        a, b = idx[0::2], idx[1::2]
    else:
        raise ValueError(f"jaxsim_flow: coupling mask {mask!r} is not 'half' or 'parity'")
    return (b, a) if flip else (a, b)


def _net(h, p, prefix, options):
    """The coupling's conditioner network on h [batch, n_a]."""
    hidden = int(options["hidden_layers"])
    if options["net"] == "mlp":
        for i in range(hidden):
            h = torch.relu(h @ p(f"{prefix}/Dense_{i}/kernel") + p(f"{prefix}/Dense_{i}/bias"))
        return h @ p(f"{prefix}/Dense_{hidden}/kernel") + p(f"{prefix}/Dense_{hidden}/bias")
    if options["net"] != "glow":
        raise ValueError(f"jaxsim_flow: coupling net {options['net']!r} is not 'mlp' or 'glow'")
    for i in range(hidden):
        h = torch.relu((h @ p(f"{prefix}/W_{i}") + p(f"{prefix}/b_{i}"))
                       * torch.exp(GLOW_LOGSCALE_FACTOR * p(f"{prefix}/logs_{i}")))
    return ((h @ p(f"{prefix}/W_out") + p(f"{prefix}/b_out"))
            * torch.exp(GLOW_LOGSCALE_FACTOR * p(f"{prefix}/logs_out")))


def _coupling(x, p, key, name, options):
    a_idx, b_idx = coupling_indices(x.shape[-1], options["mask"], bool(options["flip"]))
    a, b = x[:, a_idx], x[:, b_idx]
    if name == "additive_coupling":
        zb = b + _net(a, p, f"{key}/shift_net", options)
    else:
        h = _net(a, p, f"{key}/scale_shift_net", options)
        if options["scale"] == "sigmoid":
            zb = (b + h[:, 0::2]) * torch.sigmoid(h[:, 1::2] + 2.0)
        elif options["scale"] == "tanh":
            n_b = h.shape[-1] // 2
            zb = b * torch.exp(torch.tanh(h[:, :n_b])) + h[:, n_b:]
        else:
            raise ValueError(f"jaxsim_flow: affine_coupling scale {options['scale']!r} is not "
                             f"'tanh' or 'sigmoid'")
    z = torch.empty_like(x)
    z[:, a_idx] = a
    z[:, b_idx] = zb
    return z


def apply_layer(x, p, key, name, options):
    """One layer's forward on x [batch, channels]; p(name) gives its parameters."""
    if name == "actnorm":
        s = float(options["logscale_factor"]) * p(f"{key}/logs")
        if options["bias"] == "input":
            return (x + p(f"{key}/b")) * torch.exp(s)
        return x * torch.exp(s) + p(f"{key}/b")
    if name == "reverse":
        return x.flip(-1)
    if name == "linear":
        return x @ p(f"{key}/kernel")
    if name == "linear_lu":
        perm = p(f"{key}/lu/perm")
        eye = torch.eye(perm.shape[0], dtype=x.dtype, device=x.device)
        lower = torch.tril(p(f"{key}/lu/lower"), -1) + eye
        upper = torch.triu(p(f"{key}/lu/upper"), 1) + torch.diag(
            p(f"{key}/lu/sign_s") * torch.exp(p(f"{key}/lu/log_s")))
        return (x[:, torch.argmax(perm, dim=0)] @ lower) @ upper
    return _coupling(x, p, key, name, options)  # JaxsimFlow refuses any other layer


class JaxsimFlow(nn.Module):
    """Maps `features['sentence_embedding']` [batch, dim] to the fitted flow's latent z."""

    def __init__(self, config, tensors=None):
        super().__init__()
        unknown = [s["layer"] for s in config["step"] if s["layer"] not in LAYERS]
        if unknown:
            raise ValueError(f"jaxsim_flow: flow layer {unknown[0]!r} has no PyTorch form here "
                             f"(this module runs {', '.join(LAYERS)})")
        self.config = dict(config)
        self._names = {}
        for key, value in (tensors or {}).items():
            buffer = "p_" + key.replace("/", "__")  # buffer names may not hold '.'
            self._names[key] = buffer
            value = (value.detach().clone() if isinstance(value, torch.Tensor)
                     else torch.tensor(value))  # a copy: numpy arrays may be read-only
            self.register_buffer(buffer, value.to(torch.float32))

    def _param(self, level, step):
        def p(key):
            # float32 even in a half-precision model, as jaxsim applies the flow
            return getattr(self, self._names[f"l{level}/{key}"])[step].float()
        return p

    def flow(self, x):
        """x [batch, dim] -> z [batch, dim] (float32)."""
        x = x.to(torch.float32)
        levels, depth = int(self.config["levels"]), int(self.config["depth"])
        set_aside = []
        for level in range(levels):
            for step in range(depth):
                p = self._param(level, step)
                for j, spec in enumerate(self.config["step"]):
                    x = apply_layer(x, p, f"layers_{j}_{spec['layer']}", spec["layer"],
                                    spec["options"])
            if level < levels - 1:
                half = x.shape[-1] // 2
                set_aside.append(x[:, half:])
                x = x[:, :half]
        return torch.cat(set_aside + [x], dim=-1)

    def forward(self, features):
        x = features["sentence_embedding"]
        features["sentence_embedding"] = self.flow(x).to(x.dtype)
        return features

    def get_sentence_embedding_dimension(self):
        return int(self.config["dim"])

    def get_config_dict(self):
        return dict(self.config)

    def save(self, output_path, *args, **kwargs):
        os.makedirs(output_path, exist_ok=True)
        with open(os.path.join(output_path, CONFIG_NAME), "w", encoding="utf-8") as f:
            json.dump(self.config, f, indent=2)
        save_file({key: getattr(self, buffer).detach().cpu().contiguous()
                   for key, buffer in self._names.items()},
                  os.path.join(output_path, WEIGHTS_NAME), metadata={"format": "pt"})
        # modules.json's "jaxsim_flow.JaxsimFlow" is looked up at the model's root, while
        # SentenceTransformer.save copies this file into the module's own folder only.
        root_copy = os.path.join(os.path.dirname(os.path.abspath(output_path)), SOURCE_NAME)
        if os.path.abspath(__file__) != root_copy:
            shutil.copyfile(__file__, root_copy)

    @staticmethod
    def load(input_path):
        with open(os.path.join(input_path, CONFIG_NAME), encoding="utf-8") as f:
            config = json.load(f)
        return JaxsimFlow(config, load_file(os.path.join(input_path, WEIGHTS_NAME)))
