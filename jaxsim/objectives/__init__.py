"""Training objectives: the OBJECTIVES registry and the built-in SimCSE losses.

`register_objective(name, views=...)` adds one from any file; see `jaxsim.objectives.base`.
"""
from jaxsim.objectives import owned, simcse  # noqa: F401  (simcse registers 'unsup', 'sup')
from jaxsim.objectives.base import (
                                    CONTEXT_ARGS,
                                    OBJECTIVES,
                                    LossFn,
                                    Objective,
                                    ObjectiveError,
                                    check_kwargs,
                                    context_args,
                                    get_objective,
                                    hyperparameters,
                                    register_objective,
                                    with_context,
)

__all__ = ["CONTEXT_ARGS", "OBJECTIVES", "LossFn", "Objective", "ObjectiveError", "check_kwargs",
           "context_args", "get_objective", "hyperparameters", "owned", "register_objective",
           "simcse", "with_context"]
