"""jaxsim: sentence embeddings in JAX/Flax."""
from jaxsim.encode import encode
from jaxsim.io.pretrained import bundled_model_path, load_pretrained
from jaxsim.model import SentenceModel
from jaxsim.search import similarity

__all__ = ["encode", "load_pretrained", "bundled_model_path", "SentenceModel", "similarity"]
__version__ = "0.1.0"
