"""Registration checks: an entry of the wrong sort is refused where it is registered, in one
line naming the registering module and line, instead of failing later where it is used."""
from __future__ import annotations

import importlib.util
import sys

import pytest

from jaxsim.calibrate import CALIBRATIONS, CalibrationError
from jaxsim.flows import FLOW_LAYERS
from jaxsim.models.poolers import POOLERS, PoolerError
from jaxsim.objectives import OBJECTIVES, ObjectiveError
from jaxsim.registry import RegistryError


def run_module(tmp_path, name: str, source: str) -> None:
    """Runs `source` as module `name` (from a file, as a user's module is)."""
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(name, None)


def refused(tmp_path, error, name: str, source: str) -> str:
    with pytest.raises(error) as e:
        run_module(tmp_path, name, source)
    return str(e.value)


def test_a_calibration_must_be_a_calibration_class_with_a_valid_arg(tmp_path):
    msg = refused(tmp_path, CalibrationError, "reg_cal_function",
                  "from jaxsim.calibrate import CALIBRATIONS\n\n"
                  "@CALIBRATIONS.register('reg_t_fn')\n"
                  "def notacal(x, arg):\n    return x\n")
    assert msg == ("calibration 'reg_t_fn' (in reg_cal_function, line 3) must be a subclass of "
                   "jaxsim.calibrate.Calibration, got the function notacal")
    msg = refused(tmp_path, CalibrationError, "reg_cal_arg",
                  "from jaxsim.calibrate import CALIBRATIONS, AffineCalibration\n"
                  "@CALIBRATIONS.register('reg_t_arg')\n"
                  "class NoArg(AffineCalibration):\n    arg = None\n")
    assert msg == ("calibration 'reg_t_arg' (in reg_cal_arg, line 2) has arg=None; it must be "
                   "one of 'none', 'optional', 'required' (whether the spec takes ':arg')")
    assert "reg_t_fn" not in CALIBRATIONS and "reg_t_arg" not in CALIBRATIONS


def test_a_flow_layer_must_be_a_linen_bijector_taking_features(tmp_path):
    msg = refused(tmp_path, RegistryError, "reg_flow_plain",
                  "from jaxsim.flows import FLOW_LAYERS\n"
                  "@FLOW_LAYERS.register('reg_t_plain')\n"
                  "class NotFlow:\n    pass\n")
    assert msg == ("flow layer 'reg_t_plain' (in reg_flow_plain, line 2) must be a flax.linen "
                   "Module class, got the class NotFlow")
    msg = refused(tmp_path, RegistryError, "reg_flow_noinverse",
                  "import flax.linen as nn\nfrom jaxsim.flows import FLOW_LAYERS\n"
                  "@FLOW_LAYERS.register('reg_t_noinv')\n"
                  "class OneWay(nn.Module):\n    features: int\n"
                  "    def forward(self, x):\n        return x\n")
    assert msg == ("flow layer 'reg_t_noinv' (in reg_flow_noinverse, line 3) must define "
                   "inverse() (forward(x) -> FlowOutput(z, logdet), inverse(z) -> x); OneWay "
                   "does not")
    msg = refused(tmp_path, RegistryError, "reg_flow_nofeatures",
                  "import flax.linen as nn\nfrom jaxsim.flows import FLOW_LAYERS\n"
                  "@FLOW_LAYERS.register('reg_t_nofeat')\n"
                  "class Sized(nn.Module):\n    dim: int\n"
                  "    def forward(self, x):\n        return x\n"
                  "    def inverse(self, z):\n        return z\n")
    assert msg == ("flow layer 'reg_t_nofeat' (in reg_flow_nofeatures, line 3) must take a "
                   "`features` field (the channels); Sized does not")
    assert not {"reg_t_plain", "reg_t_noinv", "reg_t_nofeat"} & set(FLOW_LAYERS)
    # Its other fields may be required: the flow config gives them (layer('name', scale=2.0)).
    run_module(tmp_path, "reg_flow_option",
               "import flax.linen as nn\nfrom jaxsim.flows import FLOW_LAYERS\n"
               "@FLOW_LAYERS.register('reg_t_option', replace=True)\n"
               "class ScaledShift(nn.Module):\n    features: int\n    scale: float\n"
               "    def forward(self, x):\n        return x\n"
               "    def inverse(self, z):\n        return z\n")
    assert "reg_t_option" in FLOW_LAYERS


def test_a_pooler_must_be_buildable_or_callable_as_a_model_uses_it(tmp_path):
    head = "import flax.linen as nn\nfrom jaxsim.models.poolers import register_pooler\n"
    msg = refused(tmp_path, PoolerError, "reg_pool_plain",
                  head + "@register_pooler('reg_t_plain')\nclass Plain:\n    pass\n")
    assert msg == ("pooler 'reg_t_plain' (in reg_pool_plain, line 3) must be a flax.linen Module "
                   "class or a function, got the class Plain")
    msg = refused(tmp_path, PoolerError, "reg_pool_fields",
                  head + "@register_pooler('reg_t_fields')\nclass NoDtype(nn.Module):\n"
                         "    config: object\n"
                         "    def __call__(self, output, attention_mask, use_head=True):\n"
                         "        return output.hidden_states[-1][:, 0]\n")
    assert msg == ("pooler 'reg_t_fields' (in reg_pool_fields, line 3) must be a Module with "
                   "fields `config` and `dtype` (and no other field without a default); NoDtype "
                   "is not")
    msg = refused(tmp_path, PoolerError, "reg_pool_arity",
                  head + "@register_pooler('reg_t_arity')\n"
                         "def first(output):\n    return output.hidden_states[-1][:, 0]\n")
    assert msg == ("pooler 'reg_t_arity' (in reg_pool_arity, line 3) must be a function "
                   "fn(output, attention_mask), got the function first")
    msg = refused(tmp_path, PoolerError, "reg_pool_direct",
                  "from jaxsim.models.poolers import POOLERS\n"
                  "POOLERS.register('reg_t_direct')(len)\n")
    assert msg == ("pooler 'reg_t_direct' (in reg_pool_direct, line 2) must be registered with "
                   "@register_pooler, got <built-in function len>")
    assert not {"reg_t_plain", "reg_t_fields", "reg_t_arity", "reg_t_direct"} & set(POOLERS)


def test_an_objective_must_come_from_register_objective(tmp_path):
    msg = refused(tmp_path, ObjectiveError, "reg_obj_direct",
                  "from jaxsim.objectives import OBJECTIVES\n\n"
                  "@OBJECTIVES.register('reg_t_obj')\n"
                  "def loss(z):\n    return z.sum(), {}\n")
    assert msg == ("objective 'reg_t_obj' (in reg_obj_direct, line 3) must be registered with "
                   "@register_objective, got the function loss")
    assert "reg_t_obj" not in OBJECTIVES
