"""Environments from other libraries as tasks: a task name "PREFIX:ENV" picks the adapter registered
for PREFIX (verifiers, OpenEnv), imported only when chosen."""

from __future__ import annotations

from sleuth.plugins import Registry

ENVIRONMENTS = Registry("environment library", 1, "build(cfg: TaskConfig) -> Task", user_specs=False)
"""Environment prefix ("verifiers:ENV_ID") -> the adapter that runs such environments."""
ENVIRONMENTS.lazy("verifiers", "sleuth.tasks.verifiers_env:build")
ENVIRONMENTS.lazy("openenv", "sleuth.tasks.openenv_env:build")


def environment_prefix(name: str) -> str | None:
    """The ENVIRONMENTS prefix a task name starts with ("verifiers" for "verifiers:gsm8k"), else None."""
    prefix, sep, _ = name.strip().partition(":")
    return prefix if sep and prefix in ENVIRONMENTS else None
