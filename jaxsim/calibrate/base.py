"""The Calibration interface, the registry of calibration names, and fit / save / load.

A calibration is fitted on unlabeled embeddings, then maps every embedding row-wise. A new one
is a decorated subclass, usable by name from `eval.py --post name[:arg]` (docs/extending.md):
`@CALIBRATIONS.register('mycal')` on a `Calibration` defining `arg`, `fit`, `apply`,
`describe`, `state` and `from_state`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import pathlib
import sys
from typing import Any, ClassVar, Optional, Union

import numpy as np
import safetensors.numpy

from jaxsim.errors import JaxsimError
from jaxsim.flows.checks import check_matrix
from jaxsim.registry import IMPORT_HINT, Registry, describe

FORMAT = 'jaxsim.calibration/1'
META_FILE = 'calibration.json'
ARRAYS_FILE = 'arrays.safetensors'
ARG_MODES = ('none', 'optional', 'required')


class CalibrationError(JaxsimError):
    """A calibration that cannot be parsed, fitted, applied, saved or loaded as asked."""


def _check_calibration(entry: Any) -> Optional[str]:
    """A registered calibration: a Calibration class whose `arg` mode parse_spec knows."""
    if not (inspect.isclass(entry) and issubclass(entry, Calibration)):
        return f"must be a subclass of jaxsim.calibrate.Calibration, got {describe(entry)}"
    if entry.arg not in ARG_MODES:  # parse_spec refuses every spec of it otherwise
        return (f"has arg={entry.arg!r}; it must be one of {', '.join(map(repr, ARG_MODES))} "
                f"(whether the spec takes ':arg')")
    return None


CALIBRATIONS: Registry = Registry('calibration', error=CalibrationError, check=_check_calibration)


class Calibration:
    """Base class of fitted calibrations (subclass it and register it in `CALIBRATIONS`).

    Class attributes:
      arg: whether the spec takes ':arg' ('none', 'optional' or 'required').
      arg_type: int (a positive integer, e.g. whitening:256), float (a finite number, e.g.
        shrink:0.3) or str (e.g. flow:glow).
      linear: fitted instances are affine maps (`affine()` returns arrays); export can bake
        them into a sentence-transformers Dense layer.

    Instance attributes:
      spec: the spec it was fitted from, e.g. 'whitening:256' (set by `fit` and `load`).
      note: non-empty when the fit had to deviate from the plain method (dropped directions).
    """

    arg: ClassVar[str] = 'none'
    arg_type: ClassVar[type] = int
    linear: ClassVar[bool] = False
    spec = ''
    note = ''

    @classmethod
    def fit(cls, x: np.ndarray, arg: Any = None, **options) -> 'Calibration':
        """Fits on x [N, D]; `arg` is the parsed ':arg' of the spec (None when absent)."""
        raise NotImplementedError

    def apply(self, x: Any) -> np.ndarray:
        """Maps x [N, D] to calibrated rows [N, K]."""
        raise NotImplementedError

    def affine(self) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """(mu [D], W [D, K]) such that apply(x) = (x - mu) @ W, or None when not affine."""
        return None

    def describe(self) -> str:
        """One short line for logs and reports (never a parameter dump)."""
        return self.spec or type(self).__name__

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """(JSON-serialisable metadata, named numpy arrays) that `from_state` rebuilds from."""
        raise NotImplementedError

    @classmethod
    def from_state(cls, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> 'Calibration':
        raise NotImplementedError

    def save(self, folder: Union[str, pathlib.Path]) -> pathlib.Path:
        """Writes folder/calibration.json (kind, spec, metadata) and folder/arrays.safetensors."""
        return save(self, folder)

    def __repr__(self) -> str:
        return f'{type(self).__name__}({self.describe()})'


# What `load` rebuilds a saved affine map (arrays mu, W) of an unregistered kind as: set by
# jaxsim.calibrate.affine, which imports this module (so it cannot be imported from here).
affine_fallback: Optional[type[Calibration]] = None


def check_embeddings(x: Any, what: str = 'embeddings', dtype=np.float64,
                     min_rows: int = 1) -> np.ndarray:
    """Validates a [N, D] embedding matrix; returns it as `dtype` numpy.

    Raises:
      CalibrationError: not 2-D, too few rows, or holding NaN/inf (naming the first bad row
        and column).
    """
    return check_matrix(x, what, min_rows, dtype, CalibrationError, rows='sentences',
                        nonfinite='embeddings contain non-finite values')


def check_dim(x: np.ndarray, dim: int, spec: str) -> None:
    if x.shape[1] != dim:
        raise CalibrationError(f'{spec}: fitted on {dim}-dim embeddings, got {x.shape[1]}-dim '
                               'input')


def blas_single_thread():
    """Context limiting BLAS/LAPACK to one thread (when threadpoolctl is installed).

    Why: OpenBLAS's threads spin against other busy processes on a small shared CPU
    (docs/performance.md, "Figures the code relies on"); these matrices are too small to gain
    from threads anyway.
    """
    try:
        import threadpoolctl
    except ImportError:
        return contextlib.nullcontext()
    return threadpoolctl.threadpool_limits(1, user_api='blas')


def _entry(name: str, spec: str) -> type[Calibration]:
    if name not in CALIBRATIONS:
        raise CalibrationError(f'unknown calibration {name!r} in {spec!r}; choose one of '
                               f'{", ".join(CALIBRATIONS.names())} ({IMPORT_HINT})')
    return CALIBRATIONS.get(name)  # its registration checked it (_check_calibration)


def parse_spec(spec: str) -> tuple[str, Any]:
    """Parses a calibration spec 'name[:arg]', e.g. 'whitening:256' -> ('whitening', 256).

    arg is None when absent, else an int > 0, a finite float or a string, as the calibration's
    `arg_type` says; an unknown name or an arg missing, present where none is taken, or not of
    the right type is a CalibrationError.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise CalibrationError(f'a calibration spec must be a non-empty string, got {spec!r}')
    name, colon, raw = spec.strip().partition(':')
    cls = _entry(name.strip(), spec)
    raw = raw.strip()
    if colon and not raw:
        raise CalibrationError(f'{spec!r}: empty argument after ":"')
    if not raw:
        if cls.arg == 'required':
            raise CalibrationError(f'calibration {name!r} needs an argument, e.g. {name}:5')
        return name.strip(), None
    if cls.arg == 'none':
        raise CalibrationError(f'calibration {name!r} takes no ":arg" (got {spec!r})')
    arg = raw
    if cls.arg_type is int:
        try:
            arg = int(raw)
        except ValueError:
            raise CalibrationError(f'{spec!r}: the argument must be an integer') from None
        if arg < 1:
            raise CalibrationError(f'{spec!r}: the argument must be positive')
    elif cls.arg_type is float:
        try:
            arg = float(raw)
        except ValueError:
            raise CalibrationError(f'{spec!r}: the argument must be a number') from None
        if not np.isfinite(arg):
            raise CalibrationError(f'{spec!r}: the argument must be finite')
    return name.strip(), arg


