"""Guess the number: a multi-turn episode task written against the plain OpenAI client.

    sleuth train task.name=examples/guess_number.py:problems rollout.samples_per_task=8

The environment thinks of a number in [1, 100]; the model guesses, the environment answers
"Higher." or "Lower.", for up to MAX_GUESSES turns. Reward: 1 for finding it, else up to 0.5 for
how close the best guess came. sleuth runs `rollout` once per episode with an `openai.AsyncOpenAI`
client bound to that episode; every call's tokens are kept exactly as sampled and trained as one
sequence per episode (the environment's answers carry no loss).
"""

from __future__ import annotations

import random
import re
from typing import Any

LOW, HIGH = 1, 100
MAX_GUESSES = 4
PROMPT = (f"I am thinking of a whole number between {LOW} and {HIGH}. Guess it: reply with just the number. "
          "After each guess I will answer 'Higher.' or 'Lower.'.")
_NUMBER = re.compile(r"-?\d+")


def problems(cfg: Any) -> list[dict[str, Any]]:
    """200 secrets from cfg.seed: the first 20 held out for evaluation."""
    rng = random.Random(cfg.seed)
    return [{"id": f"secret-{i}", "prompt": PROMPT, "answer": rng.randint(LOW, HIGH),
             "split": "eval" if i < 20 else "train"} for i in range(200)]


def guess_of(text: str) -> int | None:
    """The first whole number in the reply, if any."""
    m = _NUMBER.search(text)
    return int(m.group()) if m else None


async def rollout(client: Any, problem: dict[str, Any]) -> dict[str, Any]:
    """One game. `client` is an openai.AsyncOpenAI bound to this episode."""
    secret = problem["answer"]
    messages = list(problem["messages"])
    closest = HIGH - LOW
    for turn in range(1, MAX_GUESSES + 1):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=16)
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        guess = guess_of(text)
        if guess == secret:
            return {"reward": 1.0, "metrics": {"solved": 1.0, "guesses": turn}}
        if guess is None:
            feedback = f"Please reply with just a whole number between {LOW} and {HIGH}."
        else:
            closest = min(closest, abs(guess - secret))
            feedback = "Higher." if guess < secret else "Lower."
        messages.append({"role": "user", "content": feedback})
    return {"reward": 0.5 * (1 - closest / (HIGH - LOW)), "metrics": {"solved": 0.0, "guesses": MAX_GUESSES}}
