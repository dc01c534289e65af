"""User code named in the config: "package.module:function" or "path/to/file.py:function".

    fn = load_function("my_algos:advantage", n_args=1, what="advantage")

Used for user tasks and verifiers (sleuth.tasks.user) and for user advantages and losses
(sleuth.rewards.advantages / losses). Everything is checked when the config loads: the module
imports, the attribute exists, is callable, and accepts the documented positional arguments.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from sleuth.errors import ConfigError, user_code_error


def is_spec(name: str) -> bool:
    """A name that points at user code ("module:function") rather than a registered name."""
    return ":" in name


def import_module(name: str, what: str = "user") -> Any:
    """A module by dotted name, or by path when it ends in .py (one module per file path)."""
    if name.endswith(".py"):
        path = Path(name).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"{what} file {name} does not exist")
        # Two files may share a name: the module name carries a hash of the path.
        module_name = f"sleuth_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
        if module_name in sys.modules:
            return sys.modules[module_name]
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ConfigError(f"cannot load {what} file {name}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # the user's file itself fails: say where, not sleuth's traceback
            del sys.modules[module_name]
            raise user_code_error(e, f"cannot import {what} file {name}") from None
        return module
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        # The `sleuth` console script does not put the current directory on sys.path; a user
        # running from their project root expects `examples.my_task` to be found there.
        cwd = os.getcwd()
        if e.name is None or not name.startswith(e.name) or cwd in sys.path:
            raise ConfigError(f"cannot import {what} module '{name}': {e}") from None
        sys.path.append(cwd)
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e2:
            raise ConfigError(f"cannot import {what} module '{name}': {e2}") from None
        except Exception as e2:
            raise user_code_error(e2, f"cannot import {what} module '{name}'") from None
    except Exception as e:
        raise user_code_error(e, f"cannot import {what} module '{name}'") from None


def load_object(spec: str, what: str = "user task") -> Any:
    """The object named by "package.module:attr" or "path/file.py:attr"."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"'{spec}' is not of the form module:function")
    module = import_module(module_name, what)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{what} module '{module_name}' has no '{attr}'") from None


class Registry(dict[str, Any]):
    """Named functions of one kind (task, rollout engine, advantage, loss) with one documented
    signature: the one registry type.

    `resolve(name)` gives a registered function or, where the kind allows, a user "module:function";
    `register(name)` is the decorator code that imports sleuth uses to add its own; `lazy(name,
    "module:function")` registers by import string, imported only when chosen (so sleuth needs
    installed, and pays for, only what a run uses). An unknown name is a ConfigError naming the
    nearest registered ones.
    """

    def __init__(self, kind: str, n_args: int, signature: str, user_specs: bool = True) -> None:
        super().__init__()
        self.kind, self.n_args, self.signature, self.user_specs = kind, n_args, signature, user_specs

    def register(self, name: str) -> Callable[[Any], Any]:
        def decorate(fn: Any) -> Any:
            check_arity(fn, self.n_args, f"{self.kind} '{name}'", self.signature)
            self[name] = fn
            return fn

        return decorate

    def lazy(self, name: str, target: str) -> None:
        """Register `name` as the function at "module:function", imported on first resolve."""
        self[name] = target

    def check(self, name: str) -> None:
        """ConfigError unless `name` resolves (a user spec is imported and its arity checked)."""
        if is_spec(name) and self.user_specs:
            load_function(name, self.n_args, self.kind, self.signature)
        elif name not in self:
            raise ConfigError(unknown_name(self.kind, name, self, spec_ok=self.user_specs))

    def resolve(self, name: str) -> Any:
        """The function `name` stands for; ConfigError naming the nearest names when unknown."""
        if is_spec(name) and self.user_specs:
            return load_function(name, self.n_args, self.kind, self.signature)
        fn = super().get(name)
        if fn is None:
            raise ConfigError(unknown_name(self.kind, name, self, spec_ok=self.user_specs))
        if isinstance(fn, str):  # lazy: import now, once
            fn = self[name] = load_function(fn, self.n_args, f"{self.kind} '{name}'", self.signature)
        return fn


def check_arity(fn: Any, n_args: int, name: str, signature: str) -> None:
    """Raise ConfigError unless fn can be called with n_args positional arguments."""
    if not callable(fn):
        raise ConfigError(f"{name} is not a function (expected {signature})")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return
    try:
        sig.bind(*range(n_args))
    except TypeError:
        raise ConfigError(f"{name} takes ({', '.join(sig.parameters)}); expected {signature}") from None


def load_function(spec: str, n_args: int, what: str, signature: str) -> Any:
    """A user function from a spec, checked to be callable with n_args positional arguments."""
    fn = load_object(spec, what)
    check_arity(fn, n_args, f"{what} '{spec}'", signature)
    return fn


def nearest(name: str, valid: Iterable[str], n: int = 2, cutoff: float = 0.5) -> list[str]:
    """The valid names closest to `name` (at most n, similarity at least cutoff)."""
    return difflib.get_close_matches(name, sorted(valid), n=n, cutoff=cutoff)


def did_you_mean(name: str, valid: Iterable[str], n: int = 2, cutoff: float = 0.5) -> str:
    """' (did you mean 'a' or 'b'?)' for the nearest valid names, '' when none is near: the one
    "did you mean" of sleuth (config keys, registry names, dataset names)."""
    near = nearest(name, valid, n, cutoff)
    return f" (did you mean {' or '.join(repr(x) for x in near)}?)" if near else ""


def unknown_name(kind: str, name: str, valid: Iterable[str], spec_ok: bool = True) -> str:
    """One line naming an unknown registry name, its nearest valid names and the choices."""
    valid = sorted(valid)
    hint = did_you_mean(name, valid)
    extra = ", or module:function" if spec_ok else ""
    return f"unknown {kind} '{name}'{hint}; choose from {', '.join(valid)}{extra}"
