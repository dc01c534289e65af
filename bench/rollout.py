"""Rollout throughput: vLLM engine vs our transformers engine vs plain `generate`, one run.

    .venv/bin/python bench/rollout.py [--prompts 8 --n 8 --max-tokens 128 --naive-prompts 2] [--smoke]

SmolLM2-135M-Instruct (bf16), 8 chat prompts of ~600 tokens x 8 samples x 128 new tokens,
temperature 1. Tokens/s counts generated tokens (up to and including EOS) over wall time.
Each engine runs the workload once untimed first (CPU kernels are built per shape on first use).
Plain `model.generate(num_return_sequences=8)` runs one prompt at a time (that is its interface);
it is timed on the first --naive-prompts prompts only, since its rate per prompt does not depend
on how many prompts follow. The logprob columns compare each engine's sampled-token logprobs with
a transformers forward of the same tokens (the trainer's computation: bf16 weights, fp32 logits).
Targets: ours >= 2x plain generate; vLLM >= ours. --smoke: every engine on the tiny model, 2 prompts of
~60 tokens x 2 samples x 8 new tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from _smoke import add_smoke_flag, tiny_model_folder
from sleuth.records import SamplingParams
from sleuth.rollout.base import GenerationRequest, GenerationResult
from sleuth.rollout.factory import vllm_available
from sleuth.rollout.hf_engine import HFEngine
from sleuth.system.hardware import cpu_description, cpu_dtype
from sleuth.system.models import (
    SMOLLM2_ALIAS,
    encode_chat,
    load_causal_lm,
    load_tokenizer,
    resolve_model_path,
)

TOPICS = ["a lighthouse keeper", "a chess tournament", "a bakery at dawn", "a museum robbery",
          "a mountain rescue", "a space station", "a village election", "a lost violin"]


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_prompts(tokenizer, count: int, target: int = 600) -> list[list[int]]:
    prompts = []
    for i in range(count):
        lines = [f"Here are notes about {TOPICS[i % len(TOPICS)]}."]
        k = 0
        while True:
            lines.append(f"Note {k}: at {7 + k % 12}:{(13 * k + i) % 60:02d} the witness number {k + i} saw "
                         f"someone carrying a {['lamp', 'box', 'rope', 'map', 'key'][(k + i) % 5]} near "
                         f"the {['door', 'stairs', 'garden', 'hall'][(k * 3 + i) % 4]}.")
            ids = encode_chat(tokenizer, [{"role": "user", "content": "\n".join(lines)
                                           + "\nWho is the most likely suspect? Think step by step."}])
            if len(ids) >= target:
                prompts.append(ids)
                break
            k += 1
    return prompts


def tokens(results: list[GenerationResult]) -> int:
    return sum(len(s.token_ids) for r in results for s in r.samples)


@torch.no_grad()
def logprob_mad(model, results: list[GenerationResult], groups: int) -> float:
    """Mean |engine logprob - trainer logprob| over the sampled tokens of the first `groups` groups."""
    diffs = []
    for r in results[:groups]:
        for s in r.samples:
            ids = torch.tensor([r.request.prompt_ids + s.token_ids])
            logits = model(ids).logits[0, len(r.request.prompt_ids) - 1 : -1].float()
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0]
            diffs.append((ref - torch.tensor(s.logprobs)).abs())
    return float(torch.cat(diffs).mean())


def naive_generate(model, tokenizer, prompts: list[list[int]], n: int, max_tokens: int) -> tuple[int, float]:
    eos = tokenizer.eos_token_id
    total, start = 0, time.perf_counter()
    for i, p in enumerate(prompts):
        torch.manual_seed(i)
        ids = torch.tensor([p])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                             top_p=1.0, top_k=0, max_new_tokens=max_tokens, num_return_sequences=n,
                             pad_token_id=tokenizer.pad_token_id)
        for row in out[:, len(p):].tolist():
            total += row.index(eos) + 1 if eos in row else len(row)
    return total, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=600)
    ap.add_argument("--naive-prompts", type=int, default=2)
    ap.add_argument("--mad-groups", type=int, default=2, help="groups per engine in the logprob comparison")
    ap.add_argument("--vllm-compile", action="store_true", help="let vLLM compile the model (slower start)")
    ap.add_argument("--model", default=SMOLLM2_ALIAS, help="a model folder or alias")
    add_smoke_flag(ap)
    a = ap.parse_args()
    if a.smoke:
        a.model, a.prompts, a.n, a.max_tokens, a.prompt_tokens = tiny_model_folder(), 2, 2, 8, 60
        a.naive_prompts, a.mad_groups = 1, 1
    print(f"# cpu: {cpu_description()}", flush=True)
    dtype = cpu_dtype("bfloat16")  # bf16 only where this CPU accelerates it

    folder = str(resolve_model_path(a.model))
    tokenizer = load_tokenizer(folder)
    prompts = make_prompts(tokenizer, a.prompts, a.prompt_tokens)
    requests = [GenerationRequest(p, a.n, SamplingParams(temperature=1.0, max_tokens=a.max_tokens, seed=i), f"p{i}")
                for i, p in enumerate(prompts)]
    # Each engine first runs the same workload untimed: on CPU, oneDNN builds its kernels per shape
    # on first use (a cold run of our engine measured 3.6x slower than the warm one), and an RL run
    # is warm after its first iteration.
    warmup = [GenerationRequest(r.prompt_ids, r.n, SamplingParams(temperature=1.0, max_tokens=a.max_tokens,
                                                                 seed=1000 + i), f"warm-up {i}")
              for i, r in enumerate(requests)]
    mean_prompt = sum(map(len, prompts)) / len(prompts)
    rows: list[tuple[str, int, float, str]] = []
    trainer = load_causal_lm(folder, dtype).eval()

    progress("transformers engine")
    hf = HFEngine(trainer, tokenizer, model_path=folder, max_rows=a.prompts * a.n)
    hf.generate_all(warmup)
    t = time.perf_counter()
    hf_results = hf.generate_all(requests)
    hf_s = time.perf_counter() - t
    hf_tok = tokens(hf_results)
    hf.close()
    rows.append(("ours (transformers, prefill once per group)", hf_tok, hf_s, f"{hf.stats()['batches']:.0f} batches"))
    progress(f"ours: {hf_tok} tokens in {hf_s:.1f} s; logprob check")
    hf_mad = logprob_mad(trainer, hf_results, a.mad_groups)
    progress("plain generate")

    naive_generate(trainer, tokenizer, prompts[: a.naive_prompts], a.n, a.max_tokens)  # warm-up
    naive_tok, naive_s = naive_generate(trainer, tokenizer, prompts[: a.naive_prompts], a.n, a.max_tokens)
    rows.append((f"plain generate(num_return_sequences={a.n}), {a.naive_prompts} prompts", naive_tok, naive_s, ""))

    vllm_tok_s = vllm_mad = float("nan")
    if vllm_available():
        from sleuth.rollout.vllm_engine import VLLMEngine

        progress(f"plain generate: {naive_tok} tokens in {naive_s:.1f} s; vLLM start-up")
        t = time.perf_counter()
        vl = VLLMEngine(folder, dtype=dtype, seed=0, kv_cache_gb=2.0, enforce_eager=not a.vllm_compile)
        start_s = time.perf_counter() - t
        vl.generate_all(warmup)
        t = time.perf_counter()
        vl_results = vl.generate_all(requests)
        vl_s = time.perf_counter() - t
        st = vl.stats()
        vl.close()
        vl_tok = tokens(vl_results)
        vllm_tok_s = vl_tok / vl_s
        rows.append(("vLLM engine (in-process, prefix caching)", vl_tok, vl_s,
                     f"start-up {start_s:.0f} s, preemptions {st['preemptions']:.0f}, "
                     f"prefix hit rate {st['prefix_hit_rate']:.2f}, peak in flight {st['peak_in_flight']:.0f}"))
        progress(f"vLLM: {vl_tok} tokens in {vl_s:.1f} s; logprob check")
        vllm_mad = logprob_mad(trainer, vl_results, a.mad_groups)

    print(f"{a.model} {dtype}, {a.prompts} prompts x {a.n} samples x {a.max_tokens} max new tokens, "
          f"mean prompt {mean_prompt:.0f} tokens, torch threads {torch.get_num_threads()}, "
          f"cpus {os.cpu_count()}, load {os.getloadavg()[0]:.1f}")
    print("| engine | tokens | seconds | tokens/s | notes |")
    print("|---|---|---|---|---|")
    for name, tok, sec, note in rows:
        print(f"| {name} | {tok} | {sec:.1f} | {tok / sec:.1f} | {note} |")
    print(f"| logprob MAD vs trainer forward ({a.mad_groups} groups) | | | | vLLM {vllm_mad:.4f}, ours {hf_mad:.4f} |")
    hf_tok_s, naive_tok_s = hf_tok / hf_s, naive_tok / naive_s
    print(f"vllm_tok_s={vllm_tok_s:.1f} hf_tok_s={hf_tok_s:.1f} naive_tok_s={naive_tok_s:.1f} "
          f"hf_vs_naive={hf_tok_s / naive_tok_s:.2f} vllm_logprob_mad={vllm_mad:.4f} hf_logprob_mad={hf_mad:.4f}")


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # the table alone on stdout
    main()
