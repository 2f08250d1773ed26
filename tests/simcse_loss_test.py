"""SimCSE objectives vs a plain NumPy implementation, and the two-view dropout property."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from jaxsim.models.bert import BertConfig
from jaxsim.models.simcse import SimCSEModel, init_params, to_bert_params
from jaxsim.objectives import simcse as obj


def _np_cos(a, b):
    a = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-8)
    b = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-8)
    return a @ b.T


def _np_ce_diag(logits):
    logits = logits - logits.max(axis=1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return -np.mean(np.diag(logp[:, :logits.shape[0]]))


def _np_unsup(z1, z2, temp):
    return _np_ce_diag(_np_cos(z1, z2) / temp)


def _np_sup(z1, z2, z3, temp, w):
    # The reference: cat([cos(z1,z2), cos(z1,z3)], 1) / temp, then + weight on z3's diagonal.
    n = len(z1)
    logits = np.concatenate([_np_cos(z1, z2) / temp, _np_cos(z1, z3) / temp], axis=1)
    logits[:, n:] += w * np.eye(n)
    return _np_ce_diag(logits)


@pytest.fixture
def views():
    rng = np.random.default_rng(0)
    return [rng.normal(size=(7, 13)).astype(np.float64) for _ in range(3)]


@pytest.mark.parametrize('temp', [0.05, 1.0])
def test_unsup_matches_numpy(views, temp):
    z1, z2, _ = views
    got = obj.unsup_simcse_loss(jnp.asarray(z1, jnp.float32), jnp.asarray(z2, jnp.float32), temp)
    np.testing.assert_allclose(float(got), _np_unsup(z1, z2, temp), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('w', [0.0, 0.7])
def test_sup_matches_numpy(views, w):
    z1, z2, z3 = views
    f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    got = obj.sup_simcse_loss(f(z1), f(z2), f(z3), 0.05, hard_negative_weight=w)
    np.testing.assert_allclose(float(got), _np_sup(z1, z2, z3, 0.05, w), rtol=1e-5, atol=1e-5)


def test_hard_negative_weight_changes_loss(views):
    z1, z2, z3 = (jnp.asarray(v, jnp.float32) for v in views)
    a = obj.sup_simcse_loss(z1, z2, z3, 0.05, 0.0)
    b = obj.sup_simcse_loss(z1, z2, z3, 0.05, 1.0)
    assert float(b) > float(a)  # a larger hard-negative logit can only raise the CE


def test_unsup_loss_is_permutation_equivariant(views):
    # Shuffling the batch (both views alike) must not change the loss: a check on the targets.
    z1, z2, _ = (jnp.asarray(v, jnp.float32) for v in views)
    perm = np.random.default_rng(1).permutation(7)
    np.testing.assert_allclose(float(obj.unsup_simcse_loss(z1, z2)),
                               float(obj.unsup_simcse_loss(z1[perm], z2[perm])), rtol=1e-6)


def test_alignment_uniformity_match_numpy(views):
    x, y, _ = views
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    yn = y / np.linalg.norm(y, axis=1, keepdims=True)
    want_align = np.mean(np.linalg.norm(xn - yn, axis=1) ** 2)
    sq = [np.sum((xn[i] - xn[j]) ** 2) for i in range(7) for j in range(i + 1, 7)]
    want_unif = np.log(np.mean(np.exp(-2.0 * np.asarray(sq))))
    f = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
    np.testing.assert_allclose(float(obj.alignment(f(x), f(y))), want_align, rtol=1e-5)
    np.testing.assert_allclose(float(obj.uniformity(f(x))), want_unif, rtol=1e-4, atol=1e-5)


def _jit(f):
    # -O0 XLA: these tiny graphs compile ~4x faster and the checks are numerical, not speed.
    return jax.jit(f, compiler_options={'xla_backend_optimization_level': 0})


def _tiny(dropout):
    return BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=24, max_position_embeddings=16,
                      hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)


def _batch():
    ids = np.random.default_rng(0).integers(3, 50, size=(6, 1, 9)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[:, :, 7:] = 0
    return {'input_ids': ids, 'attention_mask': mask, 'token_type_ids': np.zeros_like(ids)}


def _loss_and_views(dropout):
    from jaxsim.train_lib import TrainConfig, make_loss_fn
    model = SimCSEModel(_tiny(dropout), pooler='cls', mlp_only_train=True)
    params = init_params(model, jax.random.key(0))
    cfg = TrainConfig(train_file='x', objective='unsup')
    loss, _ = _jit(make_loss_fn(model, cfg))(params, _batch(), jax.random.key(3))
    b = _batch()
    two = {k: np.repeat(v, 2, axis=1).reshape(12, 9) for k, v in b.items()}
    z = _jit(lambda p, t: model.apply({'params': p}, t['input_ids'], t['attention_mask'],
                                         t['token_type_ids'], train=True,
                                         rngs={'dropout': jax.random.key(3)}))(params, two)
    z = np.asarray(z).reshape(6, 2, -1)
    return float(loss), z


def test_dropout_zero_gives_trivial_loss_and_identical_views():
    loss, z = _loss_and_views(0.0)
    np.testing.assert_allclose(z[:, 0], z[:, 1], atol=1e-6)
    np.testing.assert_allclose(loss, _np_unsup(z[:, 0], z[:, 0], 0.05), rtol=1e-4, atol=1e-5)


def test_dropout_on_gives_different_views():
    loss, z = _loss_and_views(0.1)
    assert np.abs(z[:, 0] - z[:, 1]).max() > 1e-3
    assert np.isfinite(loss)


def test_head_use_at_train_and_eval():
    unsup = SimCSEModel(_tiny(0.0), pooler='cls', mlp_only_train=True)
    sup = SimCSEModel(_tiny(0.0), pooler='cls', mlp_only_train=False)
    params = init_params(unsup, jax.random.key(0))
    assert set(params) == {'encoder', 'mlp'} and params['mlp']['kernel'].shape == (16, 16)
    b = {k: v[:, 0] for k, v in _batch().items()}
    cls = np.asarray(_jit(unsup.apply)({'params': params}, b['input_ids'],
                                          b['attention_mask']))
    head = np.asarray(_jit(sup.apply)({'params': params}, b['input_ids'],
                                         b['attention_mask']))
    want = np.tanh(cls @ np.asarray(params['mlp']['kernel']) + np.asarray(params['mlp']['bias']))
    np.testing.assert_allclose(head, want, atol=1e-5)
    # Folding the head into BERT's pooler gives the same 'cls' embedding (export path).
    from jaxsim.models.bert import BertModel
    out = _jit(BertModel(_tiny(0.0)).apply)({'params': to_bert_params(params)},
                                               b['input_ids'], b['attention_mask'])
    np.testing.assert_allclose(np.asarray(out.pooler_output), head, atol=1e-5)


def test_bf16_compute_keeps_fp32_master_params():
    from jaxsim.train_lib import TrainConfig, make_loss_fn
    cfg = TrainConfig(train_file='x', objective='unsup')
    f32 = SimCSEModel(_tiny(0.0), pooler='avg')
    bf16 = SimCSEModel(_tiny(0.0), pooler='avg', dtype=jnp.bfloat16)
    params = init_params(f32, jax.random.key(0))
    key = jax.random.key(1)
    l32, _ = _jit(make_loss_fn(f32, cfg))(params, _batch(), key)
    (l16, _), grads = _jit(jax.value_and_grad(make_loss_fn(bf16, cfg), has_aux=True))(
        params, _batch(), key)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    assert l16.dtype == jnp.float32 and np.isfinite(float(l16))
    np.testing.assert_allclose(float(l16), float(l32), rtol=0.05, atol=0.05)
