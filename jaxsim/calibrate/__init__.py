"""Calibrations of sentence embeddings (whitening, SN, NATSV, BERT-flow) behind one interface.

  parse_spec('whitening:256') -> ('whitening', 256)
  cal = fit(spec, x, **options); cal.apply(x); cal.save(folder); load(folder)
  cal.affine() -> (mu [D], W [D, K]) or None; cal.describe() -> one line
  CALIBRATIONS: register a new one with `@CALIBRATIONS.register('name')` on a Calibration
"""
from jaxsim.calibrate.affine import (
                                   AffineCalibration,
                                   Identity,
                                   Natsv,
                                   StandardNormalization,
                                   Whitening,
)
from jaxsim.calibrate.base import (
                                   CALIBRATIONS,
                                   Calibration,
                                   CalibrationError,
                                   blas_single_thread,
                                   check_embeddings,
                                   fit,
                                   label,
                                   load,
                                   parse_spec,
                                   save,
                                   spec_string,
)
from jaxsim.calibrate.flow import FlowCalibration

__all__ = ['AffineCalibration', 'CALIBRATIONS', 'Calibration', 'CalibrationError',
           'FlowCalibration', 'Identity', 'Natsv', 'StandardNormalization', 'Whitening',
           'blas_single_thread', 'check_embeddings', 'fit', 'label', 'load', 'parse_spec',
           'save', 'spec_string']
