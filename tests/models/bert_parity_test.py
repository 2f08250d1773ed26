"""Parity of the Flax encoder and every pooler with PyTorch transformers (CPU, float32)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import jaxsim
from jaxsim.models.bert import BertModel
from jaxsim.models.poolers import BUILTIN_POOLERS, PoolerError
from tests.conftest import random_padded_ids

TOL = 1e-4
BUILT_IN_POOLERS = BUILTIN_POOLERS


def torch_pool(name, out, mask):
    """The reference poolers, as SimCSE's evaluation code computes them, on torch outputs."""
    h = out.hidden_states
    m = mask.unsqueeze(-1).float()

    def avg(x):
        return (x * m).sum(1) / m.sum(1)

    return {
        "cls": lambda: out.pooler_output,
        "cls_before_pooler": lambda: h[-1][:, 0],
        "avg": lambda: avg(h[-1]),
        "avg_top2": lambda: avg((h[-2] + h[-1]) / 2),
        "avg_first_last": lambda: avg((h[1] + h[-1]) / 2),
        "avg_embed_last": lambda: avg((h[0] + h[-1]) / 2),
    }[name]().numpy()


def hidden_states(model, ids, mask, token_types=None):
    """jaxsim's BERT hidden states (the 'bert' subtree of the SentenceEncoder params)."""
    return BertModel(model.config, add_pooler=False).apply(
        {"params": model.params["bert"]}, ids.astype(np.int32), mask.astype(np.int32),
        None if token_types is None else token_types.astype(np.int32))


def sentence_vectors(model, pooler, ids, mask, token_types=None):
    """The SentenceEncoder's vectors with `pooler` (evaluation mode)."""
    model = model.with_pooler(pooler)
    return np.asarray(model.encoder.apply(
        {"params": model.params}, ids.astype(np.int32), mask.astype(np.int32),
        None if token_types is None else token_types.astype(np.int32)))


def check_parity(model, torch_model, ids, mask, token_types=None):
    with torch.no_grad():
        ref = torch_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                          token_type_ids=None if token_types is None else torch.tensor(token_types),
                          output_hidden_states=True)
    out = hidden_states(model, ids, mask, token_types)
    assert len(out.hidden_states) == len(ref.hidden_states)
    real = mask[..., None].astype(bool)
    for ours, theirs in zip(out.hidden_states, ref.hidden_states):
        # Padded positions are don't-care in both implementations; compare real tokens.
        diff = np.abs(np.asarray(ours) - theirs.numpy()) * real
        assert diff.max() <= TOL
    for name in BUILT_IN_POOLERS:
        ours = sentence_vectors(model, name, ids, mask, token_types)
        np.testing.assert_allclose(ours, torch_pool(name, ref, torch.tensor(mask)), atol=TOL,
                                   rtol=0, err_msg=name)


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_tiny_random_parity(tiny_model_dir, model_type):
    folder, torch_model = tiny_model_dir(model_type)
    model = jaxsim.load_pretrained(folder)
    assert model.config.model_type == model_type
    rng = np.random.default_rng(0)
    ids, mask = random_padded_ids(rng, [3, 17, 40, 9], model.config.vocab_size,
                                  model.config.pad_token_id)
    types = None
    if model_type == "bert":  # exercise segment embeddings too
        types = (np.arange(ids.shape[1])[None, :] >= 5).astype(np.int64) * mask
    check_parity(model, torch_model, ids, mask, types)


def test_bundled_minilm_parity(bundled):
    from transformers import AutoModel

    torch_model = AutoModel.from_pretrained(bundled.path).eval()
    sentences = ["", "a man is playing a guitar .",
                 "the quick brown fox jumps over the lazy dog " * 20, "résumé naïve café ☕ 東京"]
    tok = bundled.tokenizer(sentences, padding=True, truncation=True, max_length=128,
                            return_tensors="np")
    # Truncated at 128 tokens.
    assert tok["attention_mask"].sum(1).min() == 2 and tok["attention_mask"].shape[1] == 128
    check_parity(bundled, torch_model, tok["input_ids"], tok["attention_mask"],
                 tok["token_type_ids"])


def test_padding_is_irrelevant(tiny_model_dir):
    folder, _ = tiny_model_dir("roberta")
    model = jaxsim.load_pretrained(folder)
    rng = np.random.default_rng(1)
    ids, mask = random_padded_ids(rng, [7], model.config.vocab_size, model.config.pad_token_id)
    wide_ids = np.concatenate([ids, rng.integers(5, 100, (1, 20))], axis=1)  # garbage beyond mask
    wide_mask = np.concatenate([mask, np.zeros((1, 20), mask.dtype)], axis=1)
    short = hidden_states(model, ids, mask)
    wide = hidden_states(model, wide_ids, wide_mask)
    np.testing.assert_allclose(np.asarray(wide.last_hidden_state)[:, :7],
                               np.asarray(short.last_hidden_state), atol=1e-5)
    for name in BUILT_IN_POOLERS:
        np.testing.assert_allclose(sentence_vectors(model, name, wide_ids, wide_mask),
                                   sentence_vectors(model, name, ids, mask), atol=1e-5,
                                   err_msg=name)


def test_model_without_pooler_refuses_cls(tiny_model_dir):
    folder, torch_model = tiny_model_dir("bert", add_pooler=False)
    model = jaxsim.load_pretrained(folder)
    assert not model.has_pooler_weights
    with pytest.raises(PoolerError, match="needs parameters this model does not have"):
        jaxsim.encode(model, ["hello"], pooler="cls")
    vec = jaxsim.encode(model, ["hello"], pooler="cls_before_pooler")
    assert vec.shape == (1, 36)
