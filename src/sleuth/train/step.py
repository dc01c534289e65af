"""One GRPO-family training step over a batch of groups.

    trainer = Trainer(policy, cfg.algorithm, cfg.trainer, total_steps=cfg.loop.iterations,
                      max_tokens=cfg.rollout.max_tokens)
    metrics = trainer.step(groups)     # groups with advantages (see advantages.py)

A step splits the groups into trainer.mini_batches mini-batches, packs each into rows
(packing.py), then makes epochs_per_iteration passes; each pass takes one optimizer step per
mini-batch, accumulating gradients over its rows. Per-token loss weights come from the
mini-batch's counts computed before any backward pass, so the update does not depend on the row split.

The trainer's "old" logprobs (the PPO ratio's denominator and the TIS numerator) are each
mini-batch's own first-pass logprobs, detached: no extra forward pass is needed. For the first
mini-batch these are the weights that sampled it (up to engine rounding); a later one was sampled
before the earlier mini-batches' steps, and the truncated IS weight min(exp(old - engine), cap)
reweights its tokens from the behaviour policy to these (decoupled PPO, as with loop.max_staleness).
Guided samples (rollout.guided_samples) take no IS weight: the constraint that drew them is not a
policy to correct towards, they are off-policy guidance.
"""

from __future__ import annotations

import logging
import math
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from sleuth.config import AlgorithmConfig, TrainerConfig
from sleuth.errors import UserError
from sleuth.records import Group
from sleuth.system.attention import one_sequence_per_row
from sleuth.train.losses import AGGREGATIONS, aggregation_weights, get_loss, k3_kl, tis_weights
from sleuth.train.optim import build_optimizer, measure_matmul_flops
from sleuth.train.packing import PackedBatch, PackedRow, loss_mask, pack_groups, prompt_of
from sleuth.train.policy import Policy

log = logging.getLogger(__name__)

SELF_CHECK_TOL = {torch.float32: (1e-3, 1e-4), torch.bfloat16: (math.inf, 0.25)}
"""(max, mean) absolute logprob difference allowed between packed and naive forwards, per dtype.
An ignored mask shifts logprobs by whole nats on average. In bf16 the mean is stable (0.041-0.045
on SmolLM2-135M, 30 layers, docs/benchmarks.md train_step) but single tokens differed by up to
4.9 nats from rounding alone, so bf16 is judged on the mean only."""


SELF_CHECK_TOL_QUANTIZED = (math.inf, 0.01)
"""The same for a bitsandbytes-quantized base (model.quantization): LLM.int8 picks its outlier
columns over the whole batch, so a packed row and a lone sequence see slightly different weights
(tiny model: max 1.4e-3, mean 2.6e-4; SmolLM2 in docs/benchmarks.md); an ignored mask is still
off by whole nats on average."""


class SelfCheckError(UserError):
    """Packed and naive logprobs disagree: the model's attention does not honour the packed mask."""


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


METRIC_KEYS = (
    "loss", "clip_frac_low", "clip_frac_high", "grad_norm", "kl", "entropy", "tis_weight_mean",
    "tis_capped_frac", "tokens", "tokens_per_s", "mfu", "peak_mem_gb", "skipped", "rows", "sequences",
    "completion_tokens", "lr", "step_time_s",
)


@dataclass
class _PassCache:
    """Per-row tensors computed in the first epoch and reused by later ones."""

    old: list[torch.Tensor] = field(default_factory=list)
    ref: list[torch.Tensor] = field(default_factory=list)


def split_mini_batches(groups: list[Group], n: int) -> list[list[Group]]:
    """The groups in order, cut into min(n, len(groups)) runs whose sizes differ by at most one."""
    n = max(1, min(n, len(groups)))
    size, extra = divmod(len(groups), n)
    out, begin = [], 0
    for i in range(n):
        end = begin + size + (i < extra)
        out.append(groups[begin:end])
        begin = end
    return out


