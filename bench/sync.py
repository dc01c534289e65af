"""Weight-sync benchmark: adapter-only vs full weights, SmolLM2-135M-Instruct with LoRA r=16.

    .venv/bin/python bench/sync.py [--engine vllm|hf] [--reps 3]

For each path it builds the engine the loop would (vLLM: rollout.native_lora on for the adapter
path, off for the full path; hf: the same engine does both), moves the policy's LoRA B away from
zero (a trained adapter), and times sleuth.sync.WeightSync.push() `reps` times. It checks that the
engine then generates what the trainer's merged weights predict (greedy tokens equal across paths).
Prints a table and one `name=value` line.
"""

from __future__ import annotations

import argparse
import os
import statistics

if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch

from sleuth.config import LoraConfig, ModelConfig, RolloutConfig
from sleuth.hardware import cpu_description
from sleuth.models import SMOLLM2_ALIAS, resolve_model_path
from sleuth.records import SamplingParams
from sleuth.rollout.base import GenerationRequest
from sleuth.rollout.factory import make_engine
from sleuth.sync import WeightSync
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


def run_path(engine_kind: str, mode: str, folder: str, policy: Policy, reps: int) -> tuple[list[float], int, list[int]]:
    cfg = RolloutConfig(engine=engine_kind, native_lora=mode == "adapter", kv_cache_gb=0.5, max_model_len=1024)
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
        return times, moved, out[0].samples[0].token_ids
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default=SMOLLM2_ALIAS, help="a model folder or alias (a tiny one for a smoke run)")
    a = ap.parse_args()
    print(f"# cpu: {cpu_description()}", flush=True)
    folder = str(resolve_model_path(a.model))
    policy = trained_policy(folder)
    rows, tokens = {}, {}
    for mode in ("full", "adapter"):
        times, moved, tokens[mode] = run_path(a.engine, mode, folder, policy, a.reps)
        rows[mode] = (statistics.median(times), min(times), moved)
    print(f"{a.model} float32, LoRA r=16 all-linear, engine {a.engine}, {a.reps} syncs per path")
    print("| path | bytes moved | median s | best s |")
    print("|---|---|---|---|")
    for mode, (med, best, moved) in rows.items():
        print(f"| {mode} | {moved / 1e6:.1f} MB | {med:.3f} | {best:.3f} |")
    same = tokens["full"] == tokens["adapter"]
    print(f"greedy tokens after sync equal across paths: {same}")
    print(f"full_s={rows['full'][0]:.3f} adapter_s={rows['adapter'][0]:.3f} "
          f"full_mb={rows['full'][2] / 1e6:.1f} adapter_mb={rows['adapter'][2] / 1e6:.2f} same_tokens={int(same)}")


if __name__ == "__main__":
    main()