def spec_string(name: str, arg: Any) -> str:
    """The canonical spec of (name, arg): ('whitening', 256) -> 'whitening:256'."""
    return name if arg is None else f'{name}:{arg}'


def label(spec: str) -> str:
    """Row label of a spec for tables: 'whitening:256' -> 'whitening-256'."""
    name, arg = parse_spec(spec)
    return name if arg is None else f'{name}-{arg}'


def _accepted_options(cls: type[Calibration]) -> Optional[set[str]]:
    """Keyword options `cls.fit` takes (None: it takes **options, i.e. anything)."""
    params = list(inspect.signature(cls.fit).parameters.values())[2:]  # after x, arg
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params}


def _stamp(cal: Calibration, **attrs: str) -> Calibration:
    """Sets spec (and note) on a fitted instance, frozen dataclass or plain object."""
    if dataclasses.is_dataclass(cal) and set(attrs) <= {f.name for f in dataclasses.fields(cal)}:
        return dataclasses.replace(cal, **attrs)
    for k, v in attrs.items():
        object.__setattr__(cal, k, v)
    return cal


def fit(spec: str, x: Any, **options) -> Calibration:
    """Fits the calibration named by `spec` on embeddings x [N, D].

    Args:
      spec: 'name[:arg]' (see `parse_spec`).
      x: [N, D] fit embeddings.
      **options: keyword options of the calibrations (eps for whitening/sn; config, seed,
        embed, mesh, progress for flow). One call site can pass the options of several
        kinds: a calibration receives those its `fit` takes; an option set to None counts
        as not given; an option that no registered calibration takes is an error (a typo).

    Returns:
      The fitted Calibration, with `.spec` set to the canonical spec.
    """
    name, arg = parse_spec(spec)
    cls = CALIBRATIONS.get(name)
    options = {k: v for k, v in options.items() if v is not None}
    accepted = _accepted_options(cls)
    if accepted is not None:  # a fit taking **options gets them all, unchecked
        known = set().union(*(_accepted_options(CALIBRATIONS.get(other)) or ()
                              for other in CALIBRATIONS.names()))
        typos = sorted(set(options) - known)
        if typos:
            raise CalibrationError(f'unknown calibration option(s) {typos}; the registered '
                                   f'calibrations take {sorted(known)}')
        options = {k: v for k, v in options.items() if k in accepted}
    cal = cls.fit(x, arg, **options)
    if not isinstance(cal, Calibration):
        raise CalibrationError(f'{cls.__name__}.fit returned {type(cal).__name__}, not a '
                               'Calibration')
    return _stamp(cal, spec=spec_string(name, arg))


