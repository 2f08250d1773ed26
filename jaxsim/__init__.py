"""jaxsim: sentence embeddings in JAX/Flax."""
import os as _os
import sys as _sys

# transformers is used for tokenizers only: its import-time advice ("PyTorch was not found.
# Models won't be available ...") is noise here. Advisories only; its warnings stay.
_os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from jaxsim.cli import interrupts as _interrupts

# `python -m jaxsim ...` imports this package (and JAX through it) before jaxsim/__main__.py
# runs (sys.argv[0] is '-m' only during that import). Hold signals back until the command
# installs its handlers, so a Ctrl-C during start-up is reported like any other.
if _sys.argv[:1] == ["-m"] and _interrupts.running_module() == "jaxsim":
    _interrupts.block()
from jaxsim import functional  # the pure pieces (docs/api.md)

# Registers FlowCalibration as what an exported flow module reads back as (formats/st_flow.py
# sits below calibrate/), so load_pretrained reads such a folder whatever else was imported.
from jaxsim.calibrate import flow as _flow_calibration  # noqa: F401
from jaxsim.encode import encode
from jaxsim.formats.pretrained import bundled_model_path, load_pretrained
from jaxsim.model import SentenceModel
from jaxsim.search import similarity

__all__ = ["encode", "load_pretrained", "bundled_model_path", "SentenceModel", "similarity",
           "functional"]
__version__ = "0.1.0"
