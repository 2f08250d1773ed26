"""SimCSE objectives vs NumPy and vs the reference's PyTorch formulation; the registry."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from jaxsim.objectives import (OBJECTIVES, ObjectiveError, check_kwargs, get_objective,
                               hyperparameters, register_objective)
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
    n = len(z1)
    logits = np.concatenate([_np_cos(z1, z2) / temp, _np_cos(z1, z3) / temp], axis=1)
    logits[:, n:] += w * np.eye(n)
    return _np_ce_diag(logits)


@pytest.fixture
def views():
    rng = np.random.default_rng(0)
    return [rng.normal(size=(7, 13)).astype(np.float64) for _ in range(3)]


def _f32(x):
    return jnp.asarray(x, jnp.float32)


@pytest.mark.parametrize('temp', [0.05, 1.0])
def test_unsup_matches_numpy(views, temp):
    z1, z2, _ = views
    got = obj.unsup_simcse_loss(_f32(z1), _f32(z2), temp)
    np.testing.assert_allclose(float(got), _np_unsup(z1, z2, temp), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('w', [0.0, 0.7])
def test_sup_matches_numpy(views, w):
    z1, z2, z3 = views
    got = obj.sup_simcse_loss(_f32(z1), _f32(z2), _f32(z3), 0.05, hard_negative_weight=w)
    np.testing.assert_allclose(float(got), _np_sup(z1, z2, z3, 0.05, w), rtol=1e-5, atol=1e-5)


def test_sup_matches_reference_torch_formulation(views):
    # The reference's cl_forward: CosineSimilarity / temp, cat with the z3 logits, plus a
    # weight matrix holding hard_negative_weight on z3's diagonal, then CrossEntropyLoss.
    torch = pytest.importorskip('torch')
    z1, z2, z3 = (torch.tensor(v, dtype=torch.float64) for v in views)
    sim = torch.nn.CosineSimilarity(dim=-1)
    temp, w = 0.05, 0.3
    cos = sim(z1.unsqueeze(1), z2.unsqueeze(0)) / temp
    z1_z3 = sim(z1.unsqueeze(1), z3.unsqueeze(0)) / temp
    cos = torch.cat([cos, z1_z3], 1)
    n = z1_z3.size(-1)
    weights = torch.tensor([[0.0] * (cos.size(-1) - n) + [0.0] * i + [w] + [0.0] * (n - i - 1)
                            for i in range(n)], dtype=torch.float64)
    want = torch.nn.CrossEntropyLoss()(cos + weights, torch.arange(cos.size(0))).item()
    z = jnp.stack([_f32(v) for v in views], axis=1)  # [B, 3, H]
    got, aux = get_objective('sup').loss(z, temp=temp, hard_negative_weight=w)
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    assert set(aux) == {'align', 'uniform'}


def test_registered_objectives_take_b_v_h(views):
    z1, z2, _ = views
    unsup = get_objective('unsup')
    assert (unsup.views, unsup.from_single) == (2, True)
    assert (get_objective('sup').views, get_objective('sup').from_single) == (3, False)
    loss, aux = unsup.loss(jnp.stack([_f32(z1), _f32(z2)], axis=1), temp=0.1)
    np.testing.assert_allclose(float(loss), _np_unsup(z1, z2, 0.1), rtol=1e-5)
    np.testing.assert_allclose(float(aux['align']), float(obj.alignment(_f32(z1), _f32(z2))))
    assert hyperparameters(get_objective('sup')) == {'temp': 0.05, 'hard_negative_weight': 0.0}


def test_hard_negative_weight_raises_loss(views):
    z1, z2, z3 = (_f32(v) for v in views)
    assert float(obj.sup_simcse_loss(z1, z2, z3, 0.05, 1.0)) > float(
        obj.sup_simcse_loss(z1, z2, z3, 0.05, 0.0))


def test_unsup_loss_is_permutation_invariant(views):
    z1, z2, _ = (_f32(v) for v in views)
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
    np.testing.assert_allclose(float(obj.alignment(_f32(x), _f32(y))), want_align, rtol=1e-5)
    np.testing.assert_allclose(float(obj.uniformity(_f32(x))), want_unif, rtol=1e-4, atol=1e-5)


def test_replica_mean_gradient_equals_the_references_data_parallel_gradient(views):
    # The reference (cl_forward on N GPUs) all-gathers z without gradient and puts back its
    # own rows, so each rank back-propagates the global loss through its rows only; DDP
    # averages the ranks' gradients. Computed here in float64 PyTorch, rank by rank, against
    # jaxsim's gradient divided by the replica count (grad_reduction='replica_mean').
    torch = pytest.importorskip('torch')
    world, per_rank, temp = 3, 2, 0.05
    z = np.stack(views[:2], axis=1)[:world * per_rank]  # [6, 2, 13]
    shared = torch.tensor(z, dtype=torch.float64, requires_grad=True)
    sim = torch.nn.CosineSimilarity(dim=-1)
    total = torch.zeros_like(shared)
    for rank in range(world):
        own = shared[rank * per_rank:(rank + 1) * per_rank]
        z1_list = [shared[r * per_rank:(r + 1) * per_rank, 0].detach() for r in range(world)]
        z2_list = [shared[r * per_rank:(r + 1) * per_rank, 1].detach() for r in range(world)]
        z1_list[rank], z2_list[rank] = own[:, 0], own[:, 1]
        z1, z2 = torch.cat(z1_list, 0), torch.cat(z2_list, 0)
        cos = sim(z1.unsqueeze(1), z2.unsqueeze(0)) / temp
        loss = torch.nn.CrossEntropyLoss()(cos, torch.arange(cos.size(0)))
        total += torch.autograd.grad(loss, shared)[0]
    ddp = (total / world).numpy()
    ours = jax.grad(lambda x: get_objective('unsup').loss(x, temp=temp)[0])(_f32(z)) / world
    np.testing.assert_allclose(np.asarray(ours), ddp, rtol=1e-4, atol=1e-6)
    assert np.abs(ddp).max() > 1e-2


def test_user_objective_registers_and_checks_its_hyperparameters():
    @register_objective('test_margin', views=2, from_single=True, replace=True)
    def margin(z, margin=0.2, *, scale):
        return jnp.mean(z) * scale + margin, {'m': jnp.asarray(margin)}

    objective = get_objective('test_margin')
    assert 'test_margin' in OBJECTIVES and objective.loss is margin
    assert objective.accepts(1) and objective.accepts(2) and not objective.accepts(3)
    assert check_kwargs(objective, {'scale': 2.0}) == {'scale': 2.0}
    with pytest.raises(ObjectiveError, match="takes no argument 'temp' .*margin, scale"):
        check_kwargs(objective, {'scale': 1.0, 'temp': 0.1})
    with pytest.raises(ObjectiveError, match="needs objective_kwargs 'scale'"):
        check_kwargs(objective, {})
    with pytest.raises(ObjectiveError, match="unknown objective 'nope'; choose one of .*sup"):
        get_objective('nope')
    with pytest.raises(ObjectiveError, match='already registered'):
        register_objective('unsup', views=2)(margin)


def test_bad_temperature_is_a_clear_error():
    z = jnp.ones((4, 2, 3))
    with pytest.raises(ObjectiveError, match='temp must be a positive number'):
        get_objective('unsup').loss(z, temp=0.0)


def test_numeric_hyperparameters_given_as_text_are_refused():
    # Else the traced loss fails on `cos / '0.05'` with a TypeError naming no argument.
    with pytest.raises(ObjectiveError, match="objective 'unsup': temp must be a number, got "
                                             "'0.05'"):
        check_kwargs(get_objective('unsup'), {'temp': '0.05'})
    with pytest.raises(ObjectiveError, match='hard_negative_weight must be a number, got True'):
        check_kwargs(get_objective('sup'), {'hard_negative_weight': True})
    assert check_kwargs(get_objective('sup'), {'temp': 1, 'hard_negative_weight': 0.5})
