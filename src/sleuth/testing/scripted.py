"""A rollout engine that replies with given texts: for testing what surrounds a model (the gateway's
tool-call parsing, episode tasks, the sandbox) with outputs a random-init model would never write.

    engine = ScriptedEngine(tokenizer, ["<tool_call>{...}</tool_call>", "The answer is \\\\boxed{4}."])

Each generated sample is the next script text (cycling), tokenized, then the tokenizer's EOS; each
sampled token gets logprob -0.5. It keeps the RolloutEngine contract (check_request, ids + logprobs).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from sleuth.records import Sample
from sleuth.rollout.base import GenerationRequest, GenerationResult, RolloutEngine, check_request

SCRIPTED_LOGPROB = -0.5


class ScriptedEngine(RolloutEngine):
    def __init__(self, tokenizer: Any, texts: Sequence[str], context_len: int = 2048) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.context_len = context_len
        self._texts = itertools.cycle(texts)
        self._lock = threading.Lock()
        self.prompts: list[list[int]] = []
        """Every request's prompt ids, in arrival order."""

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        max_new = check_request(request, self.context_len, len(self.tokenizer))
        samples = []
        for _ in range(request.n):
            with self._lock:
                text = next(self._texts)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            ids = ids[:max_new]
            reason = "stop" if ids[-1] == self.tokenizer.eos_token_id else "length"
            samples.append(Sample(ids, [SCRIPTED_LOGPROB] * len(ids), reason,  # type: ignore[arg-type]
                                  self.tokenizer.decode(ids, skip_special_tokens=True)))
        with self._lock:
            self.prompts.append(list(request.prompt_ids))
        return GenerationResult(request, samples)

    def sync_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        raise NotImplementedError("a scripted engine has no weights")
