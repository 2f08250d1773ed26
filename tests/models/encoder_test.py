"""SentenceEncoder and the pooler registry: one param tree, module initializers, plug-in poolers."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsim.models import encoder as encoder_lib
from jaxsim.models.bert import BertConfig, BertModel
from jaxsim.models.encoder import SentenceEncoder, check_params, init_fn, init_params, param_shapes
from jaxsim.models.poolers import POOLERS, PoolerError, get_pooler, masked_mean, register_pooler

TINY = BertConfig(vocab_size=50, hidden_size=12, num_hidden_layers=2, num_attention_heads=3,
                  intermediate_size=13, max_position_embeddings=20)


def _batch():
    ids = np.array([[2, 7, 9, 3, 0], [2, 5, 3, 0, 0]], np.int32)
    return ids, (ids > 0).astype(np.int32)


def test_param_tree_has_bert_and_only_parametric_pooler():
    avg = param_shapes(SentenceEncoder(TINY, pooler="avg"))
    cls = param_shapes(SentenceEncoder(TINY, pooler="cls"))
    assert set(avg) == {"bert"}
    assert set(cls) == {"bert", "pooler"}
    assert cls["pooler"]["dense"]["kernel"].shape == (12, 12)
    assert "pooler" not in cls["bert"]  # BERT's own pooler layer lives under 'pooler' only


def test_encoder_equals_bert_plus_pooling_function():
    ids, mask = _batch()
    encoder = SentenceEncoder(TINY, pooler="avg_first_last")
    params = init_params(encoder, jax.random.key(0))
    out = encoder.apply({"params": params}, ids, mask)
    hidden = BertModel(TINY, add_pooler=False).apply({"params": params["bert"]}, ids, mask)
    states = hidden.hidden_states
    expected = masked_mean((states[1] + states[-1]) / 2, mask)
    np.testing.assert_allclose(out, expected, atol=1e-6)
    # Padding never counts: the second row equals the same sentence without padding.
    short = encoder.apply({"params": params}, ids[1:, :3], mask[1:, :3])
    np.testing.assert_allclose(out[1], short[0], atol=1e-5)


def test_cls_head_and_mlp_only_train():
    ids, mask = _batch()
    encoder = SentenceEncoder(TINY, pooler="cls", mlp_only_train=True)
    params = init_params(encoder, jax.random.key(1))
    raw = encoder.apply({"params": params}, ids, mask, train=False)
    head = encoder.apply({"params": params}, ids, mask, train=True,
                         rngs={"dropout": jax.random.key(0)})
    cls = BertModel(TINY, add_pooler=False).apply({"params": params["bert"]}, ids, mask)
    np.testing.assert_allclose(raw, cls.hidden_states[-1][:, 0], atol=1e-6)
    assert np.all(np.abs(head) <= 1.0)  # tanh output
    with_head = encoder.clone(mlp_only_train=False).apply({"params": params}, ids, mask)
    dense = params["pooler"]["dense"]
    np.testing.assert_allclose(
        with_head, np.tanh(np.asarray(raw) @ np.asarray(dense["kernel"]) + dense["bias"]),
        atol=1e-5)


def test_init_honors_module_initializers_and_is_deterministic():
    @register_pooler("zero_init_scale_test")
    class Scaled(nn.Module):
        config: BertConfig
        dtype: object = jnp.float32

        @nn.compact
        def __call__(self, output, attention_mask, use_head=True):
            scale = self.param("scale", nn.initializers.zeros, (self.config.hidden_size,))
            return masked_mean(output.hidden_states[-1], attention_mask) * (1.0 + scale)

    encoder = SentenceEncoder(TINY, pooler="zero_init_scale_test")
    a = init_params(encoder, jax.random.key(3))
    b = init_params(encoder, jax.random.key(3))
    c = init_params(encoder, jax.random.key(4))
    np.testing.assert_array_equal(a["pooler"]["scale"], 0.0)  # its own zeros initializer
    flat_a = traverse_util.flatten_dict(a, sep="/")
    flat_b = traverse_util.flatten_dict(b, sep="/")
    flat_c = traverse_util.flatten_dict(c, sep="/")
    assert all(np.array_equal(flat_a[k], flat_b[k]) for k in flat_a)
    kernel = "bert/encoder/layer_0/attention/self/query/kernel"
    assert not np.array_equal(flat_a[kernel], flat_c[kernel])
    # BERT's N(0, 0.02) initializer.
    assert 0.01 < float(np.std(flat_a[kernel])) < 0.03
    np.testing.assert_array_equal(flat_a["bert/embeddings/LayerNorm/scale"], 1.0)


def test_init_with_pretrained_bert_keeps_fresh_pooler():
    encoder = SentenceEncoder(TINY, pooler="cls")
    pretrained = init_params(SentenceEncoder(TINY, pooler="avg"), jax.random.key(7))["bert"]
    params = init_params(encoder, jax.random.key(8), bert_params=pretrained)
    for (k1, v1), (k2, v2) in zip(traverse_util.flatten_dict(params["bert"]).items(),
                                  traverse_util.flatten_dict(pretrained).items()):
        assert k1 == k2
        np.testing.assert_array_equal(v1, v2)
    assert "dense" in params["pooler"]
    wrong = dict(pretrained, embeddings={})
    with pytest.raises(PoolerError, match="missing bert/embeddings"):
        init_params(encoder, jax.random.key(8), bert_params=wrong)


def _flat(tree):
    return traverse_util.flatten_dict(dict(tree), sep="/")


def test_pretrained_init_draws_the_rest_as_the_full_init_does():
    encoder = SentenceEncoder(TINY, pooler="cls", mlm=True)
    key = jax.random.key(5)
    ids = jnp.zeros((1, 2), jnp.int32)
    # Every subtree drawn at once, as a random init of the whole module does.
    full = jax.jit(lambda k: encoder.init(k, ids, ids)["params"])(key)
    bert = jax.tree.map(lambda x: np.full(x.shape, 0.25, np.float32), full["bert"])
    head = jax.tree.map(lambda x: np.full(x.shape, -0.5, np.float32), full["mlm_head"])
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    replicated = NamedSharding(mesh, P())
    shardings = jax.tree.map(lambda _: replicated, param_shapes(encoder))
    for supplied in ({"bert": bert}, {"bert": bert, "mlm_head": head}, {"mlm_head": head}):
        params = init_params(encoder, key, shardings, bert_params=supplied.get("bert"),
                             mlm_params=supplied.get("mlm_head"))
        assert set(params) == {"bert", "pooler", "mlm_head"}
        for name, tree in params.items():
            expected = _flat(supplied.get(name, full[name]))
            got = _flat(tree)
            assert got.keys() == expected.keys()
            for k, value in got.items():
                np.testing.assert_array_equal(value, expected[k], err_msg=f"{name}/{k}")
                assert value.dtype == np.float32 and value.sharding == replicated, k


def test_supplied_subtrees_are_not_computed(monkeypatch):
    encoder = SentenceEncoder(TINY, pooler="cls")
    key = jax.random.key(0)
    shapes = param_shapes(encoder)

    def nbytes(tree):
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))

    assert set(jax.eval_shape(init_fn(encoder, skip=("bert",)), key)) == {"pooler"}
    full = jax.jit(init_fn(encoder)).lower(key).compile().memory_analysis()
    rest = jax.jit(init_fn(encoder, skip=("bert",))).lower(key).compile().memory_analysis()
    assert full.output_size_in_bytes >= nbytes(shapes)
    # Outputs and temporaries together hold less than half of what the skipped 'bert' would.
    assert rest.output_size_in_bytes + rest.temp_size_in_bytes < nbytes(shapes["bert"]) / 2
    # init_params draws through that function, skipping what is supplied.
    skipped = []
    monkeypatch.setattr(encoder_lib, "init_fn", lambda enc, skip=(): (
        skipped.append(tuple(skip)), init_fn(enc, skip))[1])
    bert = jax.tree.map(lambda x: np.zeros(x.shape, np.float32), shapes["bert"])
    assert set(init_params(encoder, key, bert_params=bert)) == {"bert", "pooler"}
    assert skipped == [("bert",)]
    # Nothing left to draw (an 'avg' pooler has no parameters): no random draw at all.
    avg = SentenceEncoder(TINY, pooler="avg")
    bert = jax.tree.map(lambda x: np.zeros(x.shape, np.float32), param_shapes(avg)["bert"])
    params = init_params(avg, key, bert_params=bert)
    assert set(params) == {"bert"} and skipped == [("bert",)]
    assert all(not np.any(np.asarray(v)) for v in jax.tree.leaves(params))


def test_check_params_names_the_problem():
    avg_params = init_params(SentenceEncoder(TINY, pooler="avg"), jax.random.key(0))
    with pytest.raises(PoolerError, match="pooler 'cls' needs parameters"):
        check_params(SentenceEncoder(TINY, pooler="cls"), avg_params, "model.safetensors")
    other = BertConfig(vocab_size=50, hidden_size=12, num_hidden_layers=3, num_attention_heads=3,
                       intermediate_size=13, max_position_embeddings=20)
    with pytest.raises(PoolerError, match="missing bert/encoder/layer_2"):
        check_params(SentenceEncoder(other, pooler="avg"), avg_params, "ckpt")


def test_registry_errors_and_user_function_pooler():
    with pytest.raises(PoolerError, match="unknown pooler 'nope'"):
        get_pooler("nope")
    with pytest.raises(PoolerError, match="already registered"):
        register_pooler("avg")(lambda output, mask: output.hidden_states[-1][:, 0])

    @register_pooler("last_token_test")
    def last_token(output, mask):
        idx = jnp.sum(mask, axis=1) - 1
        return output.hidden_states[-1][jnp.arange(mask.shape[0]), idx]

    ids, mask = _batch()
    encoder = SentenceEncoder(TINY, pooler="last_token_test")
    params = init_params(encoder, jax.random.key(0))
    out = encoder.apply({"params": params}, ids, mask)
    states = BertModel(TINY, add_pooler=False).apply({"params": params["bert"]}, ids, mask)
    np.testing.assert_allclose(out[0], states.hidden_states[-1][0, 3], atol=1e-6)
    np.testing.assert_allclose(out[1], states.hidden_states[-1][1, 2], atol=1e-6)
    assert "last_token_test" in POOLERS and get_pooler("last_token_test").export is None


@pytest.mark.parametrize("name", ["avg_top2", "avg_first_last", "avg_embed_last"])
def test_layer_average_export_rule_weights(name):
    rule = get_pooler(name).export
    modules = rule(None, TINY, True)
    assert [m.short_name for m in modules] == ["WeightedLayerPooling", "Pooling"]
    weights = modules[0].tensors["layer_weights"]
    start = modules[0].config["layer_start"]
    first, second = {"avg_top2": (-2, -1), "avg_first_last": (1, -1),
                     "avg_embed_last": (0, -1)}[name]
    expected = np.zeros(TINY.num_hidden_layers + 1)
    expected[first % 3] += 1
    expected[second % 3] += 1
    np.testing.assert_array_equal(weights, expected[start:])
