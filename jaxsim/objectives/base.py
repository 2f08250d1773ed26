"""The objectives registry: a name -> how many views of each example a loss needs + the loss.

An objective is a pure function of the sentence vectors of one (micro-)batch,

    loss(z: [batch, views, hidden] float32, **hyperparameters) -> (scalar loss, aux dict)

`aux` holds scalar diagnostics, averaged over accumulated micro-batches and logged whatever
their names; the hyperparameters come from the config's `objective_kwargs`. A loss may also
name what the train step knows (CONTEXT_ARGS: `ids`, `step`, `key`, `params`) and own
parameters (`init_params=`, `jaxsim.objectives.owned`); docs/extending.md shows each.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import numbers
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxsim.errors import JaxsimError, UserCodeError, running_user_code
from jaxsim.objectives.owned import init_owned
from jaxsim.registry import Registry, describe

# loss(z [batch, views, hidden], **kwargs) -> (scalar loss, {name: scalar})
LossFn = Callable[..., tuple[Any, Mapping[str, Any]]]

# Arguments the train step passes to a loss that names them (never from objective_kwargs).
CONTEXT_ARGS = ('ids', 'step', 'key', 'params')
_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


class ObjectiveError(JaxsimError):
    """An unknown objective, bad hyperparameters, or data that does not fit the objective."""


@dataclasses.dataclass(frozen=True)
class Objective:
    """A registered training objective.

    Attributes:
      views: sentence vectors per example the loss takes (z is [batch, views, hidden]).
      loss: `loss(z, **kwargs) -> (loss, aux)`.
      from_single: a one-sentence example is repeated `views` times, the views then differing
        only by their dropout masks (unsupervised SimCSE). Otherwise the data must provide
        `views` sentences per example.
      name: the registry name.
      init_params: `init_params(key, **hyperparameters) -> pytree` of the parameters the
        objective owns ({}: none for these hyperparameters), or None (it owns none). The loss
        gets them as `params=`.
      min_batch: the fewest examples a loss's batch may hold (2 where the only negatives are
        the batch's other examples: alone, an example's loss is exactly 0).
    """

    views: int
    loss: LossFn
    from_single: bool = False
    name: str = ""
    init_params: Optional[Callable[..., Any]] = None
    min_batch: int = 1

    def accepts(self, data_views: int) -> bool:
        """Whether examples of `data_views` sentences can feed this objective."""
        return data_views == self.views or (self.from_single and data_views == 1)


def _check_objective(entry: Any) -> Optional[str]:
    if not isinstance(entry, Objective):
        return f"must be registered with @register_objective, got {describe(entry)}"
    return None


OBJECTIVES: Registry[Objective] = Registry("objective", error=ObjectiveError,
                                           check=_check_objective)


def register_objective(name: str, *, views: int, from_single: bool = False,
                       replace: bool = False, init_params: Optional[Callable[..., Any]] = None,
                       min_batch: int = 1) -> Callable[[LossFn], LossFn]:
    """Decorator registering `loss(z, **kwargs) -> (loss, aux)` as objective `name` (the
    keywords are the Objective's attributes; `replace` allows replacing one of that name). It
    returns the function unchanged."""
    if not isinstance(views, int) or views < 1:
        raise ObjectiveError(f"objective {name!r}: views must be a positive int, got {views!r}")
    if not isinstance(min_batch, int) or isinstance(min_batch, bool) or min_batch < 1:
        raise ObjectiveError(f"objective {name!r}: min_batch must be a positive int, got "
                             f"{min_batch!r}")
    if init_params is not None and not callable(init_params):
        raise ObjectiveError(f"objective {name!r}: init_params must be a function, got "
                             f"{init_params!r}")

    def add(loss: LossFn) -> LossFn:
        if not callable(loss):
            raise ObjectiveError(f"objective {name!r} must be a function, got {loss!r}")
        _check_params_argument(name, loss, init_params)
        OBJECTIVES.register(name, replace=replace)(
            Objective(views=views, loss=loss, from_single=from_single, name=name,
                      init_params=init_params, min_batch=min_batch))
        return loss

    return add


def _check_params_argument(name: str, loss: LossFn, init_params) -> None:
    """A loss gets `params=` exactly when the objective owns parameters (`init_params`)."""
    try:
        declared = inspect.signature(loss).parameters.get('params')
    except (TypeError, ValueError):  # no readable signature: nothing to hold it to
        return
    if init_params is not None and declared is None:
        raise ObjectiveError(f"objective {name!r}: init_params is given, but its loss takes no "
                             f"params= argument to receive those parameters")
    if init_params is None and declared is not None and declared.default is declared.empty:
        raise ObjectiveError(f"objective {name!r}: its loss needs params= but no init_params "
                             f"is registered to create them (register_objective(..., "
                             f"init_params=fn))")


def get_objective(name: str) -> Objective:
    """The objective registered as `name`; unknown names are an ObjectiveError listing the
    known ones. The built-in 'unsup' and 'sup' are `jaxsim.objectives.simcse`'s."""
    return OBJECTIVES.get(name)


def _parameters(loss: LossFn) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(loss).parameters.values())
    except (TypeError, ValueError):  # a callable without a readable signature: vectors only
        return []


