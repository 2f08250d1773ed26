"""Training objectives: the OBJECTIVES registry and the built-in SimCSE losses.

`register_objective(name, views=...)` adds one from any file; see `jaxsim.objectives.base`.
"""
from jaxsim.objectives import simcse  # noqa: F401  (registers 'unsup' and 'sup')
from jaxsim.objectives.base import (OBJECTIVES, LossFn, Objective, ObjectiveError, check_kwargs,
                                    get_objective, hyperparameters, register_objective)

__all__ = ["OBJECTIVES", "LossFn", "Objective", "ObjectiveError", "check_kwargs",
           "get_objective", "hyperparameters", "register_objective", "simcse"]
