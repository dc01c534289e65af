"""Our transformers rollout engine: batched sampling with a KV cache shared across each group.

`model.generate(num_return_sequences=n)` copies the prompt n times and runs all copies through the
model. Here each group's prompt is prefilled once (several groups left-padded into one batch), its
KV cache is then repeated to the group's n rows, and all rows decode together. Finished rows are
dropped from the batch (and the cache) as they pile up, and each group's result is handed back as
soon as its last row ends, so scoring can start before the batch is done.

Sampling: temperature (0 = greedy) and top-p, one torch.Generator per request seeded from
`SamplingParams.seed` (else from the engine seed and a request counter), so results are
reproducible. Logprobs are the raw model's (see base.py).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from sleuth.errors import UserError
from sleuth.records import FinishReason, LoraAdapter
from sleuth.rollout.base import (
    EARLY_STOP_DECAY,
    GenerationRequest,
    GenerationResult,
    InFlightGroup,
    RolloutEngine,
    RolloutTimeoutError,
    check_request,
    engine_request_seed,
    finish_sample,
    resolve_future,
)
from sleuth.rollout.shared_prefix import SharedPrefixCache
from sleuth.rollout.static_decode import DecodeGraph, StaticSharedCache
from sleuth.system.attention import (
    PACKED,
    compressed_attention,
    linear_attention,
    register_packed_attention,
    special_attention,
)

DEFAULT_MAX_ROWS = 64
"""Rows (samples) decoded together when rollout.max_concurrency is not set."""
DECODE_MODES = ("auto", "dynamic", "static", "cuda_graphs")
"""rollout.hf_decode: growing cache (dynamic), fixed-shape steps (static, static_decode.py), the
same captured as CUDA graphs (cuda_graphs); auto = cuda_graphs on CUDA, dynamic on the CPU."""


@dataclass(kw_only=True)
class _Group(InFlightGroup):
    max_new: int
    generator: torch.Generator


@dataclass
class _Row:
    group: _Group
    index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    done: bool = False


@dataclass
class _Swap:
    """A weight update for the model's thread and how it ended."""

    apply: Callable[[], None]
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class HFEngine(RolloutEngine):
    """Rollouts with a transformers causal LM (a loaded model object, possibly the trainer's)."""

    def __init__(self, model: Any, tokenizer: Any, *, seed: int = 0, model_path: str = "",
                 max_rows: int | None = None, context_len: int | None = None,
                 timeout_s: float = 1800.0, early_stop_logprob: float | None = None,
                 decode: str = "auto") -> None:
        super().__init__()
        if decode not in DECODE_MODES:
            raise UserError(f"rollout.hf_decode={decode!r}: choose one of {', '.join(DECODE_MODES)}")
        self.model = model
        self.tokenizer = tokenizer
        self.seed = seed
        self.model_path = model_path or str(getattr(model.config, "name_or_path", ""))
        self.max_rows = max_rows or DEFAULT_MAX_ROWS
        self.context_len = context_len or int(getattr(model.config, "max_position_embeddings", 4096))
        self.timeout_s = timeout_s
        self.early_stop_logprob = early_stop_logprob
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.eos_ids = _eos_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.shared_prefix = _shared_prefix_ready(model)
        """Decode with each prompt's KV stored once (shared_prefix.py); else a repeated cache."""
        self.group_per_batch = compressed_attention(model.config.get_text_config())
        """One group per batch, so no prompt is padded: compressed attention (DeepSeek V4) pools keys
        over blocks of positions counted from the row's first token, padding included."""
        if decode in ("static", "cuda_graphs") and not self.shared_prefix:
            why = ", ".join(special_attention(model.config)) or (
                f"attention {getattr(model.config, '_attn_implementation', None)}, not sdpa or sleuth_packed")
            raise UserError(f"rollout.hf_decode={decode} needs shared-prompt decoding, which this model cannot use ({why})")
        self.decode = decode
        self._counter = itertools.count()
        self._pending: list[_Group] = []
        self._lock = threading.Lock()
        self._counts = {"samples": 0, "tokens": 0, "aborted": 0, "prefill_tokens": 0, "batches": 0}
        self._lora_base: dict[str, torch.Tensor] = {}
        self._swaps: list[_Swap] = []
        """Weight updates waiting for the next decoding step (in_flight_updates)."""
        """Base values of the weights an adapter changed (sync_lora restores them before applying)."""

    @classmethod
    def from_path(cls, model_path: str, dtype: str = "float32", **kwargs: Any) -> HFEngine:
        from sleuth.system.models import load_causal_lm, load_tokenizer, resolve_model_path

        folder = str(resolve_model_path(model_path))
        register_packed_attention()
        model = load_causal_lm(folder, dtype, attn_implementation=PACKED)
        return cls(model, load_tokenizer(folder), model_path=folder, **kwargs)

    # ------------------------------------------------------------------ interface

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        max_new = check_request(request, self.context_len, self.vocab_size)
        seed = request.sampling.seed
        if seed is None:
            seed = engine_request_seed(self.seed, next(self._counter))
        gen = torch.Generator().manual_seed(seed)
        loop = asyncio.get_running_loop()
        group = _Group(request=request, max_new=max_new, generator=gen, loop=loop, future=loop.create_future(),
                       start=time.perf_counter(), samples=[None] * request.n)
        with self._lock:
            self._pending.append(group)
        # Let the other requests issued together (gather, stream) queue up first, so they share
        # batches and the batching, hence the numerics, is the same on every run.
        await asyncio.sleep(0)
        # One batch job per call; a job that finds the queue empty (an earlier job took this group
        # into its batch) returns at once.
        self._worker.submit(self._run_pending)
        try:
            return await asyncio.wait_for(asyncio.shield(group.future), self.timeout_s)
        except TimeoutError:
            group.cancelled.set()
            raise _timeout(self, f"generation of request {request.request_id or '<unnamed>'}") from None
        finally:
            group.cancelled.set()  # no-op when done; stops decoding its rows when cancelled

    supports_in_flight_updates = True

    def sync_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        tensors = list(named_tensors)
        self._update(lambda: self._copy_weights(tensors), "weight sync (sync_weights)")

    @property
    def native_lora(self) -> bool:
        """Adapters are applied here: base + scaling * B @ A written into the engine's own weights,
        from copies of the adapted weights' base values (only those, not the whole model)."""
        return True

    def sync_lora(self, adapter: LoraAdapter | None) -> None:
        self._update(lambda: self._apply_adapter(adapter), "LoRA sync (sync_lora)")

    def _update(self, apply: Callable[[], None], step: str) -> None:
        """Run a weight update on the model's thread: after the work queued before it, or, with
        in_flight_updates, between two decoding steps of the batch in flight (its rows keep their
        KV cache and go on with the new weights; Sample.token_versions says which tokens came after)."""
        if not self.in_flight_updates:
            self._call(apply, step)
            return
        swap = _Swap(apply)
        with self._lock:
            self._swaps.append(swap)
        self._worker.submit(self._apply_swaps)  # applies it when no batch is decoding
        if not swap.done.wait(self.timeout_s):
            raise _timeout(self, step)
        if swap.error is not None:
            raise swap.error

    def _apply_swaps(self) -> None:
        with self._lock:
            swaps, self._swaps = self._swaps, []
        for swap in swaps:
            try:
                swap.apply()
            except BaseException as e:  # the caller of sync_weights raises it
                swap.error = e
            finally:
                swap.done.set()

    def stats(self) -> dict[str, float]:
        return {k: float(v) for k, v in self._counts.items()} | {"preemptions": 0.0}

    # ------------------------------------------------------------------ worker side

    @torch.no_grad()
    def _apply_adapter(self, adapter: LoraAdapter | None) -> None:
        params = dict(self.model.named_parameters())
        deltas = adapter.deltas() if adapter is not None else {}
        missing = sorted(set(deltas) - set(params))
        if missing:
            raise UserError(f"LoRA adapter targets {missing[0]}, which the model in {self.model_path} lacks")
        for name in deltas:
            if name not in self._lora_base:  # first time this weight is adapted: keep its base value
                self._lora_base[name] = params[name].detach().clone()
        for name, base in self._lora_base.items():
            p = params[name]
            p.copy_((base.float() + deltas[name].to(p.device)).to(p.dtype) if name in deltas else base)

    @torch.no_grad()
    def _copy_weights(self, tensors: list[tuple[str, Any]]) -> None:
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        unknown = [name for name, _ in tensors if name not in params]
        if unknown:
            raise UserError(f"sync_weights: the engine's model has no parameter named {unknown[0]}")
        for name, t in tensors:
            p = params[name]
            if p.shape != t.shape:
                raise UserError(f"sync_weights: {name} has shape {tuple(t.shape)}, the engine's {tuple(p.shape)}")
            if p.data_ptr() != t.data_ptr():  # the trainer's own tensor when the model is shared
                p.copy_(t)
        self._lora_base.clear()  # full weights are the new base of any later adapter

    def _take_batch(self) -> list[_Group]:
        with self._lock:
            batch, rows = [], 0
            while self._pending and (not batch or (rows + self._pending[0].request.n <= self.max_rows
                                                   and not self.group_per_batch)):
                g = self._pending.pop(0)
                if g.cancelled.is_set():
                    continue
                batch.append(g)
                rows += g.request.n
            return batch

    def _run_pending(self) -> None:
        while batch := self._take_batch():
            try:
                self._decode(batch)
            except BaseException as e:  # hand the error to every waiting caller, never lose it
                for g in batch:
                    resolve_future(g.loop, g.future, exc=e)

    @torch.inference_mode()
    def _decode(self, groups: list[_Group]) -> None:
        model = self.model
        was_training = model.training
        model.eval()
        try:
            self._decode_batch(groups)
        finally:
            model.train(was_training)

    def _decode_batch(self, groups: list[_Group]) -> None:
        model = self.model
        device = model.get_output_embeddings().weight.device
        self._counts["batches"] += 1
        # Prefill: every group's prompt once, left-padded to a common length.
        width = max(len(g.request.prompt_ids) for g in groups)
        ids = torch.full((len(groups), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(groups), width), dtype=torch.long)
        for i, g in enumerate(groups):
            p = g.request.prompt_ids
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        self._counts["prefill_tokens"] += int(mask.sum())
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        cache: Any = out.past_key_values
        repeats = torch.tensor([g.request.n for g in groups], device=device)
        mode = self._decode_mode(device)
        graph: DecodeGraph | None = None
        if self.shared_prefix:  # each prompt's KV stays one copy; rows keep only their own tokens
            cache_cls = SharedPrefixCache if mode == "dynamic" else StaticSharedCache
            cache = cache_cls([(layer.keys, layer.values) for layer in cache.layers], mask,
                              [g.request.n for g in groups], max(g.max_new for g in groups))
        else:  # repeat each group's cache (and its padding mask) to its n rows; reorder_cache forks
            # every layer's kind of state (keys/values, or a linear-attention layer's recurrent and
            # convolution states) per sample
            fork_cache(cache, torch.repeat_interleave(torch.arange(len(groups), device=device), repeats))
            mask = mask.repeat_interleave(repeats, dim=0)
        logits = out.logits[:, -1].float().repeat_interleave(repeats, dim=0)
        next_pos = positions[:, -1].repeat_interleave(repeats, dim=0) + 1
        rows = [_Row(g, j) for g in groups for j in range(g.request.n)]
        ma = torch.zeros(len(rows))  # early-stop moving averages
        step = 0
        while rows:
            tokens, logps = self._sample(rows, logits)
            ma = EARLY_STOP_DECAY * ma + (1 - EARLY_STOP_DECAY) * logps.cpu()
            step += 1
            for i, (r, t, lp) in enumerate(zip(rows, tokens.tolist(), logps.tolist())):
                if r.done:  # finished, waiting to be dropped from the batch
                    continue
                r.tokens.append(t)
                r.logprobs.append(lp)
                r.versions.append(self.policy_version)
                reason = self._finish_reason(r, step, float(ma[i]))
                if reason is not None:
                    self._finish(r, reason)
                elif r.group.cancelled.is_set():
                    r.done = True
            keep = [i for i, r in enumerate(rows) if not r.done]
            if not keep:
                break
            # Drop finished rows once they are a quarter of the batch (half with CUDA graphs, which
            # are captured again for the survivors): compute on dead rows is wasted, but
            # re-indexing the whole cache every step costs too.
            if len(keep) <= (0.5 if mode == "cuda_graphs" else 0.75) * len(rows):
                idx = torch.tensor(keep, device=device)
                if self.shared_prefix:
                    cache.keep_rows(idx)
                else:
                    fork_cache(cache, idx)
                    mask = mask[idx]
                rows = [rows[i] for i in keep]
                tokens, next_pos, ma = tokens[idx], next_pos[idx], ma[idx.cpu()]
            if self._swaps:  # a weight update in flight (in place): the next logits are the new weights'
                self._apply_swaps()
            if mode != "dynamic":
                if graph is None or graph.tokens.shape[0] != len(rows):
                    graph = DecodeGraph(model, cache, len(rows), device, capture=mode == "cuda_graphs")
                logits = graph.run(tokens, next_pos)
                next_pos = next_pos + 1
                continue
            if self.shared_prefix:
                # The override computes the attention; the model needs only some prepared 4D mask
                # (which it passes through untouched) to skip building its own.
                kw = {"attention_override": cache,
                      "attention_mask": torch.ones((len(rows), 1, 1, 1), dtype=torch.bool, device=device)}
            else:
                mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype, device=device)], dim=1)
                kw = {"attention_mask": mask}
            out = model(input_ids=tokens[:, None], position_ids=next_pos[:, None], past_key_values=cache,
                        use_cache=True, **kw)
            cache = out.past_key_values
            logits = out.logits[:, -1].float()
            next_pos = next_pos + 1

    def _decode_mode(self, device: torch.device) -> str:
        if self.decode == "cuda_graphs" and device.type != "cuda":
            return "static"  # nothing to capture off CUDA: the same fixed-shape steps, eagerly
        if self.decode != "auto":
            return self.decode
        return "cuda_graphs" if device.type == "cuda" and self.shared_prefix else "dynamic"

    def _sample(self, rows: list[_Row], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Next token of each row (per-group temperature/top-p/generator) and its raw logprob.

        Each step draws one uniform per sample of the group, whether or not that sample's row is
        still in the batch: the group's random stream, hence its samples, does not depend on which
        other groups share the batch or when finished rows are dropped (so a group gives the same
        samples on whichever rollout worker, in whichever batch, it runs).
        """
        raw = torch.log_softmax(logits, dim=-1)
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        start = 0
        while start < len(rows):
            g = rows[start].group
            end = start
            while end < len(rows) and rows[end].group is g:
                end += 1
            uniform = torch.rand(g.request.n, generator=g.generator)
            picks = uniform[[r.index for r in rows[start:end]]]
            tokens[start:end] = _sample_rows(logits[start:end], g.request.sampling.temperature,
                                             g.request.sampling.top_p, picks)
            start = end
        return tokens, raw.gather(-1, tokens[:, None])[:, 0]

    def _finish_reason(self, r: _Row, step: int, ma: float) -> FinishReason | None:
        if r.tokens[-1] in self.eos_ids:
            return "stop"
        stops = r.group.request.sampling.stop
        if stops and _hits_stop(self.tokenizer, r.tokens, stops):
            return "stop"
        if step >= r.group.max_new:
            return "length"
        if self.early_stop_logprob is not None and ma < self.early_stop_logprob:
            return "abort"
        return None

    def _finish(self, r: _Row, reason: FinishReason) -> None:
        r.done = True
        finish_sample(r.group, r.index, r.tokens, r.logprobs, reason, self.tokenizer, self._counts,
                      r.versions if self.in_flight_updates else None)


def _sample_rows(logits: torch.Tensor, temperature: float, top_p: float, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: row i takes the first token whose cumulative probability exceeds
    uniform[i] (times the row's total mass, which top-p and float rounding leave below 1)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    cdf = probs.cumsum(-1)
    target = (uniform.to(cdf) * cdf[:, -1])[:, None]
    # right=True skips zero-probability tokens (their cdf equals the one before them).
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp(max=probs.shape[-1] - 1)


def _hits_stop(tokenizer: Any, tokens: list[int], stops: tuple[str, ...]) -> bool:
    # Only the newest token can complete a stop string, and every token is at least one byte, so
    # decoding the last (longest stop in bytes + 1) tokens is enough to see it.
    window = max(len(s.encode()) for s in stops) + 1
    tail = tokenizer.decode(tokens[-window:], skip_special_tokens=True)
    return any(s in tail for s in stops)


COMPRESSOR_STATE = ("buffer_kv", "buffer_gate", "compressed_kv", "overlap_kv", "overlap_gate")
"""Per-row tensors (dicts by entry name) of DeepSeek V4's cache layers that their reorder_cache leaves alone."""


def fork_cache(cache: Any, idx: torch.Tensor) -> None:
    """Rows of a transformers cache picked (and repeated) by idx: `reorder_cache` for each layer's
    own kind of state (keys/values, a linear-attention layer's recurrent and convolution states),
    then DeepSeek V4's compressor state (COMPRESSOR_STATE)."""
    cache.reorder_cache(idx)
    for layer in cache.layers:
        for attr in COMPRESSOR_STATE:
            state = getattr(layer, attr, None) or {}
            for name, t in state.items():
                if isinstance(t, torch.Tensor):
                    state[name] = t.index_select(0, idx.to(t.device))


def _shared_prefix_ready(model: Any) -> bool:
    """Whether the model's attention is sleuth's registered one (which takes attention_override).
    A model on plain "sdpa" is switched to it: without the override it is exactly sdpa. Sliding
    windows and attention sinks are not in SharedPrefixCache.attend: those models decode with a
    repeated cache (transformers' own cache layers and masks keep them exact), and so do models
    with linear-attention layers (their recurrent state is forked per sample instead)."""
    if special_attention(model.config) or linear_attention(model.config):
        return False
    impl = getattr(model.config, "_attn_implementation", None)
    if impl == "sdpa" and hasattr(model, "set_attn_implementation"):
        register_packed_attention()
        model.set_attn_implementation(PACKED)
        impl = getattr(model.config, "_attn_implementation", None)
    return impl == PACKED


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        eos = getattr(src, "eos_token_id", None)
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise UserError("model and tokenizer define no EOS token")
    return ids


def _timeout(engine: RolloutEngine, step: str) -> Exception:
    return RolloutTimeoutError(f"{type(engine).__name__}: {step} did not finish within "
                               f"{engine.timeout_s:g} s (rollout.timeout_s)")
