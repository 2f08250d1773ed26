"""Normalizing flows over sentence vectors (BERT-flow): layers by name, configs, fitting.

  FLOW_LAYERS    registry of bijectors (`@FLOW_LAYERS.register('name')` on a linen module with
                 forward(x) -> (z, logdet) and inverse(z) -> x, built as cls(features=D, **opts))
  FlowConfig     levels x depth steps of named layers + the fitting settings
  fit_flow       maximum-likelihood fit, batch sharded over a mesh
The calibration that maps embeddings through a fitted flow is `jaxsim.calibrate`'s 'flow'.
"""
from jaxsim.flows.config import FlowConfig, FlowError, LayerSpec, layer, load_config_file
from jaxsim.flows.layers import FLOW_LAYERS, FlowOutput
from jaxsim.flows.models import Flow, make_flow
from jaxsim.flows.training import FitResult, fit_flow

__all__ = ['FLOW_LAYERS', 'FitResult', 'Flow', 'FlowConfig', 'FlowError', 'FlowOutput',
           'LayerSpec', 'fit_flow', 'layer', 'load_config_file', 'make_flow']
