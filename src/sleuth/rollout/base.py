"""The rollout interface: token ids in, sampled token ids + logprobs out, streamed per group.

Conventions every engine keeps, so the trainer can compare against any of them:

- `Sample.token_ids` are the sampled tokens exactly, including the EOS token or the token that
  completed a stop string (the model must learn to emit them); `Sample.text` is their decoding
  without special tokens.
- `Sample.logprobs` are logprobs of the *raw* model (log-softmax of the unscaled logits, before
  temperature and top-p), i.e. what the trainer computes at temperature 1. At temperature 1 and
  top-p 1 that is exactly the distribution sampled from. (vLLM's `logprobs_mode="raw_logprobs"`.)
- finish reasons: "stop" (EOS or stop string), "length" (max tokens, or the context is full),
  "abort" (early-stopped as degenerate; such samples should score 0).
- A request whose prompt leaves no room in the context, an empty prompt, max_tokens < 1 ... is
  rejected with UserError before anything runs; every generation call and weight sync has a
  timeout and raises RolloutTimeoutError naming the step instead of hanging.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sleuth.errors import UserError
from sleuth.records import Completion, Group, LoraAdapter, Problem, Sample, SamplingParams
from sleuth.system.seeds import derive_seed

T = TypeVar("T")

EARLY_STOP_DECAY = 0.992
"""Decay of the moving average of token logprobs used for early stopping of degenerate samples."""


@dataclass(frozen=True)
class GenerationRequest:
    """n samples of one prompt (one group)."""

    prompt_ids: list[int]
    n: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""


@dataclass
class GenerationResult:
    request: GenerationRequest
    samples: list[Sample]
    time_s: float = 0.0


class RolloutTimeoutError(RuntimeError):
    """An engine step (a generation or a weight sync) did not finish within its timeout."""


def check_request(request: GenerationRequest, context_len: int, vocab_size: int,
                  structured_output: bool = False) -> int:
    """Reject a malformed request with one clear UserError; return the effective max new tokens.

    The completion is capped where the context ends (finish reason "length"), as vLLM does.
    structured_output: the engine can constrain a completion to `sampling.regex`.
    """
    rid = request.request_id or "<unnamed>"
    s = request.sampling
    if not request.prompt_ids:
        raise UserError(f"rollout request {rid}: empty prompt (no token ids)")
    if request.n < 1:
        raise UserError(f"rollout request {rid}: n must be >= 1, got {request.n}")
    if s.max_tokens < 1:
        raise UserError(f"rollout request {rid}: max_tokens must be >= 1, got {s.max_tokens}")
    if s.temperature < 0:
        raise UserError(f"rollout request {rid}: temperature must be >= 0, got {s.temperature}")
    if not 0 < s.top_p <= 1:
        raise UserError(f"rollout request {rid}: top_p must be in (0, 1], got {s.top_p}")
    if any(not stop for stop in s.stop):
        raise UserError(f"rollout request {rid}: empty stop string")
    if s.regex is not None:
        if not structured_output:
            raise UserError(f"rollout request {rid}: a regex (structured output) needs the vllm engine; "
                            "this engine samples free text only")
        try:
            re.compile(s.regex)
        except re.error as e:
            raise UserError(f"rollout request {rid}: regex is not a valid regular expression: {e}") from None
    ids = request.prompt_ids
    if min(ids) < 0 or max(ids) >= vocab_size:  # two C-level passes: multi-turn prompts run to thousands of ids
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise UserError(f"rollout request {rid}: token id {bad} outside the vocabulary (0..{vocab_size - 1})")
    if len(request.prompt_ids) >= context_len:
        raise UserError(
            f"rollout request {rid}: prompt of {len(request.prompt_ids)} tokens leaves no room in the "
            f"engine's context of {context_len} tokens"
        )
    return min(s.max_tokens, context_len - len(request.prompt_ids))


def moving_average_below(logprobs: Iterable[float], threshold: float, state: float = 0.0) -> tuple[bool, float]:
    """Early-stop rule: fold logprobs into m <- d*m + (1-d)*lp (m starts at 0, d = 0.992).

    Starting at 0 rather than bias-correcting acts as a warm-up: a sample needs a sustained run of
    unlikely tokens (about 90 tokens at logprob -6 for threshold -3) before it is called degenerate.
    Returns (fell below threshold at any point, new state).
    """
    m = state
    below = False
    for lp in logprobs:
        m = EARLY_STOP_DECAY * m + (1 - EARLY_STOP_DECAY) * lp
        below = below or m < threshold
    return below, m


class RolloutEngine(ABC):
    """An inference engine behind one small async interface.

    Subclasses run all model work on one worker thread (`self._worker`), so generation and weight
    syncs never interleave, and the caller waits on it with a timeout.
    """

    model_path: str = ""
    timeout_s: float = 1800.0
    context_len: int = 0
    policy_version: int = 0
    """The policy version (optimizer steps) of the weights it holds, as the last sync's caller set it;
    an engine that takes weight updates in flight records it per sampled token (Sample.token_versions)."""
    in_flight_updates: bool = False
    """Set by loop.streaming where the engine supports it (`supports_in_flight_updates`): a weight sync
    then lands between decoding steps of the requests in flight instead of waiting for them."""
    supports_in_flight_updates: bool = False

    def __init__(self) -> None:
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")

    # ------------------------------------------------------------------ generation

    @abstractmethod
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """All n samples of one request (raises RolloutTimeoutError after timeout_s)."""

    async def stream(self, requests: Sequence[GenerationRequest]) -> AsyncIterator[GenerationResult]:
        """Results per group in the order they finish, so scoring can start early."""
        tasks = [asyncio.ensure_future(self.generate(r)) for r in requests]
        try:
            for fut in asyncio.as_completed(tasks):
                yield await fut
        finally:
            for t in tasks:
                t.cancel()

    def generate_all(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Synchronous convenience: every request, results in request order."""

        async def run() -> list[GenerationResult]:
            return list(await asyncio.gather(*(self.generate(r) for r in requests)))

        return asyncio.run(run())

    def probe_replicas(self, request: GenerationRequest) -> list[GenerationResult]:
        """The request's result from every replica serving this engine's weights (one here; each
        Ray rollout worker for a RolloutPool): the weight-sync check (sync_check.py) asks all."""
        return self.generate_all([request])

    # ------------------------------------------------------------------ weights

    @abstractmethod
    def sync_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Replace the engine's weights in place with the trainer's (full, HF parameter names).

        Waits for generation in flight to finish first; raises RolloutTimeoutError after timeout_s.
        """

    @property
    def native_lora(self) -> bool:
        """True where the engine serves a LoRA adapter itself (vLLM with rollout.native_lora)."""
        return False

    def sync_lora(self, adapter: LoraAdapter | None) -> None:
        """Serve the model with this LoRA adapter from now on (None: the base model alone), without
        a checkpoint or a restart. Only engines whose `native_lora` is True implement it; for the
        others sleuth.rollout.sync sends merged full weights instead."""
        raise NotImplementedError(f"{type(self).__name__} does not serve LoRA adapters (native_lora is False)")

    # ------------------------------------------------------------------ memory

    def release_memory(self) -> int:
        """Give memory the engine holds only for generation back to the system while it idles; the
        caller promises no generation until the next weight sync (whose new weights make any cached
        KV stale anyway). Returns the bytes released; engines without such memory release none."""
        return 0

    # ------------------------------------------------------------------ plumbing

    def _wait(self, fut: concurrent.futures.Future[T], step: str, timeout: float | None = None) -> T:
        """Block on a worker future; a timeout raises an error that names the step."""
        limit = self.timeout_s if timeout is None else timeout
        try:
            return fut.result(timeout=limit)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise RolloutTimeoutError(
                f"{type(self).__name__}: {step} did not finish within {limit:g} s (rollout.timeout_s)"
            ) from None

    def _call(self, fn: Callable[[], T], step: str) -> T:
        """Run fn on the model's thread, after the work queued before it; wait at most timeout_s."""
        return self._wait(self._worker.submit(fn), step)

    def stats(self) -> dict[str, float]:
        """Counters since start (preemptions, aborted samples, tokens, ...)."""
        return {}

    def close(self) -> None:
        """Release the engine's resources."""
        self._worker.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded `seed` (so requests seeded 0 and 1 do not
    share samples, as seed + index would make them)."""
    return derive_seed("sample", seed, index, bits=63)


def engine_request_seed(engine_seed: int, count: int) -> int:
    """The seed of the count-th request an engine gets without a seed of its own."""
    return derive_seed("engine-request", engine_seed, count)


def resolve_future(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], result: Any = None,
                   exc: BaseException | None = None) -> None:
    """Complete a caller's asyncio future from the model's thread."""

    def set_it() -> None:
        if future.done():
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    # RuntimeError: the caller's event loop is gone (it timed out and returned).
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(set_it)


@dataclass(kw_only=True)
class InFlightGroup:
    """What both engines track for a request being generated: finish_sample fills `samples` and
    resolves `future` on the caller's `loop`; `cancelled` stops its remaining samples."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[GenerationResult]
    start: float
    samples: list[Sample | None]
    cancelled: threading.Event = field(default_factory=threading.Event)


