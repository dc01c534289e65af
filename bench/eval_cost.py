"""Where a held-out evaluation's time goes: prefill and decode of the main job's held-out puzzles
on the vLLM engine, against this CPU's matmul and memory bounds.

    .venv/bin/python bench/eval_cost.py [--problems 48] [--model smollm2-135m-instruct | RUN_DIR] [--kv-cache-gb G] [--smoke]

The held-out puzzles of the `temporal_clue` recipe (its rung, listed choices, deduce prompts), as
`sleuth eval` sends them: one greedy sample each, the recipe's rollout.kv_cache_gb and max_tokens,
model.dtype auto. Three timed passes on one engine, after an untimed warm-up on other puzzles:

1. prefill: every prompt with max_tokens=1 (what a held-out evaluation prefills; puzzles share only
   their opening lines, which the prefix cache serves only where they fill a whole KV block: its
   hit rate printed);
2. decode: the same prompts again with the recipe's max_tokens. Their prompts are now in the prefix
   cache, so this pass is (almost) decode alone;
3. the bounds: a 1024 x 1024 x 1024 matmul in the engine's dtype (the trainer's mfu reference,
   train.optim.measure_matmul_flops), the rate a forward pass made of matmuls could reach on this
   CPU; and the memory bandwidth of a 256 MiB tensor copy (bytes read + written per second).

A prompt token costs ~2 x (parameters outside the embedding) FLOPs plus attention (4 x layers x
hidden x its position); a decoded token ~2 x all parameters (the output head too) plus the same
attention, and it reads the KV cache of its whole context (2 x layers x KV heads x head size x the
cache's bytes per value, per position), which at these batch sizes is more bytes than the weights
a decoding step reads once for the batch. Prints a table and one `name=value` line: prefill and
decode tokens/s, prefill GFLOP/s as a fraction of the matmul bound, decode's KV-cache reads as a
fraction of the copy bandwidth, and the estimated seconds of a 200-puzzle evaluation.
--smoke: the tiny model, 4 puzzles, 8 new tokens (figures mean nothing).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

from _smoke import add_smoke_flag, tiny_model_folder
from sleuth.cli.train import recipes
from sleuth.config import load_config
from sleuth.records import SamplingParams
from sleuth.rollout.base import GenerationRequest
from sleuth.system.hardware import cpu_description, resolve_dtype
from sleuth.system.models import SMOLLM2_ALIAS, encode_chat, load_tokenizer, model_config, resolve_model_path
from sleuth.tasks.registry import build_task
from sleuth.train.optim import measure_matmul_flops

WARMUP = 4
"""Puzzles of the warm-up pass (after the timed ones in the held-out list, so none is cached)."""


def copy_gbs(seconds: float = 2.0) -> float:
    """GB/s (read + written) of copying a 256 MiB float32 tensor into another."""
    a, b = torch.randn(64 << 20), torch.empty(64 << 20)
    b.copy_(a)
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        b.copy_(a)
        n += 1
    return 2 * a.numel() * 4 * n / elapsed / 1e9


def timed(engine, prompts: list[list[int]], max_tokens: int, tag: str) -> tuple[float, int, dict[str, float]]:
    """Seconds, generated tokens and the engine's counter deltas for one greedy sample per prompt."""
    before = engine.stats()
    reqs = [GenerationRequest(p, 1, SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=0), f"{tag}{i}")
            for i, p in enumerate(prompts)]
    start = time.perf_counter()
    results = engine.generate_all(reqs)
    seconds = time.perf_counter() - start
    after = engine.stats()
    delta = {k: after[k] - before.get(k, 0.0) for k in ("prefix_hits", "prefix_queries")}
    return seconds, sum(len(s.token_ids) for r in results for s in r.samples), delta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", type=int, default=48, help="held-out puzzles timed (at most 196)")
    ap.add_argument("--model", default=SMOLLM2_ALIAS, help="a model folder, run directory or alias")
    ap.add_argument("--kv-cache-gb", type=float, default=None, help="rollout.kv_cache_gb (default: the recipe's)")
    add_smoke_flag(ap)
    a = ap.parse_args()
    if not 1 <= a.problems <= 200 - WARMUP:
        ap.error(f"--problems must be between 1 and {200 - WARMUP}")
    if a.kv_cache_gb is not None and not (a.kv_cache_gb > 0 and math.isfinite(a.kv_cache_gb)):
        ap.error("--kv-cache-gb must be a finite number above 0")
    cfg = load_config(recipes()["temporal_clue"],
                      [] if a.kv_cache_gb is None else [f"rollout.kv_cache_gb={a.kv_cache_gb}"])
    max_tokens = cfg.rollout.max_tokens
    if a.smoke:
        a.model, a.problems, max_tokens = tiny_model_folder(), 4, 8
    print(f"# cpu: {cpu_description()}; torch threads {torch.get_num_threads()}", flush=True)
    folder = str(resolve_model_path(a.model))
    dtype = resolve_dtype(cfg.model.dtype)
    problems = build_task(cfg.task).eval_problems()
    tokenizer = load_tokenizer(folder)
    prompts = [encode_chat(tokenizer, p.messages) for p in problems[: a.problems + WARMUP]]
    timed_prompts, warmup = prompts[: a.problems], prompts[a.problems:]

    from sleuth.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(folder, dtype=dtype, seed=0, kv_cache_gb=cfg.rollout.kv_cache_gb, enforce_eager=True)
    try:
        timed(engine, warmup, max_tokens, "warm-up ")
        prefill_s, _, hits = timed(engine, timed_prompts, 1, "prefill ")
        decode_s, generated, _ = timed(engine, timed_prompts, max_tokens, "decode ")
    finally:
        engine.close()

    mc = model_config(Path(folder))
    hidden, layers = mc.hidden_size, mc.num_hidden_layers
    embed = mc.vocab_size * hidden
    params = sum(p.numel() for p in _meta_model(mc).parameters())
    body = params - embed * (1 if getattr(mc, "tie_word_embeddings", False) else 2)
    prompt_tokens = sum(map(len, timed_prompts))
    mean_len = prompt_tokens / len(timed_prompts)
    attention = 4 * layers * hidden  # FLOPs per token per position attended
    prefill_flops = prompt_tokens * (2 * body + attention * mean_len / 2)
    decode_context = mean_len + generated / len(timed_prompts) / 2  # mean positions a decoded token attends
    decode_flops = generated * (2 * (body + embed) + attention * decode_context)
    head_size = getattr(mc, "head_dim", None) or hidden // mc.num_attention_heads
    kv_per_position = 2 * layers * mc.num_key_value_heads * head_size * torch.finfo(getattr(torch, dtype)).bits // 8
    decode_kv_bytes = generated * kv_per_position * decode_context
    bound, bandwidth = measure_matmul_flops(getattr(torch, dtype), "cpu", n=1024) / 1e9, copy_gbs()
    prefill_gflops, decode_gflops = prefill_flops / prefill_s / 1e9, decode_flops / decode_s / 1e9
    decode_gbs = decode_kv_bytes / decode_s / 1e9
    eval200 = (prefill_s + decode_s) * 200 / len(timed_prompts)
    hit_rate = hits["prefix_hits"] / max(1.0, hits["prefix_queries"])
    print(f"{a.model} {dtype}, {len(timed_prompts)} held-out puzzles at {cfg.task.temporal_clue.difficulty}, "
          f"mean prompt {mean_len:.0f} tokens, {generated / len(timed_prompts):.0f} new tokens each (max "
          f"{max_tokens}), kv cache {cfg.rollout.kv_cache_gb} GiB, load {os.getloadavg()[0]:.1f}")
    print("| pass | tokens | seconds | tokens/s | GFLOP/s | of the matmul bound | KV cache read GB/s "
          "| of the copy bandwidth | notes |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| prefill | {prompt_tokens} | {prefill_s:.1f} | {prompt_tokens / prefill_s:.0f} | {prefill_gflops:.1f} | "
          f"{prefill_gflops / bound:.2f} | | | prefix cache hit rate {hit_rate:.2f} |")
    print(f"| decode | {generated} | {decode_s:.1f} | {generated / decode_s:.0f} | {decode_gflops:.1f} | "
          f"{decode_gflops / bound:.2f} | {decode_gbs:.2f} | {decode_gbs / bandwidth:.2f} | prompts cached; "
          f"{kv_per_position / 1024:.0f} KiB of KV cache per position |")
    print(f"| bounds | | | | {bound:.1f} | 1.00 | {bandwidth:.2f} | 1.00 | a 1024 x 1024 x 1024 matmul in {dtype} "
          f"(train.optim.measure_matmul_flops, as the trainer's mfu); a 256 MiB copy |")
    print(f"prefill_tok_s={prompt_tokens / prefill_s:.1f} prefill_of_bound={prefill_gflops / bound:.3f} "
          f"decode_tok_s={generated / decode_s:.1f} decode_of_bound={decode_gbs / bandwidth:.3f} "
          f"eval200_s={eval200:.0f}")


def _meta_model(mc) -> torch.nn.Module:
    """The model built on the meta device (parameter count without memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(mc)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # the table alone on stdout
    sys.exit(main())
