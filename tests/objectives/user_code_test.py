"""A user's objective, pooler or parameter initializer that raises or breaks its contract is one
line naming it and the user's own line, never a traceback from inside JAX; a new run that fails
so at its first step takes back what it wrote, so the corrected rerun is a new run too."""
import dataclasses
import functools
import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsim.errors import JaxsimError, UserCodeError, user_code_error
from jaxsim.models.bert import BertConfig
from jaxsim.models.encoder import SentenceEncoder
from jaxsim.models.poolers import PoolerError, register_pooler
from jaxsim.objectives import ObjectiveError, get_objective, owned, register_objective
from jaxsim.objectives.base import OBJECTIVES, with_context
from jaxsim.train import loop
from tests.conftest import tiny_run_config, write_snli_corpus

CONFIG = BertConfig(vocab_size=80, hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
                    intermediate_size=24, max_position_embeddings=24)
Z = jnp.ones((4, 2, 8), jnp.float32)


def _line_of(fn, text: str) -> int:
    """The file line of the first line of `fn`'s source that contains `text`."""
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def broken_loss(z, temp=0.05):
    raise RuntimeError('my loss is broken')


def test_a_raising_loss_is_one_line_naming_it_and_its_line():
    with pytest.raises(UserCodeError) as e:
        with_context(broken_loss)(Z)
    assert str(e.value) == (f"loss 'broken_loss' raised RuntimeError: my loss is broken "
                            f"(tests/objectives/user_code_test.py:"
                            f"{_line_of(broken_loss, 'raise')})")


@pytest.mark.parametrize('returned,message', [
    (lambda z: jnp.sum(z), " must return (scalar loss, dict of scalar diagnostics), got "
                           "an array of shape ()"),
    (lambda z: (jnp.sum(z, axis=(1, 2)), {}), ' must return a scalar loss array, got shape '
                                              '(4,)'),
    (lambda z: (1.5, {}), ' must return a scalar loss array, got float'),
    (lambda z: (jnp.sum(z), {'stats': {'cos': jnp.sum(z)}}), ": diagnostic 'stats' must be a "
                                                              "scalar, got dict"),
    (lambda z: (jnp.sum(z), {'note': None}), ": diagnostic 'note' must be a scalar, got "
                                             "NoneType"),
    (lambda z: (jnp.sum(z), {'rows': z[:, 0, 0]}), ": diagnostic 'rows' must be a scalar, got "
                                                    "shape (4,)"),
    (lambda z: (jnp.sum(z), {}, {}), " must return (scalar loss, dict of scalar diagnostics), "
                                     "got a tuple of 3"),
])
def test_a_loss_that_returns_the_wrong_thing_says_what_it_returned(returned, message):
    def loss(z):
        return returned(z)

    with pytest.raises(UserCodeError) as e:
        with_context(loss)(Z)
    assert str(e.value) == f"loss {loss.__qualname__!r}{message}"
    with pytest.raises(UserCodeError):  # traced too, as the step runs it
        jax.eval_shape(lambda z: with_context(loss)(z), Z)


def test_a_loss_that_needs_the_step_says_so_when_not_given_one():
    def with_step(z, *, step):
        return jnp.sum(z) * step, {}

    with pytest.raises(ObjectiveError, match=r"loss '.*with_step' needs step=: pass it"):
        with_context(with_step)(Z)
    assert float(with_context(with_step)(Z, step=2)[0]) == 2 * 64


def test_jaxsims_own_loss_keeps_its_traceback():
    """An error inside a built-in loss is a bug: it is not dressed as the user's."""
    unsup = functools.partial(get_objective('unsup').loss, temp=0.05)
    with pytest.raises(IndexError):
        with_context(unsup)(jnp.ones((4,)))


def test_params_and_init_params_are_declared_together():
    with pytest.raises(ObjectiveError, match="init_params is given, but its loss takes no "
                                             "params= argument"):
        register_objective('test_uc_no_params', views=2, init_params=lambda key: {})(
            lambda z: (jnp.sum(z), {}))
    with pytest.raises(ObjectiveError, match="its loss needs params= but no init_params"):
        register_objective('test_uc_no_init', views=2)(
            lambda z, *, params: (jnp.sum(z), {}))
    # params= with a default needs no initializer (the built-ins': learn_temperature off).
    register_objective('test_uc_optional', views=2, replace=True)(
        lambda z, *, params=None: (jnp.sum(z), {}))
    assert 'test_uc_no_params' not in OBJECTIVES and 'test_uc_no_init' not in OBJECTIVES


def test_jaxsims_own_initializer_keeps_its_traceback(monkeypatch):
    """A failure inside the learned temperature's init_params is a bug, not the user's."""
    from jaxsim.objectives import simcse

    def broken(key, temp=0.05, learn_temperature=False, **_):
        raise NameError('a bug')

    broken.__module__ = simcse.__name__
    unsup = get_objective('unsup')
    with pytest.raises(NameError):
        owned.init_owned(dataclasses.replace(unsup, init_params=broken),
                         {'learn_temperature': True}, jax.random.key(0))


