"""A fitted flow in a sentence-transformers folder, as a PyTorch module file, and read back.

Export writes `jaxsim_flow.py` (the text of `jaxsim/formats/st_flow_torch.py`) at the folder's root
and a module folder holding the flow's config and parameters; modules.json names
`jaxsim_flow.JaxsimFlow`, which sentence-transformers imports with `trust_remote_code=True`.
Only the shipped layers have a PyTorch form there; a flow with any other layer is refused.
`FlowHead` is the same module read back by `jaxsim.load_pretrained`: it applies the flow with
jaxsim's own code (`FlowCalibration.apply`). calibrate/ sits above formats/, so the flow
calibration class registers itself in `FLOW_CALIBRATIONS` (`jaxsim.calibrate.flow`) instead
of being imported here.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from jaxsim.flows.config import FlowConfig
from jaxsim.flows.couplings import AdditiveCoupling, AffineCoupling
from jaxsim.flows.layers import FLOW_LAYERS, ActNorm, InvertibleLinear, InvertibleLinearLU, Reverse
from jaxsim.formats.st_modules import StModule
from jaxsim.models.st_head import HeadError
from jaxsim.registry import Registry
from jaxsim.storage import store

SOURCE = Path(__file__).with_name("st_flow_torch.py")
SOURCE_FILE = "jaxsim_flow.py"  # the module file's name in an exported folder
MODULE_TYPE = "jaxsim_flow.JaxsimFlow"
# The layers jaxsim_flow.py implements, with the classes whose forward it reproduces: a name
# registered to another class (a user's layer) has no PyTorch form.
TORCH_LAYERS = {"actnorm": ActNorm, "reverse": Reverse, "linear": InvertibleLinear,
                "linear_lu": InvertibleLinearLU, "additive_coupling": AdditiveCoupling,
                "affine_coupling": AffineCoupling}
_NOT_OPTIONS = ("features", "parent", "name")

# The calibration class a flow module is read back as (`from_state`, `apply`), under 'flow':
# jaxsim.calibrate.flow registers FlowCalibration, which this module cannot import.
FLOW_CALIBRATIONS: Registry[type] = Registry("flow calibration", error=HeadError)


def check_layers(config: FlowConfig, what: str, error: type = HeadError) -> None:
    """Refuses a flow with a layer jaxsim_flow.py does not implement, naming it (`error`: the
    caller's error type)."""
    for spec in config.step:
        if TORCH_LAYERS.get(spec.layer) is not FLOW_LAYERS.get(spec.layer):
            raise error(f"{what}: flow layer {spec.layer!r} has no PyTorch form for the "
                        f"sentence-transformers export (it has {', '.join(TORCH_LAYERS)})")


def _layer_options(spec) -> dict[str, Any]:
    """Every option of a layer, defaults included, so the PyTorch side assumes none."""
    defaults = {f.name: f.default for f in dataclasses.fields(TORCH_LAYERS[spec.layer])
                if f.name not in _NOT_OPTIONS and f.default is not dataclasses.MISSING}
    return {**defaults, **spec.kwargs()}


def flow_module(calibration, dim: int, error: type = HeadError) -> StModule:
    """The sentence-transformers module applying a fitted flow (a FlowCalibration: the export
    workflow sends only flows here) to `dim`-dim vectors; refusals raise `error`."""
    check_layers(calibration.config, f"calibration {calibration.describe()!r}", error)
    if calibration.dim != dim:
        raise error(f"the flow maps {calibration.dim}-dim vectors; the model gives "
                        f"{dim}-dim vectors")
    meta, arrays = calibration.state()
    config = calibration.config
    return StModule(MODULE_TYPE, {
        "dim": calibration.dim, "levels": config.levels, "depth": config.depth,
        "step": [{"layer": s.layer, "options": _layer_options(s)} for s in config.step],
        # What jaxsim reads back: the calibration's own saved state.
        "jaxsim": {"spec": calibration.spec, **meta}}, arrays)


def source_text() -> str:
    """The text of jaxsim_flow.py."""
    return SOURCE.read_text(encoding="utf-8")


@dataclasses.dataclass(frozen=True, eq=False)
class FlowHead:
    """A folder's flow module read back: maps pooled vectors to the flow's latent."""

    calibration: Any  # a FlowCalibration (FLOW_CALIBRATIONS)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(self.calibration.apply(x), np.float32)

    def __repr__(self) -> str:
        return f"FlowHead({self.calibration.describe()})"


def read_flow(module_dir: Path, read_state_dict: Callable) -> FlowHead:
    """The flow module of an exported folder (its config.json and weights) as a FlowHead."""
    config_file = module_dir / "config.json"
    meta = store.read_json(config_file, HeadError, "flow module config").get("jaxsim")
    if not isinstance(meta, dict):
        raise HeadError(f"{config_file}: no 'jaxsim' entry (the flow as jaxsim saved it)")
    tensors, source = read_state_dict(module_dir)
    try:
        calibration = FLOW_CALIBRATIONS.get("flow").from_state(
            meta, {k: np.asarray(v, np.float32) for k, v in tensors.items()})
    except (ValueError, KeyError) as e:
        raise HeadError(f"{source}: {e}") from None
    calibration.spec = meta.get("spec") or "flow"
    check_layers(calibration.config, str(config_file))
    return FlowHead(calibration)