def finish_sample(group: InFlightGroup, index: int, tokens: list[int], logprobs: list[float], reason: str,
                  tokenizer: Any, counts: dict[str, int], token_versions: list[int] | None = None) -> None:
    """Store sample `index` of an engine's in-flight group, count it, and resolve the group's future
    once all n samples are in. Both engines decode text here, so they decode it the same way."""
    group.samples[index] = Sample(
        token_ids=tokens, logprobs=logprobs, finish_reason=reason,  # type: ignore[arg-type]
        text=tokenizer.decode(tokens, skip_special_tokens=True),
        time_s=time.perf_counter() - group.start, token_versions=token_versions,
    )
    counts["samples"] += 1
    counts["tokens"] += len(tokens)
    counts["aborted"] += reason == "abort"
    if all(s is not None for s in group.samples):
        done = [s for s in group.samples if s is not None]
        resolve_future(group.loop, group.future,
                       result=GenerationResult(group.request, done, time.perf_counter() - group.start))


def to_groups(problems: Sequence[Problem], prompts: Sequence[list[int]],
              results: Sequence[GenerationResult]) -> list[Group]:
    """One Group per problem from the engine's results (token ids and logprobs kept as sampled)."""
    return [
        Group(problem=p, prompt_ids=ids, completions=[
            Completion(prompt_ids=ids, completion_ids=list(s.token_ids), logprobs=list(s.logprobs),
                       finish_reason=s.finish_reason, text=s.text, token_versions=s.token_versions)
            for s in r.samples])
        for p, ids, r in zip(problems, prompts, results, strict=True)
    ]
