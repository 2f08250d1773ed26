"""Normalizing flows (Glow, RealNVP) for BERT-flow calibration of sentence embeddings."""
from jaxsim.flows.calibration import (FlowCalibration, fit_flow_calibration, load_flow,
                                      save_flow)
from jaxsim.flows.config import FlowConfig

__all__ = ['FlowCalibration', 'FlowConfig', 'fit_flow_calibration', 'load_flow', 'save_flow']