def save(cal: Calibration, folder: Union[str, pathlib.Path]) -> pathlib.Path:
    """Writes a fitted calibration to folder (created; earlier files overwritten)."""
    if not cal.spec:
        raise CalibrationError(f'{cal!r} has no spec: fit it with jaxsim.calibrate.fit')
    name, _ = parse_spec(cal.spec)
    meta, arrays = cal.state()
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    safetensors.numpy.save_file({k: np.ascontiguousarray(np.asarray(v)) for k, v in arrays.items()},
                                str(folder / ARRAYS_FILE))
    record = {'format': FORMAT, 'kind': name, 'spec': cal.spec, 'note': cal.note, 'meta': meta}
    (folder / META_FILE).write_text(json.dumps(record, indent=2))
    return folder


def load(folder: Union[str, pathlib.Path]) -> Calibration:
    """Loads a calibration written by `Calibration.save`.

    A kind not registered in this process (its module not imported) whose file holds an affine
    map (mu, W) loads as that map (an AffineCalibration), with a one-line note on stderr; any
    other unregistered kind is a CalibrationError naming the file.
    """
    folder = pathlib.Path(folder)
    meta_path = folder / META_FILE
    if not meta_path.is_file():
        raise CalibrationError(f'{meta_path}: not found; is {folder} a saved calibration '
                               '(written by Calibration.save)?')
    try:
        record = json.loads(meta_path.read_text())
        kind, spec, meta = record['kind'], record['spec'], record['meta']
        note = str(record.get('note', ''))
        if record.get('format') != FORMAT:
            raise ValueError(f"format {record.get('format')!r}, expected {FORMAT!r}")
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise CalibrationError(f'{meta_path}: malformed ({type(e).__name__}: {e})') from None
    arrays_path = folder / ARRAYS_FILE
    if not arrays_path.is_file():
        raise CalibrationError(f'{arrays_path}: not found (the arrays of {meta_path})')
    try:
        arrays = safetensors.numpy.load_file(str(arrays_path))
    except safetensors.SafetensorError as e:
        raise CalibrationError(f'{folder}: cannot rebuild {kind!r} ({e})') from None
    # A kind not registered here whose file holds an affine map loads as that map.
    fallback = (kind not in CALIBRATIONS and set(arrays) == {'mu', 'W'}
                and affine_fallback is not None)
    cls = affine_fallback if fallback else _entry(kind, f'{meta_path} kind')
    try:
        cal = cls.from_state(meta, arrays)
    except (KeyError, TypeError, ValueError) as e:
        raise CalibrationError(f'{folder}: cannot rebuild {kind!r} ({e})') from None
    if fallback:
        print(f'note: {folder}: calibration {kind!r} is not registered in this process (its '
              f'module is not loaded); using the affine map its file holds (mean + '
              f'{cal.dim_in}x{cal.dim_out} matrix)', file=sys.stderr)
    return _stamp(cal, spec=spec, note=note)

