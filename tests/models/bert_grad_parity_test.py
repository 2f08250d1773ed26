"""Gradients of the Flax encoder (fused query/key/value product, fused bias + GELU backward)
against PyTorch autograd on the same weights, float32, every parameter."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxsim
from jaxsim.formats.hf import params_to_hf
from jaxsim.models.bert import BertModel
from tests.conftest import random_padded_ids


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_parameter_gradients_match_pytorch(tiny_model_dir, model_type):
    folder, torch_model = tiny_model_dir(model_type, add_pooler=False)
    model = jaxsim.load_pretrained(folder)
    config = model.config
    rng = np.random.default_rng(0)
    ids, mask = random_padded_ids(rng, [5, 13, 9], config.vocab_size, config.pad_token_id)
    weights = rng.standard_normal(ids.shape + (config.hidden_size,)).astype(np.float32)
    weights *= mask[..., None]  # only real tokens enter the loss

    bert = BertModel(config, add_pooler=False)

    def loss(params):
        out = bert.apply({"params": params}, jnp.asarray(ids, jnp.int32),
                         jnp.asarray(mask, jnp.int32))
        # Every layer's output enters the loss, so every layer's gradient path is checked.
        return sum(jnp.sum(h * weights) for h in out.hidden_states[1:])

    ours = params_to_hf(jax.grad(loss)(model.params["bert"]), config)

    torch_model.eval()  # dropout off; gradients flow the same
    torch_model.zero_grad()
    out = torch_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                      output_hidden_states=True)
    w = torch.tensor(weights)
    sum((h * w).sum() for h in out.hidden_states[1:]).backward()
    theirs = {name: p.grad.numpy() for name, p in torch_model.named_parameters()
              if p.grad is not None}
    assert set(theirs) <= set(ours) and len(theirs) > 20
    for name, grad in theirs.items():
        scale = max(1.0, float(np.abs(grad).max()))
        np.testing.assert_allclose(ours[name], grad, atol=2e-5 * scale, rtol=0, err_msg=name)
