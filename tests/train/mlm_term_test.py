"""SimCSE's auxiliary MLM term: the total is contrastive + weight x MLM, and a run with it trains,
checkpoints the head and loads back as a plain sentence encoder."""
import jax
import numpy as np

import jaxsim
from configs.tiny_unsup_simcse import get_config
from jaxsim.models.bert import BertConfig
from jaxsim.models.encoder import SentenceEncoder, init_params
from jaxsim.objectives import get_objective
from jaxsim.objectives.mlm import MlmSettings
from jaxsim.train.config import TrainConfig, base_config
from jaxsim.train.loop import train_and_evaluate
from jaxsim.train.step import compiler_options, configure_jax, make_loss_fn

configure_jax()


def _batch(b=4, views=1, seed=0):
    ids = np.random.default_rng(seed).integers(5, 60, size=(b, views, 10)).astype(np.int32)
    ids[..., 0], ids[..., 7] = 1, 2  # [CLS]-like and [SEP]-like ids
    mask = np.ones_like(ids)
    mask[..., 8:] = 0
    return {'input_ids': ids, 'attention_mask': mask, 'token_type_ids': np.zeros_like(ids)}


def test_total_is_contrastive_plus_weighted_mlm():
    config = BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=20, max_position_embeddings=16)
    encoder = SentenceEncoder(config, pooler='cls', mlp_only_train=True, mlm=True)
    params = init_params(encoder, jax.random.key(0))
    settings = MlmSettings(weight=0.3, probability=0.4, special_ids=(0, 1, 2), mask_id=3,
                           vocab_size=60)
    loss = get_objective('unsup').loss
    with_fn, plain_fn = make_loss_fn(encoder, loss, 2, settings), make_loss_fn(encoder, loss, 2)
    key, batch = jax.random.key(5), _batch()

    def run(p):  # one compiled program for everything the test reads
        with_mlm, aux = with_fn(p, batch, key)
        mlm_grads = jax.grad(lambda q: with_fn(q, batch, key)[1]['mlm'])(p)
        (plain, plain_aux), plain_grads = jax.value_and_grad(plain_fn, has_aux=True)(
            p, batch, key)
        return with_mlm, aux, plain, plain_aux, mlm_grads, plain_grads

    with_mlm, aux, plain, plain_aux, mlm_grads, plain_grads = jax.jit(
        run, compiler_options=compiler_options(True))(params)
    assert float(aux['mlm']) > 0 and 'mlm' not in plain_aux
    np.testing.assert_allclose(float(with_mlm), float(plain) + 0.3 * float(aux['mlm']),
                               rtol=1e-5)
    # The MLM term alone has a gradient on the head and on the shared encoder weights (the
    # word embeddings and the layers); the contrastive term none on the head.
    largest = lambda tree: max(float(np.abs(x).max()) for x in jax.tree.leaves(tree))  # noqa: E731
    assert largest(mlm_grads['mlm_head']) > 1e-3
    for part in ('embeddings', 'encoder'):
        assert largest(mlm_grads['bert'][part]) > 1e-4, part
    assert largest(plain_grads['mlm_head']) == 0.0


def test_run_with_mlm_trains_and_loads_back(tmp_path):
    corpus = tmp_path / 'corpus.txt'
    corpus.write_text('\n'.join(f'sentence number {i} about a topic {i % 7}' for i in range(64)))
    fields = base_config().to_dict()
    fields.update(get_config().to_dict())
    fields.update(train_file=str(corpus), mlm_weight=0.1, max_steps=2)
    cfg = TrainConfig.from_dict(fields)
    result = train_and_evaluate(cfg, tmp_path / 'run', progress=False)
    assert result.steps == 2 and np.isfinite(result.final_loss)
    metrics = [line for line in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
    assert any('"mlm"' in line for line in metrics)
    model = jaxsim.load_pretrained(tmp_path / 'run')
    assert 'mlm_head' in model.params
    vectors = jaxsim.encode(model, ['a sentence', 'another one'])
    assert vectors.shape == (2, 32) and np.all(np.isfinite(vectors))
