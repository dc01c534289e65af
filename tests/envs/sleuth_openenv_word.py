"""A small OpenEnv environment for sleuth's tests: say the word, two rounds.

`reset(seed=s)` picks a word from the seed and shows "Say the word: <word>"; each `step` with a
`message` earns 0.5 when the message contains the word, then shows the next word; the episode is
done after two steps (return: 0, 0.5 or 1). A message containing "NAN-REWARD" gets a NaN reward
and one containing "KILL-SERVER" ends the server process (sleuth's error handling tests). Served
by OpenEnv's own `create_app` (`uvicorn sleuth_openenv_word:app`), public openenv-core API only.
"""

import os
import random
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

WORDS = ["apple", "river", "stone", "cloud", "ember", "maple", "tiger", "lemon"]
ROUNDS = 2


class WordAction(Action):
    message: str


class WordObservation(Observation):
    prompt: str = ""


class WordEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._words: list[str] = []

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs) -> WordObservation:
        rng = random.Random(seed)
        self._words = [rng.choice(WORDS) for _ in range(ROUNDS)]
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return WordObservation(prompt=f"Say the word: {self._words[0]}", done=False, reward=0.0)

    def step(self, action: WordAction, timeout_s: float | None = None, **kwargs) -> WordObservation:
        if "KILL-SERVER" in action.message:
            os._exit(3)
        word = self._words[self._state.step_count]
        self._state.step_count += 1
        reward = 0.5 * (word in action.message)
        if "NAN-REWARD" in action.message:
            reward = float("nan")
        done = self._state.step_count >= ROUNDS
        prompt = "Done." if done else f"Say the word: {self._words[self._state.step_count]}"
        return WordObservation(prompt=prompt, done=done, reward=reward)

    @property
    def state(self) -> State:
        return self._state


app = create_app(WordEnvironment, WordAction, WordObservation, env_name="sleuth_openenv_word", max_concurrent_envs=64)
