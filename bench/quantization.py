"""LoRA on a quantized base (model.quantization): weight memory, train step time, self-check difference.

    .venv/bin/python bench/quantization.py [--model smollm2-135m-instruct] [--random HIDDEN,LAYERS]
                                           [--modes none,int8,nf4] [--groups 2] [--no-step] [--smoke]

For each mode: resident weight memory of the loaded model (transformers' get_memory_footprint)
against the same model loaded in bf16, the trainer's step time on a fixed batch (groups x 8
completions, prompt 200 tokens, completions 64 tokens, random token ids, LoRA r=16, compute in
float32), and the first step's packed-vs-separate self-check logprob difference (max, mean).
--random H,L adds a random-init Llama of hidden size H and L layers (written to a temp folder).
Ends with one line `name=value ...` of the 4-bit memory ratios. --smoke: every mode on the tiny model
(its ratios keep the `smollm2_` names), one group.
"""

from __future__ import annotations

import argparse
import gc
import random
import tempfile
import time

import torch

from _smoke import add_smoke_flag, tiny_model_folder
from sleuth.config import LoraConfig, ModelConfig, TrainerConfig
from sleuth.records import Completion, Group, Problem
from sleuth.system.hardware import cpu_description
from sleuth.train.policy import Policy, load_base_model
from sleuth.train.step import Trainer


def make_groups(n_groups: int, vocab: int, seed: int = 0) -> list[Group]:
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        prompt = [rng.randrange(vocab) for _ in range(200)]
        comps = [Completion(prompt, ids, [-rng.uniform(5, 12) for _ in ids], "length", "")
                 for ids in ([rng.randrange(vocab) for _ in range(64)] for _ in range(8))]
        groups.append(Group(Problem(f"g{g}", [], None), prompt, comps, [rng.uniform(-1, 1) for _ in comps]))
    return groups


def weight_bytes(path: str, mode: str, dtype: str) -> int:
    """Resident bytes of the loaded model's weights (quantized layers packed, the rest in dtype)."""
    cfg = ModelConfig(path=path, dtype=dtype, quantization=mode, lora=LoraConfig(enabled=False))
    model = load_base_model(cfg, torch.device("cpu"))  # as the Policy loads it, before LoRA
    size = model.get_memory_footprint()
    del model
    gc.collect()
    return size


def run_mode(path: str, mode: str, n_groups: int, time_step: bool = True) -> dict[str, float]:
    cfg = ModelConfig(path=path, dtype="float32", quantization=mode, lora=LoraConfig(rank=16, alpha=32.0))
    policy = Policy.from_config(cfg, need_reference=False, device="cpu")
    adapter = sum(p.numel() * p.element_size() for p in policy.trainable_parameters())
    trainer = Trainer(policy, _algo(), TrainerConfig(row_tokens=4096), max_tokens=64)
    groups = make_groups(n_groups, policy.causal_lm.get_output_embeddings().weight.shape[0])
    if not time_step:  # the self-check alone (what the first step runs before training)
        from sleuth.train.packing import pack_groups

        check = trainer.self_check(groups, pack_groups(groups, trainer.cfg.row_tokens))
        return {"adapter_bytes": float(adapter), "step_s": float("nan"),
                "self_check_max": check["self_check_max_diff"], "self_check_mean": check["self_check_mean_diff"]}
    first = trainer.step(groups)
    t = time.perf_counter()
    trainer.step(groups)
    step_s = time.perf_counter() - t
    out = {"adapter_bytes": float(adapter), "step_s": step_s,
           "self_check_max": first["self_check_max_diff"], "self_check_mean": first["self_check_mean_diff"]}
    del policy, trainer
    gc.collect()
    return out


def _algo():  # -> AlgorithmConfig
    from sleuth.config import AlgorithmConfig

    return AlgorithmConfig()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--random", default="", help="HIDDEN,LAYERS of an extra random-init Llama")
    parser.add_argument("--modes", default="none,int8,nf4")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--no-step", action="store_true", help="memory and self-check only (no timed steps)")
    add_smoke_flag(parser)
    a = parser.parse_args()
    if a.smoke:
        a.model, a.random, a.groups = tiny_model_folder(), "", 1
    torch.manual_seed(0)
    models = [a.model]
    if a.random:
        from sleuth.testing.tiny_model import write_tiny_model

        hidden, layers = (int(x) for x in a.random.split(","))
        folder = tempfile.mkdtemp(prefix="quant-bench-")
        write_tiny_model(folder, hidden=hidden, layers=layers, heads=hidden // 64, kv_heads=hidden // 128)
        models.append(folder)
    print(f"CPU: {cpu_description()}")
    ratios = {}
    for path in models:
        name = "random" if path != a.model else a.model
        ref = weight_bytes(path, "none", "bfloat16")
        print(f"\n{name}: bf16 weights {ref / 2**20:.1f} MiB")
        print("| mode | weights MiB, rest bf16 | vs bf16 | weights MiB, rest fp32 | adapter MiB (fp32) "
              "| step s (fp32 compute) | self-check max | self-check mean |")
        print("|---|---|---|---|---|---|---|---|")
        for mode in a.modes.split(","):
            low, high = weight_bytes(path, mode, "bfloat16"), weight_bytes(path, mode, "float32")
            r = run_mode(path, mode, a.groups, time_step=not a.no_step)
            ratio = low / ref
            ratios[f"{'smollm2' if name == a.model else 'random'}_{mode}_vs_bf16"] = ratio
            print(f"| {mode} | {low / 2**20:.1f} | {ratio:.0%} | {high / 2**20:.1f} | {r['adapter_bytes'] / 2**20:.1f} | "
                  f"{r['step_s']:.2f} | {r['self_check_max']:.2e} | {r['self_check_mean']:.2e} |", flush=True)
    print(" ".join(f"{k}={v:.3f}" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
