"""jaxsim: sentence embeddings in JAX/Flax."""
import sys as _sys

from jaxsim import interrupts as _interrupts

# `python -m jaxsim ...` imports this package (and JAX through it) before jaxsim/__main__.py
# runs (sys.argv[0] is '-m' only during that import). Hold signals back until the command
# installs its handlers, so a Ctrl-C during start-up is reported like any other.
if _sys.argv[:1] == ["-m"] and _interrupts.running_module() == "jaxsim":
    _interrupts.block()
from jaxsim.encode import encode
from jaxsim.io.pretrained import bundled_model_path, load_pretrained
from jaxsim.model import SentenceModel
from jaxsim.search import similarity

__all__ = ["encode", "load_pretrained", "bundled_model_path", "SentenceModel", "similarity"]
__version__ = "0.1.0"
