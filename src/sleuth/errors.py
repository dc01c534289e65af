"""Errors that mean "the user gave us something wrong" (exit code 2), as opposed to bugs."""


class UserError(Exception):
    """Bad input from the user: config, data file, CLI flag, model folder.

    The CLI prints ``sleuth: error: <message>`` on one line and exits with code 2.
    Keep the message to one line and name the offending thing (key, path, flag).
    """


class ConfigError(UserError):
    """An unknown, mistyped or invalid configuration key."""


class DataError(UserError):
    """An unreadable or malformed data file."""