def _objective(init):
    return type('Registered', (), {'name': 'mine', 'init_params': staticmethod(init)})()


def init_raises(key):
    return {'w': 1.0 / 0}


@pytest.mark.parametrize('init,message', [
    (init_raises, "init_params of objective 'mine' raised ZeroDivisionError: float division "
                  "by zero (tests/objectives/user_code_test.py:"),
    (lambda key: 'scale', "init_params of objective 'mine' must return a dict of arrays, got "
                          "str"),
    (lambda key: {'count': jnp.zeros((), jnp.int32)}, "init_params of objective 'mine': "
     "['count'] must be a floating-point array (it is trained), got int32"),
])
def test_an_initializer_that_raises_or_returns_the_wrong_thing_is_one_line(init, message):
    with pytest.raises(UserCodeError) as e:
        owned.init_owned(_objective(init), {}, jax.random.key(0))
    assert str(e.value).startswith(message)
    if init is init_raises:
        assert str(e.value).endswith(f":{_line_of(init_raises, 'return')})")
    made = owned.init_owned(_objective(lambda key: {'s': jnp.zeros((), jnp.bfloat16)}), {},
                            jax.random.key(0))
    assert made['s'].dtype == jnp.bfloat16


def pooler_raises(output, mask):
    return output.hidden_states[-1][:, 0] / undefined_name  # noqa: F821


class TuplePooler(nn.Module):
    """A Module pooler that returns (vectors, extra): not what a model can use."""

    config: BertConfig
    dtype: object = jnp.float32

    def __call__(self, output, attention_mask, use_head=True):
        return output.hidden_states[-1][:, 0], jnp.zeros(())


@pytest.fixture(scope='module')
def user_poolers():
    register_pooler('test_uc_raises', replace=True)(pooler_raises)
    register_pooler('test_uc_output', replace=True)(lambda output, mask: output)
    register_pooler('test_uc_tokens', replace=True)(
        lambda output, mask: output.hidden_states[-1])
    register_pooler('test_uc_tuple', replace=True)(TuplePooler)


@pytest.mark.parametrize('pooler,error,message', [
    ('test_uc_raises', UserCodeError, "pooler 'test_uc_raises' raised NameError: name "
                                      "'undefined_name' is not defined (tests/objectives/"
                                      "user_code_test.py:"),
    ('test_uc_output', PoolerError, "pooler function '<lambda>' must return an array [batch, "
                                    "hidden], got BertOutput"),
    ('test_uc_tokens', PoolerError, "pooler 'test_uc_tokens' must return one vector a "
                                    "sentence, [2, hidden], got shape (2, 5, 16)"),
    ('test_uc_tuple', PoolerError, "pooler 'test_uc_tuple' must return one vector a sentence, "
                                   "[2, hidden], got tuple"),
])
def test_a_user_pooler_that_raises_or_returns_the_wrong_shape_is_one_line(user_poolers, pooler,
                                                                          error, message):
    encoder = SentenceEncoder(CONFIG, pooler=pooler)
    ids = jnp.ones((2, 5), jnp.int32)
    with pytest.raises(error) as e:
        encoder.init(jax.random.key(0), ids, ids)
    assert str(e.value).startswith(message)


def test_user_code_error_names_the_deepest_user_frame_outside_libraries():
    def inner():
        return np.asarray([1, 2]).reshape(3)  # raises inside NumPy

    try:
        inner()
    except ValueError as e:
        error = user_code_error('loss x', e)
    assert isinstance(error, JaxsimError)
    assert str(error).endswith(f"(tests/objectives/user_code_test.py:{_line_of(inner, 'raises')})")


def first_step_fails(z, temp=0.05):
    raise RuntimeError('my loss is broken')


def test_a_run_whose_loss_fails_at_its_first_step_takes_back_what_it_wrote(tmp_path):
    corpus = tmp_path / 'corpus.txt'
    write_snli_corpus(corpus, 32)
    register_objective('test_uc_first_step', views=2, from_single=True, replace=True)(
        first_step_fails)
    workdir = tmp_path / 'run'
    cfg = tiny_run_config(corpus, objective='test_uc_first_step', max_steps=2,
                          checkpoint_every=1)
    with pytest.raises(UserCodeError, match="loss 'first_step_fails' raised RuntimeError"):
        loop.train_and_evaluate(cfg, workdir, progress=False)
    # What the run wrote is gone (the lock file of the workdir's lock stays, unheld).
    assert {p.name for p in workdir.iterdir()} <= {'.lock'}

    def fixed(z, temp=0.05):  # the user's correction: the same name, a new run
        return get_objective('unsup').loss(z, temp=temp)

    register_objective('test_uc_first_step', views=2, from_single=True, replace=True)(fixed)
    result = loop.train_and_evaluate(cfg, workdir, progress=False)
    assert result.steps == 2 and np.isfinite(result.final_loss)
