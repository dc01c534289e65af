"""Weight-sync benchmark: adapter-only vs full weights, SmolLM2-135M-Instruct with LoRA r=16.

    .venv/bin/python bench/sync.py [--engine vllm|hf] [--reps 3] [--smoke]

For each path it builds the engine the loop would (vLLM: rollout.native_lora on for the adapter
path, off for the full path; hf: the same engine does both), moves the policy's LoRA B away from
zero (a trained adapter), and times sleuth.rollout.sync.WeightSync.push() `reps` times. It checks that the
engine then generates what the trainer's merged weights predict (greedy tokens equal across paths),
and times one default-sized rollout on that engine (4 prompts of 830 random token ids x 8 samples x
64 tokens at temperature 0.7, seeded): serving the adapter (vLLM's LoRA layers) may cost more per
generated token than merged weights, which is what decides the default path.
Prints a table and one `name=value` line. --smoke: the tiny model, one sync per path, a rollout of a
tenth of the prompt and 8 new tokens (vLLM where installed, else --engine hf).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch

from _smoke import add_smoke_flag, tiny_model_folder
from sleuth.config import LoraConfig, ModelConfig, RolloutConfig
from sleuth.records import SamplingParams
from sleuth.rollout.base import GenerationRequest
from sleuth.rollout.factory import make_engine
from sleuth.rollout.sync import WeightSync
from sleuth.system.hardware import cpu_description
from sleuth.system.models import SMOLLM2_ALIAS, resolve_model_path
from sleuth.train.policy import Policy


def trained_policy(folder: str) -> Policy:
    cfg = ModelConfig(path=folder, dtype="float32", lora=LoraConfig(enabled=True, rank=16, alpha=32.0))
    policy = Policy.from_config(cfg, need_reference=False, device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.add_(0.002 * torch.randn(p.shape, generator=gen))
    return policy


def rollout_seconds(engine: object, vocab: int, prompt: int = 830, max_tokens: int = 64) -> tuple[float, int]:
    """Seconds and sampled tokens of one default-sized rollout (see the module doc)."""
    gen = torch.Generator().manual_seed(1)
    reqs = [GenerationRequest(torch.randint(100, vocab, (prompt,), generator=gen).tolist(), 8,
                              SamplingParams(temperature=0.7, max_tokens=max_tokens, seed=10 + j), f"g{j}")
            for j in range(4)]
    start = time.perf_counter()
    out = engine.generate_all(reqs)  # type: ignore[attr-defined]
    return time.perf_counter() - start, sum(len(s.token_ids) for r in out for s in r.samples)


def run_path(engine_kind: str, mode: str, folder: str, policy: Policy, reps: int,
             smoke: bool = False) -> tuple[list[float], int, list[int], tuple[float, int]]:
    cfg = RolloutConfig(engine=engine_kind, native_lora=mode == "adapter", kv_cache_gb=1.0, max_model_len=1024)
    engine = make_engine(cfg, folder, "float32", seed=0)
    try:
        sync = WeightSync(policy, engine, mode=mode)  # type: ignore[arg-type]
        times, moved = [], 0
        for _ in range(reps):
            stats = sync.push()
            times.append(stats.seconds)
            moved = stats.bytes
        ids = policy.tokenizer("The capital of France is")["input_ids"]
        out = engine.generate_all([GenerationRequest(ids, 1, SamplingParams(temperature=0.0, max_tokens=12))])
        vocab = policy.causal_lm.config.vocab_size
        rollout = rollout_seconds(engine, vocab, 83, 8) if smoke else rollout_seconds(engine, vocab)
        return times, moved, out[0].samples[0].token_ids, rollout
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default=SMOLLM2_ALIAS, help="a model folder or alias")
    add_smoke_flag(ap)
    a = ap.parse_args()
    if a.smoke:
        from sleuth.rollout.factory import vllm_available

        a.model, a.reps = tiny_model_folder(), 1
        a.engine = a.engine if vllm_available() else "hf"
    print(f"# cpu: {cpu_description()}", flush=True)
    folder = str(resolve_model_path(a.model))
    policy = trained_policy(folder)
    rows, tokens, rollouts = {}, {}, {}
    for mode in ("full", "adapter"):
        times, moved, tokens[mode], rollouts[mode] = run_path(a.engine, mode, folder, policy, a.reps, a.smoke)
        rows[mode] = (statistics.median(times), min(times), moved)
    print(f"{a.model} float32, LoRA r=16 all-linear, engine {a.engine}, {a.reps} syncs per path")
    print("| path | bytes moved | sync median s | sync best s | rollout s (tokens) | sync + rollout s |")
    print("|---|---|---|---|---|---|")
    for mode, (med, best, moved) in rows.items():
        gen_s, gen_tokens = rollouts[mode]
        print(f"| {mode} | {moved / 1e6:.1f} MB | {med:.3f} | {best:.3f} | {gen_s:.1f} ({gen_tokens}) | {med + gen_s:.1f} |")
    same = tokens["full"] == tokens["adapter"]
    print(f"greedy tokens after sync equal across paths: {same}")
    print(f"full_s={rows['full'][0]:.3f} adapter_s={rows['adapter'][0]:.3f} "
          f"full_mb={rows['full'][2] / 1e6:.1f} adapter_mb={rows['adapter'][2] / 1e6:.2f} same_tokens={int(same)} "
          f"rollout_full_s={rollouts['full'][0]:.1f} rollout_adapter_s={rollouts['adapter'][0]:.1f}")


if __name__ == "__main__":
    main()
