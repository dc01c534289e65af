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


def read_text_file(path: object, what: str) -> str:
    """A UTF-8 text file's contents, or a DataError naming `what` and the path on one line."""
    from pathlib import Path

    p = Path(str(path))
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise DataError(f"cannot read {what} {p}: {reason}") from None
