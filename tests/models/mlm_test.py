"""The masked-LM head: logits equal transformers' BertForMaskedLM / RobertaForMaskedLM; masking."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsim.formats.hf import hf_to_encoder_params, hf_to_mlm_params
from jaxsim.models.bert import BertConfig, BertModel
from jaxsim.models.encoder import SentenceEncoder, check_params, init_params, mlm_logits
from jaxsim.models.mlm import IGNORE, MlmHead, mask_tokens, mlm_loss
from tests.conftest import random_padded_ids


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_mlm_logits_match_transformers(model_type):
    torch = pytest.importorskip("torch")
    import transformers

    torch.manual_seed(0)
    # No dropout, so the training-mode path (mlm_logits) is comparable to eval-mode torch.
    common = dict(vocab_size=101, hidden_size=36, num_hidden_layers=2, num_attention_heads=3,
                  intermediate_size=37, max_position_embeddings=40, hidden_act="gelu",
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if model_type == "roberta":
        hf_config = transformers.RobertaConfig(type_vocab_size=1, pad_token_id=1, **common)
        model = transformers.RobertaForMaskedLM(hf_config)
    else:
        hf_config = transformers.BertConfig(type_vocab_size=2, **common)
        model = transformers.BertForMaskedLM(hf_config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.eval()
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    config = BertConfig.from_hf_dict(hf_config.to_dict())
    encoder_params, report = hf_to_encoder_params(state, config)
    head_params = hf_to_mlm_params(state, config)
    assert head_params is not None
    assert any(n.startswith(("cls.", "lm_head.")) for n in report.ignored)

    rng = np.random.default_rng(0)
    ids, mask = random_padded_ids(rng, [7, 4, 9], 101, config.pad_token_id)
    with torch.no_grad():
        expected = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
    hidden = BertModel(config, add_pooler=False).apply(
        {"params": encoder_params["bert"]}, ids, mask).hidden_states[-1]
    embeddings = encoder_params["bert"]["embeddings"]["word_embeddings"]["embedding"]
    logits = MlmHead(config).apply({"params": head_params}, hidden, embeddings)
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(logits)[real], expected.numpy()[real], atol=2e-4)
    # The encoder's own path: the head rides in its tree and mlm_logits uses it.
    encoder = SentenceEncoder(config, pooler="avg", mlm=True)
    check_params(encoder, encoder_params, "checkpoint")
    np.testing.assert_array_equal(encoder_params["mlm_head"]["bias"], head_params["bias"])
    via_encoder = mlm_logits(encoder, encoder_params, ids, mask, np.zeros_like(ids),
                             jax.random.key(0))
    np.testing.assert_allclose(np.asarray(via_encoder)[real], expected.numpy()[real], atol=2e-4)


def test_encoder_mlm_tree_and_pretrained_head():
    config = BertConfig(vocab_size=30, hidden_size=12, num_hidden_layers=1,
                        num_attention_heads=3, intermediate_size=13, max_position_embeddings=20)
    encoder = SentenceEncoder(config, pooler="avg", mlm=True)
    params = init_params(encoder, jax.random.key(0))
    assert params["mlm_head"]["dense"]["kernel"].shape == (12, 12)
    np.testing.assert_array_equal(params["mlm_head"]["bias"], 0.0)
    head = jax.tree.map(lambda x: np.full(x.shape, 0.5, np.float32), params["mlm_head"])
    loaded = init_params(encoder, jax.random.key(0), mlm_params=head)
    np.testing.assert_array_equal(loaded["mlm_head"]["bias"], 0.5)
    # The vectors do not depend on the head; a model without mlm accepts the extra subtree.
    check_params(SentenceEncoder(config, pooler="avg"), params, "workdir")


def test_checkpoint_without_head_gives_none():
    config = BertConfig(vocab_size=10, hidden_size=6, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=7)
    assert hf_to_mlm_params({"cls.predictions.bias": np.zeros(10)}, config) is None


def test_mask_tokens_rates_and_specials():
    key = jax.random.key(0)
    ids = jnp.asarray(np.random.default_rng(1).integers(5, 1000, (64, 128)), jnp.int32)
    ids = ids.at[:, 0].set(101).at[:, -1].set(102)
    mask = jnp.ones_like(ids).at[:, 100:].set(0)
    masked, labels = mask_tokens(key, ids, mask, special_ids=(101, 102, 0), mask_id=103,
                                 vocab_size=1000)
    chosen = np.asarray(labels != IGNORE)
    assert not chosen[:, 0].any() and not chosen[:, 100:].any()  # specials and padding
    eligible = 64 * 99
    assert abs(chosen.sum() / eligible - 0.15) < 0.02
    np.testing.assert_array_equal(np.asarray(labels)[chosen], np.asarray(ids)[chosen])
    as_mask = np.asarray(masked)[chosen] == 103
    kept = np.asarray(masked)[chosen] == np.asarray(ids)[chosen]
    assert abs(as_mask.mean() - 0.8) < 0.04
    assert abs(kept.mean() - 0.1) < 0.03  # unchanged (a random draw rarely hits the same id)
    np.testing.assert_array_equal(np.asarray(masked)[~chosen], np.asarray(ids)[~chosen])


def test_mlm_loss_matches_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
    labels = np.full((2, 5), IGNORE)
    labels[0, 1], labels[1, 3], labels[1, 4] = 3, 0, 6
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -np.mean([logp[0, 1, 3], logp[1, 3, 0], logp[1, 4, 6]])
    np.testing.assert_allclose(mlm_loss(jnp.asarray(logits), jnp.asarray(labels)), expected,
                               rtol=1e-6)
    assert float(mlm_loss(jnp.asarray(logits), jnp.full((2, 5), IGNORE))) == 0.0
