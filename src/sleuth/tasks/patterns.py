"""Building blocks for `Task.answer_pattern`: regular expressions the rollout engines' structured
output accepts (Python re, xgrammar, Outlines)."""

from __future__ import annotations

from collections.abc import Iterable

_SPECIAL = frozenset("\\.^$*+?{}[]|()")
"""Characters with a meaning in the regular expressions engines accept (Python re, xgrammar, Outlines)."""


def regex_literal(text: str) -> str:
    """`text` matched literally. Unlike re.escape, spaces and other plain characters stay as they
    are: xgrammar, vLLM's default structured-output backend, warns on escapes it does not know."""
    return "".join("\\" + ch if ch in _SPECIAL else ch for ch in text)


def one_of(options: Iterable[str]) -> str:
    """A group matching exactly one of `options`, each literally."""
    options = list(options)
    if not options:
        raise ValueError("one_of: no options")
    return "(" + "|".join(regex_literal(o) for o in options) + ")"
