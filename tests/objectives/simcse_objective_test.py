"""SimCSE objectives vs NumPy and vs the reference's PyTorch formulation; the registry."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsim.objectives import (
    OBJECTIVES,
    ObjectiveError,
    check_kwargs,
    context_args,
    get_objective,
    hyperparameters,
    register_objective,
    with_context,
)
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
    assert hyperparameters(get_objective('sup')) == {'temp': 0.05, 'hard_negative_weight': 0.0,
                                                     'mask_duplicates': False,
                                                     'learn_temperature': False}


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


# ---- objectives that see the batch: ids / step / key, and mask_duplicates ------------------

def _np_masked_ce(logits, drop):
    """Mean over rows of -log softmax at column i, the columns in drop[i] removed by hand."""
    total = 0.0
    for i, row in enumerate(logits):
        keep = [j for j in range(len(row)) if j not in drop[i]]
        kept = row[keep]
        target = keep.index(i)
        m = kept.max()
        total += -(kept[target] - m - np.log(np.exp(kept - m).sum()))
    return total / len(logits)


def _ids(rows, sentences, length=6, seed=0):
    return np.random.default_rng(seed).integers(5, 90, (rows, sentences, length)).astype(np.int32)


def _unsup_value_and_grad(z, ids, mask):
    def f(z):
        return get_objective('unsup').loss(z, temp=0.05, mask_duplicates=mask, ids=ids)[0]

    value, grad = jax.value_and_grad(f)(z)
    return float(value), np.asarray(grad)


def test_unsup_mask_duplicates_leaves_the_repeated_sentence_out_of_the_softmax(views):
    z1, z2, _ = views
    z = jnp.stack([_f32(z1), _f32(z2)], axis=1)  # [7, 2, 13]
    ids = _ids(7, 1)
    ids[4] = ids[1]  # the same sentence twice in the batch
    masked, _ = _unsup_value_and_grad(z, jnp.asarray(ids), True)
    plain, _ = _unsup_value_and_grad(z, jnp.asarray(ids), False)
    logits = _np_cos(z1, z2) / 0.05
    np.testing.assert_allclose(plain, _np_unsup(z1, z2, 0.05), rtol=1e-5)
    want = _np_masked_ce(logits, {i: {4} if i == 1 else {1} if i == 4 else set()
                                  for i in range(7)})
    np.testing.assert_allclose(masked, want, rtol=1e-5)
    assert abs(masked - plain) > 1e-3
    # Paired data (D = 2): a negative equal to the anchor's positive, another with the
    # anchor's own text as its anchor.
    ids2 = _ids(7, 2, seed=1)
    ids2[5, 1] = ids2[0, 1]
    ids2[6, 0] = ids2[2, 0]
    got = float(get_objective('unsup').loss(z, mask_duplicates=True, ids=jnp.asarray(ids2))[0])
    want = _np_masked_ce(logits, {0: {5}, 5: {0}, 2: {6}, 6: {2}, 1: set(), 3: set(),
                                  4: set()})
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_mask_duplicates_without_duplicates_changes_nothing(views):
    z1, z2, z3 = (_f32(v) for v in views)
    z = jnp.stack([z1, z2], axis=1)
    ids = jnp.asarray(_ids(7, 1))
    on, g_on = _unsup_value_and_grad(z, ids, True)
    off, g_off = _unsup_value_and_grad(z, ids, False)
    assert on == off
    np.testing.assert_array_equal(g_on, g_off)
    z3v = jnp.stack([z1, z2, z3], axis=1)
    ids3 = jnp.asarray(_ids(7, 3))
    def f(z, m):
        return get_objective('sup').loss(z, hard_negative_weight=0.3, mask_duplicates=m,
                                         ids=ids3)[0]

    (a, ga), (b, gb) = (jax.value_and_grad(f)(z3v, m) for m in (True, False))
    assert float(a) == float(b)
    np.testing.assert_array_equal(np.asarray(ga), np.asarray(gb))


def test_sup_mask_duplicates_matches_numpy_with_the_columns_removed(views):
    z1, z2, z3 = views
    ids = _ids(7, 3, seed=2)
    ids[3, 0] = ids[0, 0]   # SNLI: the same premise in two examples
    ids[6, 2] = ids[2, 1]   # a hard negative with row 2's positive text
    z = jnp.stack([_f32(v) for v in views], axis=1)
    got = float(get_objective('sup').loss(z, hard_negative_weight=0.3, mask_duplicates=True,
                                          ids=jnp.asarray(ids))[0])
    plain = float(get_objective('sup').loss(z, hard_negative_weight=0.3,
                                            ids=jnp.asarray(ids))[0])
    n = 7
    logits = np.concatenate([_np_cos(z1, z2), _np_cos(z1, z3)], axis=1) / 0.05
    logits[:, n:] += 0.3 * np.eye(n)
    drop = {i: set() for i in range(n)}
    drop[0], drop[3], drop[2] = {3}, {0}, {n + 6}
    np.testing.assert_allclose(got, _np_masked_ce(logits, drop), rtol=1e-5)
    np.testing.assert_allclose(plain, _np_sup(z1, z2, z3, 0.05, 0.3), rtol=1e-5)
    assert abs(got - plain) > 1e-3


def test_mask_duplicates_needs_ids_and_a_bool():
    # The config check traces the loss with the ids the step passes: accepted there.
    assert check_kwargs(get_objective('sup'), {'mask_duplicates': True}) == {
        'mask_duplicates': True}
    z = jnp.ones((4, 2, 3))
    with pytest.raises(ObjectiveError, match='mask_duplicates needs the batch token ids'):
        get_objective('unsup').loss(z, mask_duplicates=True)
    with pytest.raises(ObjectiveError, match="objective 'sup': mask_duplicates must be true or "
                                             "false, got 'yes'"):
        check_kwargs(get_objective('sup'), {'mask_duplicates': 'yes'})
    with pytest.raises(ObjectiveError, match="objective 'unsup': ids is passed by the train "
                                             "step, not objective_kwargs"):
        check_kwargs(get_objective('unsup'), {'ids': 1})


def test_context_arguments_are_read_from_the_signature_once():
    seen = []

    def old_style(z, temp=0.1):
        return jnp.sum(z) * temp, {}

    def wants_all(z, scale=1.0, *, ids, step, key):
        seen.append((ids, step, key))
        return jnp.sum(z) * scale, {}

    def wants_step(z, step=None):
        seen.append(step)
        return jnp.sum(z), {}

    import functools
    assert context_args(old_style) == ()
    assert context_args(functools.partial(wants_all, scale=2.0)) == ('ids', 'step', 'key')
    assert context_args(wants_step) == ('step',)
    assert context_args(get_objective('sup').loss) == ('ids', 'params')
    z, ids, key = jnp.ones((2, 2, 3)), jnp.zeros((2, 1, 4), jnp.int32), jax.random.key(0)
    # An old-style loss gets the vectors only, whatever the step knows.
    assert float(with_context(old_style)(z, ids=ids, step=3, key=key)[0]) == pytest.approx(1.2)
    with_context(wants_all)(z, ids=ids, step=7, key=key)
    got_ids, got_step, got_key = seen[-1]
    assert got_ids is ids and got_step == 7
    # The objective's key is its own, not the dropout key.
    assert np.array_equal(jax.random.key_data(got_key),
                          jax.random.key_data(jax.random.fold_in(key, 2)))
    with_context(wants_step)(z, ids=ids)
    assert seen[-1] is None  # its default stands
    assert hyperparameters(OBJECTIVES.get('unsup')) == {'temp': 0.05, 'mask_duplicates': False,
                                                        'learn_temperature': False}


def test_min_batch_is_a_positive_int():
    with pytest.raises(ObjectiveError, match="min_batch must be a positive int, got 0"):
        register_objective('test_min_batch', views=2, min_batch=0)
    assert get_objective('unsup').min_batch == 2 and get_objective('sup').min_batch == 1
