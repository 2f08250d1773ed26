"""The exception types that mean 'bad input', which command lines print as one clear line."""
from jaxsim.convert.hf_bert import CheckpointMismatchError
from jaxsim.models.bert import ConfigError
from jaxsim.models.pooling import PoolerError
from jaxsim.pretrained import ModelLoadError

# Command lines catch these (plus TypeError/ValueError from argument checks) and print them
# without a traceback; anything else is a bug and keeps its traceback.
USER_ERRORS = (CheckpointMismatchError, ConfigError, PoolerError, ModelLoadError, ValueError,
               TypeError, OSError, FloatingPointError)
