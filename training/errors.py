"""User-facing errors. Each carries one line that says what, where and what to do.

Entry points catch :class:`RecsysError`, print ``error: <message>`` and exit with code 2;
anything else is a bug and keeps its traceback.
"""

from recsys_stack import config as _config


class RecsysError(Exception):
    """Base class for errors caused by the user's input (config, data, checkpoint)."""


class ConfigError(RecsysError, _config.ConfigError):
    """A config file or override is invalid (unknown key, bad value, zero-row table).

    Also a :class:`recsys_stack.config.ConfigError`, so the shared loader passes it through
    unchanged when a config class's ``__post_init__`` raises it.
    """


class DataError(RecsysError):
    """A data file is missing or has more malformed rows than allowed."""


class CheckpointError(RecsysError):
    """A checkpoint is missing, incomplete, corrupt or belongs to another model shape."""
