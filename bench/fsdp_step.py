"""FSDP2 step benchmark: the training step sharded over ranks against the single-process step.

    .venv/bin/python bench/fsdp_step.py [--model smollm2-135m-instruct] [--ranks 2] [--threads 2] [--smoke]
    .venv/bin/python bench/fsdp_step.py --gpu      # world size 1 FSDP2 vs the plain trainer (CUDA)

CPU (default): the same batch (random token ids, --groups groups x 8 completions) through the
single-process Trainer with --threads threads, and through --ranks FSDP2 ranks (real processes,
gloo, float32) with --threads / --ranks threads each: the same total cores. Best step time of
--reps after a warm-up step. Last line: `fsdp2_step_ratio=<FSDP2 step s / single-process step s>`.

--gpu: on the ~0.5B random-init model of bench/gpu_train_step.py (bf16), the plain Trainer
against an FSDP2 process group of one rank (float32 sharded parameters, bf16 compute). Last line
`fsdp2_gpu_overhead=<FSDP2 step s / plain step s - 1>`. Without CUDA it stops with one line.

--smoke: the CPU comparison on the tiny model, 2 ranks of one thread, two groups of short completions.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from _smoke import add_smoke_flag, tiny_model_folder
from sleuth.config import AlgorithmConfig, LoraConfig, ModelConfig, TrainerConfig
from sleuth.system.hardware import cpu_description
from sleuth.train.policy import Policy
from sleuth.train.step import Trainer
from train_step import make_groups


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed_steps(trainer: Trainer, groups: list, reps: int) -> dict[str, float]:
    """The best of `reps` steps after one warm-up step (which also runs the self-check)."""
    runs = [trainer.step(groups) for _ in range(reps + 1)][1:]
    return min(runs, key=lambda m: m["step_time_s"])


def cpu_policy(a: argparse.Namespace) -> Policy:
    torch.manual_seed(0)  # identical LoRA init in every process
    cfg = ModelConfig(path=a.model, dtype="float32", lora=LoraConfig(enabled=a.mode == "lora"))
    return Policy.from_config(cfg, need_reference=False, device="cpu")


def trainer_cfg(a: argparse.Namespace) -> TrainerConfig:
    return TrainerConfig(lr=1e-6, row_tokens=a.row_tokens)


def batch(a: argparse.Namespace, vocab: int) -> list:
    return make_groups(a.groups, a.prompt, a.completion, vocab, seed=1)


def _rank(rank: int, a: argparse.Namespace, port: int, out: str) -> None:
    from sleuth.train.fsdp import FSDPTrainer, init_distributed

    torch.set_num_threads(max(1, a.threads // a.ranks))
    init_distributed(rank, a.ranks, "127.0.0.1", port)
    policy = cpu_policy(a)
    trainer = FSDPTrainer(policy, AlgorithmConfig(), trainer_cfg(a), max_tokens=a.completion)
    best = timed_steps(trainer, batch(a, policy.causal_lm.config.vocab_size), a.reps)
    if rank == 0:
        torch.save({"metrics": best, "rows": [len(s) for s in trainer.last_shares]}, out)
    torch.distributed.destroy_process_group()


def run_cpu(a: argparse.Namespace) -> float:
    """Print the CPU table and `fsdp2_step_ratio=...`; return the ratio (for bench/scale.py)."""
    torch.set_num_threads(a.threads)
    policy = cpu_policy(a)
    groups = batch(a, policy.causal_lm.config.vocab_size)
    single = timed_steps(Trainer(policy, AlgorithmConfig(), trainer_cfg(a), max_tokens=a.completion), groups, a.reps)
    del policy
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank0.pt")
        mp.spawn(_rank, args=(a, free_port(), out), nprocs=a.ranks, join=True)
        sharded = torch.load(out, weights_only=False)
    print(f"# CPU: {cpu_description()}; load average {os.getloadavg()[0]:.1f} at the end")
    print(f"# {a.model} {a.mode}, float32, {a.groups} groups x 8 completions (prompt {a.prompt}, "
          f"completion {a.completion}), rows of {a.row_tokens} tokens, best of {a.reps}")
    print("| trainer | processes | threads each | rows per rank | step s | tokens/s | loss | grad norm |")
    print("|---|---|---|---|---|---|---|---|")
    m = single
    print(f"| single process | 1 | {a.threads} | {int(m['rows'])} | {m['step_time_s']:.2f} | "
          f"{m['tokens_per_s']:.0f} | {m['loss']:+.6f} | {m['grad_norm']:.6f} |")
    m = sharded["metrics"]
    print(f"| FSDP2 (gloo) | {a.ranks} | {max(1, a.threads // a.ranks)} | {'/'.join(map(str, sharded['rows']))} | "
          f"{m['step_time_s']:.2f} | {m['tokens_per_s']:.0f} | {m['loss']:+.6f} | {m['grad_norm']:.6f} |")
    ratio = m["step_time_s"] / single["step_time_s"]
    print(f"fsdp2_step_ratio={ratio:.3f}")
    return ratio


def gpu_policy(a: argparse.Namespace, device: torch.device) -> Policy:
    """The ~0.5B random-init model of bench/gpu_train_step.py, bf16, flex_attention."""
    from sleuth.testing.tiny_model import build_model, build_tokenizer
    from sleuth.train.kernels.packed_attention import backend_for

    model = build_model(1536, 24, 12, 4, seed=0, vocab_size=32000, max_positions=8192).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    model.set_attn_implementation(backend_for(device))
    torch.manual_seed(0)
    cfg = ModelConfig(path="<random-init>", dtype="bfloat16", lora=LoraConfig(enabled=a.mode == "lora"))
    return Policy(model, build_tokenizer(), cfg, need_reference=False, device=device)


def run_gpu(a: argparse.Namespace) -> None:
    from sleuth.train.fsdp import FSDPTrainer, init_distributed

    if not torch.cuda.is_available():
        print("bench/fsdp_step.py --gpu: no CUDA device on this machine", file=sys.stderr)
        raise SystemExit(2)
    device = torch.device("cuda", 0)
    groups = make_groups(a.groups, a.prompt, a.completion, 32000, seed=1)
    cfg = TrainerConfig(lr=1e-7, row_tokens=a.row_tokens)
    results: dict[str, Any] = {}
    policy = gpu_policy(a, device)
    results["plain"] = timed_steps(Trainer(policy, AlgorithmConfig(), cfg, max_tokens=a.completion), groups, a.reps)
    del policy
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    init_distributed(0, 1, "127.0.0.1", free_port())
    policy = gpu_policy(a, device)
    results["fsdp2"] = timed_steps(FSDPTrainer(policy, AlgorithmConfig(), cfg, max_tokens=a.completion),
                                   groups, a.reps)
    torch.distributed.destroy_process_group()
    print(f"# {torch.cuda.get_device_name(device)}, 0.5B random-init {a.mode}, {a.groups} groups x 8 "
          f"(prompt {a.prompt}, completion {a.completion}), best of {a.reps}")
    print("| trainer | step s | tokens/s | MFU | peak GB | loss |")
    print("|---|---|---|---|---|---|")
    for name, m in results.items():
        print(f"| {name} | {m['step_time_s']:.3f} | {m['tokens_per_s']:.0f} | {m['mfu']:.3f} | "
              f"{m['peak_mem_gb']:.1f} | {m['loss']:+.5f} |")
    print(f"fsdp2_gpu_overhead={results['fsdp2']['step_time_s'] / results['plain']['step_time_s'] - 1:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true", help="world size 1 FSDP2 vs the plain trainer on CUDA")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--mode", choices=["lora", "full"], default="lora")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="total CPU threads")
    ap.add_argument("--groups", type=int, help="default 4 (CPU), 8 (GPU)")
    ap.add_argument("--prompt", type=int, help="prompt tokens: default 300 (CPU), 1000 (GPU, the Clue shape)")
    ap.add_argument("--completion", type=int, help="completion tokens: default 64 (CPU), 200 (GPU)")
    ap.add_argument("--row-tokens", type=int, help="default 1024 (CPU), 16384 (GPU)")
    ap.add_argument("--reps", type=int, default=2)
    add_smoke_flag(ap)
    a = ap.parse_args()
    if a.smoke:
        a.gpu, a.model, a.ranks, a.threads, a.reps = False, tiny_model_folder(), 2, 2, 1
        a.groups, a.prompt, a.completion, a.row_tokens = 2, 30, 8, 256  # a row for each rank
    defaults = (8, 1000, 200, 16384) if a.gpu else (4, 300, 64, 1024)
    for key, value in zip(("groups", "prompt", "completion", "row_tokens"), defaults):
        if getattr(a, key) is None:
            setattr(a, key, value)
    run_gpu(a) if a.gpu else run_cpu(a)


if __name__ == "__main__":
    main()