class Trainer:
    """Optimizer, schedule and the packed policy-gradient step for one Policy.

    A sharded trainer (fsdp.py) overrides the hooks `_micro_rows` (which rows this process runs),
    `_reduce_sums` (sums over processes), `_clip_grad_norm` and `_check_rows`; the step itself is
    this one.
    """

    world_size = 1
    """Processes that share one step (FSDP2 ranks); 1 for this single-process trainer."""

    def __init__(self, policy: Policy, algorithm_cfg: AlgorithmConfig, trainer_cfg: TrainerConfig,
                 total_steps: int | None = None, max_tokens: int = 256, peak_flops: float | None = None) -> None:
        self.policy = policy
        self.algo = algorithm_cfg
        self.cfg = trainer_cfg
        self.max_tokens = max_tokens
        self.loss_fn = get_loss(algorithm_cfg.loss)
        if algorithm_cfg.aggregation not in AGGREGATIONS:
            raise UserError(f"unknown aggregation '{algorithm_cfg.aggregation}'")
        if algorithm_cfg.kl_beta > 0 and not policy.has_reference:
            raise UserError("algorithm.kl_beta > 0 needs a policy built with need_reference=True")
        self.params = policy.trainable_parameters()
        per_iteration = trainer_cfg.epochs_per_iteration * trainer_cfg.mini_batches
        total_opt = total_steps * per_iteration if total_steps is not None else None
        self.optimizer, self.scheduler = build_optimizer(self.params, trainer_cfg, total_opt)
        self.step_count = 0
        """Completed calls of step() (iterations)."""
        self.self_checked = not trainer_cfg.self_check
        self.peak_flops = peak_flops
        body, head = policy.matmul_parameters()
        self._body_params, self._head_params = body, head
        why_one = one_sequence_per_row(policy.causal_lm.config)
        self.one_per_row = bool(why_one)
        """A linear-attention layer's recurrent and convolution state would run on from one packed
        sequence into the next, a sparse-attention indexer would rank other sequences' keys, a
        compressed-attention block would pool across sequences (no mask scopes any of them): such
        a model trains one sequence per row."""
        if self.one_per_row:
            log.info("packing: one sequence per row, prompts not shared (%s)", why_one)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step_count": self.step_count,
            "self_checked": self.self_checked,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """What state_dict() returned; or, from FSDP2 ranks, a state without the optimizer whose
        sharded optimizer state is in the folder `state["optimizer_dir"]` (CheckpointManager)."""
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            from sleuth.train.sharded import load_checkpoint

            load_checkpoint(state["optimizer_dir"], self.policy, self)
        self.scheduler.load_state_dict(state["scheduler"])
        self.step_count = int(state["step_count"])
        self.self_checked = bool(state.get("self_checked", True))

    # ------------------------------------------------------------------ the step

    def step(self, groups: list[Group], on_row: Callable[[int, int], None] | None = None) -> dict[str, float]:
        """One iteration's update over all groups: epochs_per_iteration passes of one optimizer
        step per mini-batch.

        `on_row(done, total)` is called after each packed row's backward pass (for a progress bar;
        total = rows x epochs).

        Returns METRIC_KEYS (loss, clip fractions and grad norm averaged over the optimizer steps;
        kl, entropy and TIS statistics as token means of the first pass; kl is 0 when kl_beta is 0,
        where it is not computed), plus self_check_max_diff / self_check_mean_diff on the step that
        ran it. An empty list (every group dropped) makes no update and returns skipped=1.
        """
        start = time.perf_counter()
        self.step_count += 1
        if not groups:  # every group was dropped (all-zero advantages): nothing to learn from
            empty = dict.fromkeys(METRIC_KEYS, 0.0)
            empty.update({"skipped": 1.0, "lr": self.scheduler.get_last_lr()[0],
                          "peak_mem_gb": peak_memory_gb(self.policy.device)})
            return empty
        parts = split_mini_batches(groups, self.cfg.mini_batches)
        batches = [self.pack(part) for part in parts]
        metrics: dict[str, float] = {}
        if not self.self_checked:
            metrics.update(self.self_check(parts[0], batches[0]))
            self.self_checked = True
        caches = [_PassCache() for _ in batches]
        epochs = self.cfg.epochs_per_iteration
        n_rows = sum(len(b.rows) for b in batches)
        n_tok = sum(b.n_completion_tokens for b in batches)
        acc = dict.fromkeys(("loss", "clip_frac_low", "clip_frac_high", "grad_norm"), 0.0)
        first = dict.fromkeys(("kl", "entropy", "tis_weight_mean", "tis_capped_frac"), 0.0)
        skipped = done = 0
        for epoch in range(epochs):
            for batch, cache in zip(batches, caches, strict=True):
                self.optimizer.zero_grad(set_to_none=True)
                stats = self._pass(batch, cache, first=epoch == 0,
                                   on_row=None if on_row is None else
                                   lambda r, done=done: on_row(done + r, epochs * n_rows))
                done += len(batch.rows)
                finite = math.isfinite(stats["loss"])
                grad_norm = self._clip_grad_norm() if finite else math.nan
                if finite and math.isfinite(grad_norm):
                    self.optimizer.step()
                    self.scheduler.step()
                else:  # a non-finite loss or gradient: no update, counted in the metrics
                    skipped += 1
                self.optimizer.zero_grad(set_to_none=True)
                for key in ("loss", "clip_frac_low", "clip_frac_high"):
                    acc[key] += stats[key]
                acc["grad_norm"] += grad_norm
                if epoch == 0:  # token means of the mini-batch -> of the whole batch
                    for key in first:
                        first[key] += stats[key] * batch.n_completion_tokens / n_tok
        updates = epochs * len(batches)
        elapsed = time.perf_counter() - start
        metrics.update(first)
        metrics.update({k: v / updates for k, v in acc.items()})
        metrics.update(self._throughput(batches, elapsed, epochs, self.algo.kl_beta > 0))
        metrics.update({
            "skipped": float(skipped), "rows": float(n_rows), "sequences": float(sum(b.n_seqs for b in batches)),
            "completion_tokens": float(n_tok), "lr": self.scheduler.get_last_lr()[0], "step_time_s": elapsed,
        })
        return metrics

    def pack(self, groups: list[Group]) -> PackedBatch:
        """The groups packed into rows as this model trains on them (one sequence per row for a
        model whose layers a packed mask cannot scope, see one_per_row)."""
        return pack_groups(groups, self.cfg.row_tokens, pad_to_multiple=self._pad_multiple(),
                           one_per_row=self.one_per_row)

    def loss_and_gradients(self, groups: list[Group]) -> float:
        """One pass over the packed groups leaving gradients in .grad (no optimizer step).

        The same computation as the first epoch of step(); for tests and debugging.
        """
        batch = self.pack(groups)
        self.optimizer.zero_grad(set_to_none=True)
        return self._pass(batch, _PassCache(), first=True)["loss"]

    # ------------------------------------------------------------------ hooks of a sharded trainer

    def _micro_rows(self, batch: PackedBatch) -> list[PackedRow | None]:
        """The rows this process runs, in order; None is an empty micro-step (see fsdp.py)."""
        return list(batch.rows)

    def _empty_row(self) -> PackedRow:
        raise NotImplementedError("a single-process trainer runs no empty micro-steps")

    def _reduce_sums(self, values: list[float]) -> list[float]:
        """Sums over the processes sharing the step (this one alone here)."""
        return values

    def _clip_grad_norm(self) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip))

    def _check_rows(self, batch: PackedBatch) -> list[PackedRow]:
        """The rows the packed-vs-naive self-check picks from."""
        return batch.rows

    def _pad_multiple(self) -> int:
        # flex_attention works in 128-token blocks; padding rows to them avoids recompilation.
        return 128 if self.policy.attn_backend == "flex_attention" else 1

    def _pass(self, batch: PackedBatch, cache: _PassCache, first: bool,
              on_row: Callable[[int], None] | None = None) -> dict[str, float]:
        """Forward + backward over every row, accumulating gradients.

        A non-finite loss stops the pass (a sharded trainer runs on with NaN: every rank must make
        the same collective calls, and the NaN loss skips the update on all of them). An empty
        micro-step (row None) runs a tiny row with zero weight: it adds nothing but joins the collectives.
        """
        policy, algo = self.policy, self.algo
        beta = algo.kl_beta
        seq_weight = aggregation_weights(batch.seq_lengths, algo.aggregation, self.max_tokens).to(policy.device)
        n_tok = batch.n_completion_tokens
        sums = dict.fromkeys(("kl", "entropy", "tis_weight_mean", "tis_capped_frac"), 0.0)
        loss_sum, low, high, done = 0.0, 0, 0, 0
        for r, micro_row in enumerate(self._micro_rows(batch)):
            row = self._empty_row() if micro_row is None else micro_row
            logp, entropy = policy.row_logprobs(row, entropy_grad=algo.entropy_coef > 0)
            dev = logp.device
            if first:
                cache.old.append(logp.detach())
                if beta > 0:
                    cache.ref.append(policy.reference_logprobs(row))
            old = cache.old[r]
            token_seq = row.token_seq.to(dev)
            tis = tis_weights(old, row.engine_logprobs.to(dev), algo.tis_cap)
            if row.guided is not None:  # off-policy guidance: no weight towards the constraint that drew it
                tis = tis.masked_fill(row.guided.to(dev), 1.0)
            pl = self.loss_fn(logp, old, row.advantages.to(dev), token_seq, algo.clip_low, algo.clip_high)
            token_loss = pl.token_loss * tis
            if algo.entropy_coef > 0:  # a bonus: higher entropy, lower loss
                token_loss = token_loss - algo.entropy_coef * entropy
            if beta > 0:
                kl = k3_kl(logp, cache.ref[r])
                token_loss = token_loss + beta * kl
                kl_sum = float(kl.detach().sum())
            row_loss = (seq_weight[token_seq] * token_loss).sum()
            if micro_row is None:
                (row_loss * 0.0).backward()
                continue
            if not torch.isfinite(row_loss):
                loss_sum = math.nan
                if self.world_size == 1:
                    break
            row_loss.backward()
            if beta > 0:
                sums["kl"] += kl_sum
            loss_sum += float(row_loss.detach())
            low += int(pl.clipped_low.sum())
            high += int(pl.clipped_high.sum())
            sums["entropy"] += float(entropy.detach().sum())
            sums["tis_weight_mean"] += float(tis.sum())
            if algo.tis_cap is not None:
                sums["tis_capped_frac"] += float((tis >= algo.tis_cap).sum())
            done += 1
            if on_row is not None:
                on_row(done)
        keys = list(sums)
        totals = self._reduce_sums([loss_sum, float(low), float(high), *sums.values()])
        loss_sum, low, high = totals[0], totals[1], totals[2]
        sums = dict(zip(keys, totals[3:]))
        out = {k: v / n_tok for k, v in sums.items()}
        out.update({"loss": loss_sum, "clip_frac_low": low / n_tok, "clip_frac_high": high / n_tok})
        return out

    def _throughput(self, batches: list[PackedBatch], elapsed: float, epochs: int, with_ref: bool) -> dict[str, float]:
        dev = self.policy.device
        if self.peak_flops is None:
            self.peak_flops = measure_matmul_flops(self.policy.compute_dtype, dev, n=512) * self.world_size
        n_tokens = sum(b.n_tokens for b in batches)
        n_completion = sum(b.n_completion_tokens for b in batches)
        # 6 FLOPs per parameter and token for forward + backward; the reference adds a forward (2).
        per_token = 6 + (2 if with_ref else 0)
        flops = per_token * (self._body_params * n_tokens + self._head_params * n_completion)
        flops *= epochs
        return {
            "tokens": float(n_tokens),
            "tokens_per_s": n_tokens * epochs / elapsed,
            "mfu": flops / elapsed / self.peak_flops,
            "peak_mem_gb": peak_memory_gb(dev),
        }

    # ------------------------------------------------------------------ self-check

    @torch.no_grad()
    def self_check(self, groups: list[Group], batch: PackedBatch) -> dict[str, float]:
        """Compare packed and naive logprobs on a small slice; raise SelfCheckError on mismatch.

        The slice is the first and last sequence of the row with the deepest prefix tree (then the
        most sequences; among `_check_rows`: rank 0's with FSDP2), and the sequence with the longest
        path through it, so a kernel that keeps causality but ignores the packed mask (or one branch
        of a tree) is caught too.
        """
        policy = self.policy
        row = max(self._check_rows(batch),
                  key=lambda r: (max(pl.depth for pl in r.placements), len(r.placements)))
        deepest = max(row.placements, key=lambda pl: pl.depth)
        was_training = policy.model.training
        policy.model.eval()
        try:
            # The raw model on both sides: the check is about attention over the packed rows, and
            # naive_logprobs knows no grammar (structured output's token_bitmask).
            packed, _ = policy.row_logprobs(replace(row, token_bitmask=None))
            diffs = []
            chosen = {pl.seq: pl for pl in (row.placements[0], deepest, row.placements[-1])}
            offsets = {}
            n = 0
            for pl in row.placements:
                offsets[pl.seq] = n
                n += pl.n_targets
            for seq, pl in chosen.items():
                group = groups[pl.group]
                comp = group.completions[pl.completion]
                naive = policy.naive_logprobs(prompt_of(group, comp), comp.completion_ids)
                sampled = torch.tensor(loss_mask(comp), dtype=torch.bool, device=naive.device)
                diffs.append((packed[offsets[seq] : offsets[seq] + pl.n_targets] - naive[sampled]).abs().float())
        finally:
            policy.model.train(was_training)
        diff = torch.cat(diffs)
        max_tol, mean_tol = SELF_CHECK_TOL.get(policy.compute_dtype, SELF_CHECK_TOL[torch.bfloat16])
        if policy.model_cfg.quantization != "none":
            max_tol, mean_tol = SELF_CHECK_TOL_QUANTIZED
        max_diff, mean_diff = float(diff.max()), float(diff.mean())
        if not (max_diff <= max_tol and mean_diff <= mean_tol):
            raise SelfCheckError(
                f"packed-sequence self-check failed: logprobs differ from separate sequences by up to "
                f"{max_diff:.3g} (mean {mean_diff:.3g}) with attn_implementation="
                f"'{policy.attn_backend}'; this model's attention ignores the packed mask "
                f"(use sdpa on CPU, flex_attention on CUDA) or its output head is not a plain linear layer"
            )
        return {"self_check_max_diff": max_diff, "self_check_mean_diff": mean_diff}
