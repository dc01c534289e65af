"""A toy user task for tests and bench smoke runs: reward is the share of lowercase letters."""

from __future__ import annotations


def lowercase_task_source(problems: int = 64, held_out: int = 3) -> str:
    """The source of a task module (`problems`, `verify`): `problems` prompts, the first
    `held_out` of them held out; a completion scores the share of its characters that are a-z."""
    return f'''
def problems(cfg):
    for i in range({problems}):
        yield {{"id": f"p{{i}}", "prompt": f"Write lowercase letters ({{i}})", "answer": None,
               "split": "eval" if i < {held_out} else "train"}}


def verify(answer, text):
    return sum("a" <= c <= "z" for c in text) / len(text) if text else 0.0
'''
