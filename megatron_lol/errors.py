"""The error types every layer of the package raises for user mistakes.

Kept apart from the CLI so that the config, data, model and conversion code can
raise them without importing the entry point. ``megatron-lol`` prints a
:class:`CliError` as one line (``megatron-lol VERB: error: MESSAGE``) and exits
with status 2.
"""

from __future__ import annotations


class CliError(Exception):
    """A user error (bad flag, file or value): printed as one line, exit status 2."""


class ConfigError(CliError):
    """A configuration value is invalid; the message names the key."""