def context_args(loss: LossFn) -> tuple[str, ...]:
    """The CONTEXT_ARGS `loss` (a function or a functools.partial of one) names after `z`."""
    named = {p.name for p in _parameters(loss)[1:] if p.kind in _NAMED}
    return tuple(n for n in CONTEXT_ARGS if n in named)


def with_context(loss: LossFn) -> Callable[..., tuple[Any, Mapping[str, Any]]]:
    """`call(z, ids=, step=, key=, params=)` -> `loss(z, <those of them loss names>)`.

    The signature is read here, once; a context value that is None is left to the loss's own
    default. `key` is the (micro-)batch's dropout key: the loss gets `fold_in(key, 2)`, a key
    of its own (1 is the masked-LM term's).
    """
    wanted = context_args(loss)
    required = {p.name for p in _parameters(loss) if p.default is p.empty}
    name = loss_name(loss)

    def call(z, *, ids=None, step=None, key=None, params=None):
        if key is not None and 'key' in wanted:
            key = jax.random.fold_in(key, 2)
        given = {'ids': ids, 'step': step, 'key': key, 'params': params}
        absent = [n for n in wanted if n in required and given[n] is None]
        if absent:
            raise ObjectiveError(f"loss {name} needs {', '.join(n + '=' for n in absent)}: "
                                 f"pass it to the loss function (e.g. loss_fn(params, batch, "
                                 f"key, step=...))")
        with running_user_code(f'loss {name}', loss):  # one line naming it, not JAX's
            out = loss(z, **{n: given[n] for n in wanted if given[n] is not None})
        return _checked_output(out, name)

    return call


def loss_name(loss: LossFn) -> str:
    """A loss's name for messages: its function's, through functools.partial."""
    fn = loss.func if isinstance(loss, functools.partial) else loss
    return repr(getattr(fn, '__qualname__', None) or getattr(fn, '__name__', None) or fn)


def _checked_output(out: Any, name: str) -> tuple[Any, Mapping[str, Any]]:
    """The loss's `(scalar loss, {name: scalar})`, or an error saying what came back instead:
    a wrong shape would otherwise fail inside the gradient with a message naming no loss."""
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[1], Mapping)):
        got = (f'a tuple of {len(out)}' if isinstance(out, (tuple, list))
               else f'an array of shape {np.shape(out)}' if hasattr(out, 'shape')
               else type(out).__name__)
        raise UserCodeError(f"loss {name} must return (scalar loss, dict of scalar "
                            f"diagnostics), got {got}")
    value, aux = out
    if not hasattr(value, 'shape') or np.ndim(value) != 0:
        raise UserCodeError(f"loss {name} must return a scalar loss array, got "
                            f"{_described(value)}")
    for key, v in aux.items():
        # A number, or an array of shape (): numpy would call a dict or None 0-d too.
        if not (isinstance(v, numbers.Number) or hasattr(v, 'shape') and np.ndim(v) == 0):
            raise UserCodeError(f"loss {name}: diagnostic {key!r} must be a scalar, got "
                                f"{_described(v)}")
    return value, aux


