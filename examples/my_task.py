"""An example user task for sleuth: two-digit addition, scored on the last number written.

Train on it with the tiny defaults (from the repository root):

    .venv/bin/sleuth train task.name=examples.my_task:problems rollout.max_tokens=32 loop.iterations=4

sleuth imports `examples.my_task`, calls `problems(cfg)` once for the problem list, and scores
each completion with `verify(answer, completion_text)` from the same module (or the function
that `task.verifier=module:function` names).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from typing import Any

_NUMBER = re.compile(r"-?\d+")


def problems(cfg: Any) -> Iterator[dict[str, Any]]:
    """200 addition problems: the first 20 held out for evaluation, the rest for training.

    `cfg` is sleuth's TaskConfig: use its fields (seed, train_path, ...) as you like.
    """
    rng = random.Random(1234)  # a fixed problem set; cfg.seed only changes the training order
    for i in range(200):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        yield {
            "id": f"add-{i}",
            "prompt": f"What is {a} + {b}? Reply with the number only.",
            "answer": a + b,
            "split": "eval" if i < 20 else "train",
        }


def verify(answer: int, completion: str) -> float:
    """1.0 when the last number in the completion is the right sum, else 0.0."""
    found = _NUMBER.findall(completion)
    return 1.0 if found and int(found[-1]) == answer else 0.0
