"""GPU check for the training core: a packed step with the flex_attention mask vs the naive layout.

    python bench/gpu_train_step.py [--device cuda] [--hidden 1536 --layers 24] [--groups 8] [--smoke]

Builds a ~0.5B random-init Llama-style model in the script (nothing to download), bf16, and on
the Temporal-Clue-shaped batch (groups x 8 completions, prompt 1,000, completions 200) and the
AIME-shaped one (prompt 150, completions 1,000) reports, in one run: packed vs naive logprobs on
the self-check slice (the packed mask must match separate sequences), step time of sleuth's
packed step and of the naive padded layout (best of --reps after a warm-up step), tokens/s, and
MFU against a bf16 matmul measured in the same run. On CUDA the policy uses flex_attention with a
BlockMask (sleuth's GPU path); on CPU (for a dry run of the script) sleuth_packed attention.
--smoke: the tiny model's sizes, one group at a twentieth of each shape's lengths (on CPU without CUDA).
Last line: `name=value` pairs.
"""

from __future__ import annotations

import argparse

import torch

from _smoke import add_smoke_flag
from sleuth.config import AlgorithmConfig, LoraConfig, ModelConfig, TrainerConfig
from sleuth.system.hardware import cpu_description, cpu_dtype
from sleuth.testing.tiny_model import build_model, build_tokenizer
from sleuth.train.kernels.packed_attention import backend_for
from sleuth.train.optim import measure_matmul_flops
from sleuth.train.packing import pack_groups
from sleuth.train.policy import Policy
from sleuth.train.step import Trainer
from train_step import PER_GROUP, SHAPES, SMOKE_SHAPES, make_groups, naive_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--shapes", default="clue,aime")
    ap.add_argument("--modes", default="lora,lora_base,full")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=8, help="naive layout: sequences per forward")
    ap.add_argument("--row-tokens", type=int, default=16384)
    add_smoke_flag(ap)
    a = ap.parse_args()
    if a.smoke:  # sleuth.testing.tiny_model's sizes, every mode and shape
        a.hidden, a.layers, a.heads, a.kv_heads, a.vocab, a.groups, a.reps = 64, 2, 4, 2, 272, 1, 1
    dev = torch.device(a.device)
    print(f"# cpu: {cpu_description()}", flush=True)
    # bf16 on the GPU; on a CPU only where it accelerates bf16 (else float32, ~50x faster there)
    dtype = getattr(torch, "bfloat16" if dev.type == "cuda" else cpu_dtype())
    peak = measure_matmul_flops(dtype, dev, n=256 if a.smoke else 4096 if dev.type == "cuda" else 1024)
    print(f"# device {dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}), "
          f"{dtype} matmul measured: {peak / 1e12:.1f} TFLOP/s, attention: {backend_for(dev)}", flush=True)
    print("| mode | shape | layout | tokens | step s | tokens/s | MFU | self-check max / mean abs dlogp | peak GB |")
    print("|---|---|---|---|---|---|---|---|---|")
    heads: dict[str, float] = {}
    for mode in a.modes.split(","):
        model = build_model(a.hidden, a.layers, a.heads, a.kv_heads, seed=0, vocab_size=a.vocab,
                            max_positions=8192).to(dtype)
        with torch.no_grad():  # the tiny-model init is too large for a deep model: keep logits sane
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.02)
        model.set_attn_implementation(backend_for(dev))
        # lora_base: adapters in the base's dtype (model.lora.dtype=base), no per-layer input casts.
        cfg = ModelConfig(path="<random-init>", dtype=str(dtype).removeprefix("torch."),
                          lora=LoraConfig(enabled=mode.startswith("lora"),
                                          dtype="base" if mode == "lora_base" else "float32"))
        policy = Policy(model, build_tokenizer(), cfg, need_reference=False, device=dev)
        n_params = sum(p.numel() for p in model.parameters())
        body, head = policy.matmul_parameters()
        print(f"# {mode}: {n_params / 1e9:.2f}B parameters", flush=True)
        for shape in a.shapes.split(","):
            p_len, c_len = (SMOKE_SHAPES if a.smoke else SHAPES)[shape]
            groups = make_groups(a.groups, p_len, c_len, a.vocab, seed=1)
            trainer = Trainer(policy, AlgorithmConfig(), TrainerConfig(lr=1e-7, row_tokens=a.row_tokens,
                                                                       self_check=False),
                              max_tokens=c_len, peak_flops=peak)
            pad = 128 if dev.type == "cuda" else 1
            check = trainer.self_check(groups, pack_groups(groups, a.row_tokens, pad_to_multiple=pad))
            diff = f"{check['self_check_max_diff']:.3g} / {check['self_check_mean_diff']:.3g}"
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            runs = [trainer.step(groups) for _ in range(a.reps + 1)][1:]  # the first compiles kernels
            best = min(runs, key=lambda m: m["step_time_s"])
            t_packed = best["step_time_s"]
            print(f"| {mode} | {shape} | packed | {int(best['tokens'])} | {t_packed:.3f} | {best['tokens_per_s']:.0f} | "
                  f"{best['mfu']:.3f} | {diff} | {best['peak_mem_gb']:.1f} |", flush=True)
            naive = [naive_step(trainer, groups, a.micro_batch) for _ in range(a.reps + 1)][1:]
            t_naive, _, naive_tokens = min(naive)
            comp_tokens = a.groups * PER_GROUP * c_len
            mfu_naive = 6 * (body * naive_tokens + head * comp_tokens) / t_naive / peak
            mem = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else 0.0
            print(f"| {mode} | {shape} | naive | {naive_tokens} | {t_naive:.3f} | {naive_tokens / t_naive:.0f} | "
                  f"{mfu_naive:.3f} | - | {mem:.1f} |", flush=True)
            key = shape if mode == "lora" else f"{shape}_{mode}"
            heads[f"{key}_speedup"] = t_naive / t_packed
            heads[f"{key}_mfu"] = best["mfu"]
            heads[f"{key}_selfcheck_mean"] = check["self_check_mean_diff"]
        del policy, model, trainer
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print(" ".join(f"{k}={v:.4g}" for k, v in heads.items()) + f" tflops_bf16={peak / 1e12:.1f}")


if __name__ == "__main__":
    main()