def _described(value: Any) -> str:
    return f'shape {np.shape(value)}' if hasattr(value, 'shape') else type(value).__name__


def hyperparameters(objective: Objective) -> dict[str, Any]:
    """The keyword arguments the loss takes after `z`, with their defaults (None: required);
    the CONTEXT_ARGS it names are not hyperparameters."""
    params = list(inspect.signature(objective.loss).parameters.values())[1:]
    return {p.name: (None if p.default is inspect.Parameter.empty else p.default)
            for p in params if p.kind in _NAMED and p.name not in CONTEXT_ARGS}


def check_kwargs(objective: Objective, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Validates config hyperparameters against the loss signature; returns them as a dict.

    Raises:
      ObjectiveError: naming an argument the loss does not take, or a required one missing.
    """
    params = list(inspect.signature(objective.loss).parameters.values())[1:]
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params)
    known = hyperparameters(objective)
    context = sorted(k for k in kwargs if k in CONTEXT_ARGS)
    if context:
        raise ObjectiveError(f"objective {objective.name!r}: {', '.join(context)} is passed by "
                             f"the train step, not objective_kwargs")
    unknown = sorted(k for k in kwargs if k not in known)
    if unknown and not takes_any:
        raise ObjectiveError(
            f"objective {objective.name!r} takes no argument {', '.join(map(repr, unknown))} "
            f"(it takes: {', '.join(known) or 'nothing'})")
    missing = [p.name for p in params if p.default is inspect.Parameter.empty
               and p.name in known and p.name not in kwargs]
    if missing:
        raise ObjectiveError(f"objective {objective.name!r} needs objective_kwargs "
                             f"{', '.join(map(repr, missing))}")
    for name, value in kwargs.items():
        if isinstance(known.get(name), bool) and not isinstance(value, bool):
            raise ObjectiveError(f"objective {objective.name!r}: {name} must be true or false, "
                                 f"got {value!r}")
        # A number given as text ('0.05' in a config file) would fail only inside the traced
        # loss, with a TypeError naming no argument.
        if isinstance(known.get(name), (int, float)) and not isinstance(known[name], bool) and (
                isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ObjectiveError(f"objective {objective.name!r}: {name} must be a number, got "
                                 f"{value!r}")
    _probe(objective, kwargs)
    return dict(kwargs)


def _probe(objective: Objective, kwargs: Mapping[str, Any]) -> None:
    """Traces the loss on tiny abstract inputs, so its own checks of the values (e.g. temp > 0)
    refuse them before a run writes anything, not at its first step."""
    z = jax.ShapeDtypeStruct((4, objective.views, 8), jnp.float32)
    ids = jax.ShapeDtypeStruct((4, objective.views, 5), jnp.int32)
    loss = with_context(functools.partial(objective.loss, **kwargs))
    try:  # with what the step passes too (mask_duplicates needs the ids)
        owned = jax.eval_shape(lambda: init_owned(objective, kwargs, jax.random.key(0)))
        jax.eval_shape(lambda z, ids, owned: loss(z, ids=ids, step=jnp.zeros((), jnp.int32),
                                                  key=jax.random.key(0), params=owned or None),
                       z, ids, owned)
    except UserCodeError:  # a loss tied to real shapes: the run's own trace reports it
        pass
    except JaxsimError as e:
        raise ObjectiveError(f'objective {objective.name!r}: {e}') from None
    except Exception:  # the same, raised by jaxsim's own code for these shapes
        pass
