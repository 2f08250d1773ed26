"""jaxsim: sentence embeddings in JAX/Flax."""
from jaxsim.encode import encode
from jaxsim.pretrained import Pretrained, bundled_model_path, load_pretrained

__all__ = ["encode", "load_pretrained", "bundled_model_path", "Pretrained"]
__version__ = "0.1.0"
