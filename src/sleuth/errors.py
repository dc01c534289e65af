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



def user_code_error(err: BaseException, what: str) -> UserError:
    """One line for an exception raised by the user's own code (a task module, problems(), a
    verifier): what failed, the exception, and the user's file and line where it was raised,
    instead of sleuth's traceback."""
    import traceback

    if isinstance(err, SyntaxError):
        where = f"{err.filename}:{err.lineno}" if err.filename else "?"
        return UserError(f"{what}: syntax error at {where}: {err.msg}")
    frames = traceback.extract_tb(err.__traceback__)
    package = __file__.rsplit("/", 1)[0] + "/"
    outside = [f for f in frames if not f.filename.startswith(package) and "importlib" not in f.filename]
    last = outside[-1] if outside else (frames[-1] if frames else None)
    where = f" (at {last.filename}:{last.lineno})" if last else ""
    message = (str(err).strip().splitlines() or [""])[0][:300]
    return UserError(f"{what}: {type(err).__name__}: {message}{where}")
