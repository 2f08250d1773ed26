"""The base of every user-facing error: command lines print it as one line, no traceback.

Each module defines its own error types as subclasses of `JaxsimError`, with messages that name
the file (and line), tensor or option at fault. Subclassing ValueError keeps `except ValueError`
callers working.
"""


class JaxsimError(ValueError):
    """Bad input or a request that cannot be done; the message says what and where."""


class ConfigError(JaxsimError):
    """A bad train or model configuration: unknown key, wrong type or out-of-range value."""


# Command lines print these as `error: <message>` and exit with USER_ERROR_EXIT; anything else
# is a bug and keeps its traceback.
USER_ERRORS = (JaxsimError, ValueError, TypeError, OSError)
USER_ERROR_EXIT = 1
