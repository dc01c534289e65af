"""Temporal Clue: murder-mystery logic puzzles with a unique, machine-checkable solution.

`grade(solution, completion)` is the verifier; the generator lives in `generate`, data files and
prompts in `dataset`, the Task adapter in `task`.
"""

from sleuth.tasks.temporal_clue.grade import grade

__all__ = ["grade"]
