"""The vLLM rollout engine: in-process vLLM (V1 `LLMEngine`) driven by one thread of ours.

Why a driver thread of our own rather than `AsyncLLM`: we step the engine ourselves, so we decide
which samples enter (the KV-cache limiter, see limiter.py, so nothing is preempted), can abort a
degenerate sample between two steps (early stop), and can run a weight sync exactly between the
rollouts of two iterations. Everything touching vLLM runs on that thread; callers wait on futures
with a timeout, so a hung step raises RolloutTimeoutError naming it instead of hanging.

Each of a group's n samples is its own vLLM request (its own seed, see sample_seed): prefix caching
shares the prompt's KV blocks among them, and one sample can be aborted alone.

Weights (vllm_weights.py): full weights reloaded in place under the published checkpoint's
names, then the prefix cache is reset (its KV was computed by the old weights). A sync waits for
the rollouts queued before it, unless `in_flight_updates` (loop.streaming): then it runs between two
engine steps, and the samples in flight are partial rollouts. vLLM's scheduler preempts them
(`reset_prefix_cache(reset_running_requests=True)`): their KV cache is dropped, and each one resumes
by prefilling its prompt and its tokens so far with the new weights, keeping its request, its
sampler's state (seed, structured-output state, stop strings) and its tokens; each token records
the policy version that sampled it (Sample.token_versions). LoRA
(rollout.native_lora): vLLM serves the adapter itself, reloaded in place from a folder in /dev/shm
on every sync (vLLM's LoRA loader only reads paths; this works on CPU too); otherwise the adapter
is merged into full weights and synced as such.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import queue
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sleuth.errors import UserError
from sleuth.records import FinishReason, LoraAdapter
from sleuth.rollout.base import (
    GenerationRequest,
    GenerationResult,
    InFlightGroup,
    RolloutEngine,
    RolloutTimeoutError,
    check_request,
    engine_request_seed,
    finish_sample,
    moving_average_below,
    resolve_future,
    sample_seed,
)
from sleuth.rollout.limiter import KVLimiter
from sleuth.rollout.vllm_runtime import count_live_engines, release_kv_cache, stat_counter
from sleuth.rollout.vllm_weights import (
    full_sync_refusal,
    load_error,
    load_full,
    loaded_by_copy,
    published_names,
    write_adapter,
)
from sleuth.system.logs import verbose_requested

GiB = 1024**3


@dataclass(kw_only=True)
class _Group(InFlightGroup):
    gid: str
    max_new: int
    seed: int


@dataclass
class _Active:
    group: _Group
    index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """The policy version of each token (the engine's when it was sampled)."""
    average: float = 0.0  # early-stop moving average


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: Future[Any]
    in_flight: bool = False
    """Runs between two engine steps, not after the rollouts queued before it (a weight update
    with in_flight_updates: fn preempts the samples in flight itself)."""


class VLLMEngine(RolloutEngine):
    def __init__(self, model_path: str, *, dtype: str = "bfloat16", seed: int = 0,
                 context_len: int | None = None, kv_cache_gb: float = 2.0,
                 gpu_memory_utilization: float = 0.5, max_concurrency: int | None = None,
                 early_stop_logprob: float | None = None, timeout_s: float = 1800.0,
                 enable_lora: bool = False, max_lora_rank: int = 64, enforce_eager: bool | None = None,
                 startup_timeout_s: float = 900.0, tensor_parallel_size: int = 1) -> None:
        super().__init__()
        # In-process engine core: no extra process to start, and weights can be handed over as
        # tensors. Must be set before vllm is imported.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from sleuth.system.models import load_tokenizer, resolve_model_path

        self.model_path = str(resolve_model_path(model_path))
        self.seed = seed
        self.timeout_s = timeout_s
        self.early_stop_logprob = early_stop_logprob
        self.tokenizer = load_tokenizer(self.model_path)
        self._args = dict(
            model=self.model_path, dtype=dtype, seed=seed, max_model_len=context_len,
            enable_prefix_caching=True, enforce_eager=enforce_eager, disable_log_stats=False,
            max_num_seqs=max_concurrency or 256, enable_lora=enable_lora, max_lora_rank=max_lora_rank,
            tensor_parallel_size=tensor_parallel_size,
        )
        if tensor_parallel_size > 1:  # the shards run in worker processes vLLM starts on this node's GPUs
            self._args["distributed_executor_backend"] = "mp"
        self._kv_cache_gb = kv_cache_gb
        self._gpu_memory_utilization = gpu_memory_utilization
        self._max_concurrency = max_concurrency
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._counter = itertools.count()
        self._counts = {"samples": 0, "tokens": 0, "aborted": 0, "preemptions": 0,
                        "prefix_queries": 0, "prefix_hits": 0, "syncs": 0, "partial": 0}
        """partial: samples in flight at a weight update (resumed with the new weights); vLLM counts
        them as preemptions too, stats() reports the others (KV-cache pressure) as preemptions."""
        self._active: dict[str, _Active] = {}
        """The samples inside vLLM now (the driver thread's; read by the in-flight updates it runs)."""
        self._lora_request: Any = None
        self._lora_dir: Path | None = None
        self._skeleton: Any = None
        """The model's modules without weights (meta device), for the published names of synced tensors."""
        self._closed = False
        self._error: BaseException | None = None
        self._wait(self._worker.submit(self._start), "vLLM engine start-up", startup_timeout_s)
        self._loop_future = self._worker.submit(self._loop)
        count_live_engines(+1)

    # ------------------------------------------------------------------ start-up

    def _start(self) -> None:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.llm_engine import LLMEngine

        self.on_cpu = current_platform.is_cpu()
        self._by_copy = loaded_by_copy(self._config())
        """Name parts of the tensors the model's vLLM loader copies directly (read once, not per sync)."""
        args = dict(self._args)
        args.setdefault("use_tqdm_on_load", verbose_requested())  # sleuth prints its own progress
        if self.on_cpu:
            args["kv_cache_memory_bytes"] = int(self._kv_cache_gb * GiB)
            # vLLM 0.32 on CPU crashes ("CPU Generator does not use offset") when a seeded request's
            # prompt is prefilled in chunks; whole-prompt prefills avoid that path.
            args["enable_chunked_prefill"] = False
        else:
            args["gpu_memory_utilization"] = self._gpu_memory_utilization
        if args["enforce_eager"] is None:
            # GPU: CUDA graphs pay off at once. CPU: compiling costs start-up time on every run.
            args["enforce_eager"] = self.on_cpu
        try:
            self._engine = LLMEngine.from_engine_args(
                EngineArgs(**args), stat_loggers=[stat_counter(self._counts)]
            )
        except Exception as e:  # vLLM's model code refuses architectures in many ways (KeyError, assert)
            raise UserError(f"vLLM cannot load the model in {self.model_path}: {load_error(e)}; "
                            "rollout.engine=hf serves any model transformers loads") from None
        cfg = self._engine.vllm_config
        text = cfg.model_config.hf_config.get_text_config()
        chunk, block = getattr(text, "attention_chunk_size", None), cfg.cache_config.block_size
        if chunk and block and chunk % block:  # vLLM asserts this only at the first generation
            raise UserError(f"vLLM cannot serve the model in {self.model_path}: its attention_chunk_size {chunk} "
                            f"is not a multiple of vLLM's KV block size {block}; use rollout.engine=hf")
        self.context_len = int(cfg.model_config.max_model_len)
        self.vocab_size = int(cfg.model_config.get_vocab_size())
        cache = cfg.cache_config
        max_seqs = cfg.scheduler_config.max_num_seqs
        # vLLM's block pool keeps one block aside as its "null block".
        usable = int(cache.num_gpu_blocks) - 1
        self.limiter = KVLimiter(usable, int(cache.block_size), max_sequences=max_seqs)

    # ------------------------------------------------------------------ interface

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self._check_alive()
        max_new = check_request(request, self.context_len, self.vocab_size, structured_output=True)
        seed = request.sampling.seed
        if seed is None:
            seed = engine_request_seed(self.seed, next(self._counter))
        loop = asyncio.get_running_loop()
        group = _Group(request=request, gid=f"g{next(self._counter)}", max_new=max_new, seed=seed, loop=loop,
                       future=loop.create_future(), start=time.perf_counter(), samples=[None] * request.n)
        self._inbox.put(group)
        try:
            return await asyncio.wait_for(asyncio.shield(group.future), self.timeout_s)
        except TimeoutError:
            group.cancelled.set()
            raise RolloutTimeoutError(
                f"VLLMEngine: generation of request {request.request_id or group.gid} did not finish "
                f"within {self.timeout_s:g} s (rollout.timeout_s)"
            ) from None

    supports_in_flight_updates = True

    @property
    def full_sync_supported(self) -> bool:
        """Whether merged full weights can be loaded in place (vllm_weights.full_sync_refusal: not
        a mixture of experts vLLM does not follow), so a run needing it is refused up front."""
        return not self._full_sync_refusal()

    def _config(self) -> dict[str, Any]:
        try:
            return dict(json.loads((Path(self.model_path) / "config.json").read_text()))
        except (OSError, ValueError):
            return {}

    def _full_sync_refusal(self) -> str:
        return full_sync_refusal(self._config(), self.on_cpu)

    def sync_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        why = self._full_sync_refusal()
        if why:
            raise UserError(f"the vLLM engine cannot take full weight syncs of the mixture-of-experts model in "
                            f"{self.model_path} ({why}); use rollout.engine=hf or LoRA adapter sync")
        if self._skeleton is None:
            from sleuth.system.models import model_skeleton

            self._skeleton = model_skeleton(Path(self.model_path))
        tensors = published_names(self._skeleton, named_tensors)
        self._call(lambda: self._load(tensors), "weight sync (sync_weights)", self.in_flight_updates)

    @property
    def native_lora(self) -> bool:
        return bool(self._args["enable_lora"])

    def sync_lora(self, adapter: LoraAdapter | None) -> None:
        if not self.native_lora:
            super().sync_lora(adapter)  # raises: started without enable_lora
            return

        def load() -> None:
            from vllm.lora.request import LoRARequest

            self._reset_prefix_cache()
            if adapter is None:
                if self._lora_request is not None:
                    self._engine.remove_lora(self._lora_request.lora_int_id)
                self._lora_request = None
                return
            if self._lora_dir is None:
                shm = Path("/dev/shm")
                self._lora_dir = Path(tempfile.mkdtemp(prefix="sleuth-lora-", dir=shm if shm.is_dir() else None))
            write_adapter(adapter, self._lora_dir, self.model_path)
            # load_inplace: the same adapter id is reloaded from the folder, replacing the old one.
            self._lora_request = LoRARequest("policy", 1, str(self._lora_dir), load_inplace=True)
            self._engine.add_lora(self._lora_request)
            self._reset_prefix_cache()  # again: the old adapter's KV may be cached under this id
            self._counts["syncs"] += 1

        self._call(load, "LoRA sync (sync_lora)", self.in_flight_updates)

    def release_memory(self) -> int:
        """On CPU, the KV cache's pages (rollout.kv_cache_gb, touched in full at start-up) go back to
        the system until the next rollout writes them again: the training step never needs them at
        the same time. The prefix cache is emptied first, so no stale block is read as cached."""
        if not self.on_cpu:  # GPU memory is not the machine's resident set
            return 0

        def release() -> int:
            if not self._engine.reset_prefix_cache():  # a block still in use: keep everything
                return 0
            return sum(self._engine.collective_rpc(release_kv_cache))

        return int(self._call(release, "KV cache release (release_memory)"))

    def stats(self) -> dict[str, float]:
        lim = self.limiter
        out = {k: float(v) for k, v in self._counts.items()}
        out["preemptions"] = float(max(0, self._counts["preemptions"] - self._counts["partial"]))
        out.update(kv_blocks=float(lim.total_blocks), block_size=float(lim.block_size),
                   peak_in_flight=float(lim.peak_in_flight),
                   mean_completion=float(lim.mean_completion or 0.0),
                   prefix_hit_rate=self._counts["prefix_hits"] / max(1, self._counts["prefix_queries"]))
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._inbox.put(None)
        try:
            self._loop_future.result(timeout=60)
            self._engine.engine_core.shutdown()
        except Exception:  # closing is best effort; the process may be exiting anyway
            pass
        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)
        count_live_engines(-1)
        super().close()

    # ------------------------------------------------------------------ driver thread

    def _call(self, fn: Callable[[], Any], step: str, in_flight: bool = False) -> Any:
        """Run fn on the driver thread once the rollouts queued before it have finished, or, in_flight,
        between two engine steps."""
        self._check_alive()
        fut: Future[Any] = Future()
        self._inbox.put(_Call(fn, fut, in_flight))
        return self._wait(fut, step)

    def _load(self, tensors: list[tuple[str, Any]]) -> None:
        load_full(self._engine, tensors, self.on_cpu, self._by_copy)
        self._reset_prefix_cache()
        self._counts["syncs"] += 1

    def _reset_prefix_cache(self) -> None:
        """After new weights: no KV computed by the old ones is read again. Samples in flight (an
        in-flight update) are preempted by vLLM's scheduler and resume by prefilling their prompt and
        tokens so far with the new weights."""
        running = bool(self._active)
        if not self._engine.reset_prefix_cache(reset_running_requests=running):
            raise RuntimeError("vLLM did not reset its prefix cache after a weight update")
        self._counts["partial"] += sum(1 for a in self._active.values() if a.tokens) if running else 0

    def _loop(self) -> None:
        try:
            self._drive()
        except BaseException as e:
            # Fail fast from now on: callers get this error instead of waiting for a timeout.
            self._error = e
            while True:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, _Call):
                    item.future.set_exception(e)
                elif item is not None:
                    resolve_future(item.loop, item.future, exc=e)
            raise

    def _check_alive(self) -> None:
        if self._closed:
            raise RuntimeError("VLLMEngine is closed")
        if self._error is not None:
            raise RuntimeError(f"VLLMEngine stopped after an error: {self._error!r}") from self._error

    def _drive(self) -> None:
        pending: deque[tuple[_Group, int]] = deque()  # samples waiting for KV room
        held: list[_Group] = []  # groups that arrived after a call (a sync) still waiting to run
        calls: list[_Call] = []
        active = self._active
        while True:
            idle = not active and not pending and not calls
            try:
                item = self._inbox.get(timeout=0.05) if idle else self._inbox.get_nowait()
            except queue.Empty:
                item = False
            while item is not False:
                if item is None:  # close()
                    for g, _ in pending:
                        resolve_future(g.loop, g.future, exc=RuntimeError("VLLMEngine closed"))
                    return
                if isinstance(item, _Call) and item.in_flight and not calls:
                    _run_call(item)  # between two steps: the samples in flight go on after it
                elif isinstance(item, _Call):
                    calls.append(item)
                elif calls:
                    held.append(item)
                else:
                    pending.extend((item, i) for i in range(item.request.n))
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = False
            self._drop_cancelled(pending, active)
            if calls and not active and not pending:
                # A barrier: everything queued before it has finished; run it, then what came after.
                for c in calls:
                    _run_call(c)
                calls.clear()
                pending.extend((g, i) for g in held for i in range(g.request.n))
                held.clear()
                continue
            self._admit(pending, active)
            if active:
                try:
                    outputs = self._engine.step()
                except BaseException as e:  # hand the failure to every caller waiting on it
                    self._error = e  # first, so no new caller queues behind a dead loop
                    waiting = [a.group for a in active.values()] + [g for g, _ in pending] + held
                    for g in waiting:
                        resolve_future(g.loop, g.future, exc=e)
                    for c in calls:
                        c.future.set_exception(e)
                    raise
                self._process(outputs, active)

    def _admit(self, pending: deque[tuple[_Group, int]], active: dict[str, _Active]) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        while pending:
            g, i = pending[0]
            key = f"{g.gid}-{i}"
            plen = len(g.request.prompt_ids)
            if not self.limiter.try_acquire(key, g.gid, plen, g.max_new):
                return
            pending.popleft()
            s = g.request.sampling
            params = SamplingParams(
                n=1, temperature=s.temperature, top_p=s.top_p, max_tokens=g.max_new, stop=list(s.stop),
                include_stop_str_in_output=True, seed=sample_seed(g.seed, i), logprobs=0,
                output_kind=RequestOutputKind.DELTA, detokenize=bool(s.stop),
                structured_outputs=StructuredOutputsParams(regex=s.regex) if s.regex else None,
            )
            self._engine.add_request(key, {"prompt_token_ids": list(g.request.prompt_ids)}, params,
                                     lora_request=self._lora_request)
            active[key] = _Active(g, i)

    def _process(self, outputs: list[Any], active: dict[str, _Active]) -> None:
        threshold = self.early_stop_logprob
        for out in outputs:
            a = active.get(out.request_id)
            if a is None:
                continue
            c = out.outputs[0]
            new = list(c.token_ids)
            lps = [c.logprobs[j][t].logprob for j, t in enumerate(new)] if new else []
            a.tokens.extend(new)
            a.logprobs.extend(lps)
            a.versions.extend([self.policy_version] * len(new))
            if out.finished:
                reason: FinishReason = c.finish_reason if c.finish_reason in ("stop", "length") else "abort"
                self._finish(out.request_id, a, reason, active)
                continue
            if threshold is not None:
                below, a.average = moving_average_below(lps, threshold, a.average)
                if below:
                    self._engine.abort_request([out.request_id])
                    self._finish(out.request_id, a, "abort", active)

    def _finish(self, key: str, a: _Active, reason: FinishReason, active: dict[str, _Active]) -> None:
        del active[key]
        self.limiter.release(key, None if reason == "abort" else len(a.tokens))
        finish_sample(a.group, a.index, a.tokens, a.logprobs, reason, self.tokenizer, self._counts,
                      a.versions if self.in_flight_updates else None)

    def _drop_cancelled(self, pending: deque[tuple[_Group, int]], active: dict[str, _Active]) -> None:
        """Forget the samples of requests whose caller timed out: abort them in vLLM, free KV room."""
        if any(g.cancelled.is_set() for g, _ in pending):
            kept = [(g, i) for g, i in pending if not g.cancelled.is_set()]
            pending.clear()
            pending.extend(kept)
        gone = [k for k, a in active.items() if a.group.cancelled.is_set()]
        if gone:
            self._engine.abort_request(gone)
            for k in gone:
                del active[k]
                self.limiter.release(k, None)


def _run_call(call: _Call) -> None:
    if call.future.set_running_or_notify_cancel():
        try:
            call.future.set_result(call.fn())
        except BaseException as e:
            call.future.set_exception(e)
