"""Training-step benchmark: shared-prompt packing vs the naive padded layout, on SmolLM2-135M.

    .venv/bin/python bench/train_step.py [--modes lora,full] [--shapes clue,aime] [--reps 1] [--smoke]

Batches of 8 groups x 8 completions with random token ids:
  clue: prompt 1,000 tokens, completions 200 tokens (Temporal-Clue-shaped)
  aime: prompt 150 tokens, completions 1,000 tokens (AIME-shaped)
"packed" is sleuth's Trainer.step (rows of [prompt | c1 | c2 ...], structured attention).
"naive" is the layout TRL uses: every completion with its full prompt, padded to the longest,
in micro-batches, with the same chunked logprobs, loss and AdamW step.
MFU is 6 x matmul parameters x tokens / time, against a matmul in the run's dtype measured in the same
run. The dtype is bf16 where the CPU accelerates it (AVX512_BF16/AMX), else float32 (--dtype overrides).
"""

from __future__ import annotations

import argparse
import random
import resource
import time

import torch

from _smoke import add_smoke_flag, tiny_model_folder
from sleuth.config import AlgorithmConfig, LoraConfig, ModelConfig, TrainerConfig
from sleuth.records import Completion, Group, Problem
from sleuth.system.hardware import cpu_description, cpu_dtype
from sleuth.train.logprobs import token_logprobs
from sleuth.train.losses import aggregation_weights, ppo_clip
from sleuth.train.optim import measure_matmul_flops
from sleuth.train.packing import pack_groups
from sleuth.train.policy import Policy
from sleuth.train.step import Trainer

SHAPES = {"clue": (1000, 200), "aime": (150, 1000)}
SMOKE_SHAPES = {name: (prompt // 20, completion // 20) for name, (prompt, completion) in SHAPES.items()}
"""--smoke: each shape at a twentieth of its lengths (bench/gpu_train_step.py's smoke run too)."""
PER_GROUP = 8


def make_groups(n_groups: int, prompt_len: int, completion_len: int, vocab: int, seed: int) -> list[Group]:
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        comps = [Completion(prompt, [rng.randrange(vocab) for _ in range(completion_len)],
                            [-rng.uniform(5, 12) for _ in range(completion_len)], "length", "")
                 for _ in range(PER_GROUP)]
        adv = [rng.uniform(-1, 1) for _ in comps]
        groups.append(Group(Problem(f"g{g}", [], None), prompt, comps, adv))
    return groups


def naive_step(trainer: Trainer, groups: list[Group], micro_batch: int) -> tuple[float, float, int]:
    """One optimizer step over every completion as [prompt | completion], right-padded.

    Returns (wall s, process CPU s, padded tokens)."""
    policy, algo = trainer.policy, trainer.algo
    lm = policy.causal_lm
    seqs = [(g.prompt_ids, c, g.advantages[i]) for g in groups for i, c in enumerate(g.completions)]
    lengths = torch.tensor([len(c.completion_ids) for _, c, _ in seqs])
    weight = aggregation_weights(lengths, algo.aggregation, trainer.max_tokens)
    width = max(len(p) + len(c.completion_ids) for p, c, _ in seqs)
    start, cpu = time.perf_counter(), time.process_time()
    trainer.optimizer.zero_grad(set_to_none=True)
    dev = policy.device
    for b in range(0, len(seqs), micro_batch):
        chunk = seqs[b : b + micro_batch]
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        pred, targets, adv, engine, w = [], [], [], [], []
        for r, (prompt, comp, a) in enumerate(chunk):
            full = prompt + comp.completion_ids
            ids[r, : len(full)] = torch.tensor(full)
            mask[r, : len(full)] = 1
            n, p = len(comp.completion_ids), len(prompt)
            pred.extend(r * width + p - 1 + k for k in range(n))
            targets.extend(comp.completion_ids)
            adv.extend([a] * n)
            engine.extend(comp.logprobs)
            w.extend([float(weight[b + r])] * n)
        hidden = lm.model(input_ids=ids.to(dev), attention_mask=mask.to(dev), use_cache=False).last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, torch.tensor(pred, device=dev))
        logp, _ = token_logprobs(hidden, lm.get_output_embeddings(), torch.tensor(targets, device=dev))
        old = logp.detach()
        tis = torch.exp(old - torch.tensor(engine, device=dev)).clamp(max=algo.tis_cap or float("inf"))
        pl = ppo_clip(logp, old, torch.tensor(adv, device=dev), torch.zeros(len(adv), dtype=torch.long, device=dev),
                      algo.clip_low, algo.clip_high)
        (torch.tensor(w, device=dev) * pl.token_loss * tis).sum().backward()
    torch.nn.utils.clip_grad_norm_(trainer.params, trainer.cfg.grad_clip)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - start, time.process_time() - cpu, len(seqs) * width


def rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="lora,full")
    ap.add_argument("--shapes", default="clue,aime")
    ap.add_argument("--reps", type=int, default=1, help="timed steps per layout (the best is kept)")
    ap.add_argument("--row-tokens", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=2, help="naive layout: sequences per forward")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="auto: bf16 where this CPU accelerates it, else float32")
    ap.add_argument("--groups", type=int, default=8, help="groups of 8 completions (8 for the headline)")
    add_smoke_flag(ap)
    a = ap.parse_args()
    matmul_n = 2048
    if a.smoke:  # every mode and shape, one group each, on the tiny model
        a.model, a.groups, a.reps, matmul_n = tiny_model_folder(), 1, 1, 256
    torch.manual_seed(0)
    dtype = cpu_dtype() if a.dtype == "auto" else a.dtype
    print(f"# cpu: {cpu_description()}", flush=True)
    peak = measure_matmul_flops(getattr(torch, dtype), "cpu", n=matmul_n, reps=3)
    print(f"# {dtype} matmul peak ({matmul_n}^3, measured now): {peak / 1e12:.3f} TFLOP/s; "
          f"threads={torch.get_num_threads()}", flush=True)
    print("| mode | shape | layout | tokens | step s (wall) | CPU s | tokens/s (wall) | MFU (wall) | "
          "self-check max / mean abs dlogp | peak RSS GB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    speedup: dict[str, float] = {}
    wall_speedup: dict[str, float] = {}
    mfu_clue = 0.0
    for mode in a.modes.split(","):
        cfg = ModelConfig(path=a.model, dtype=dtype, lora=LoraConfig(enabled=mode == "lora"))
        policy = Policy.from_config(cfg, need_reference=False, device="cpu")
        body, head = policy.matmul_parameters()
        vocab = int(policy.causal_lm.config.vocab_size)
        for shape in a.shapes.split(","):
            p_len, c_len = (SMOKE_SHAPES if a.smoke else SHAPES)[shape]
            groups = make_groups(a.groups, p_len, c_len, vocab, seed=1)
            trainer = Trainer(policy, AlgorithmConfig(),
                              TrainerConfig(lr=1e-7, row_tokens=a.row_tokens, self_check=False),
                              max_tokens=c_len, peak_flops=peak)
            check = trainer.self_check(groups, pack_groups(groups, a.row_tokens))
            diff = f"{check['self_check_max_diff']:.3g} / {check['self_check_mean_diff']:.3g}"
            # Packed and naive steps alternate, so both layouts see the same machine; the fastest
            # of each is kept (the first of each builds oneDNN kernels for its shapes).
            best, cpu_packed, naive_runs = None, float("inf"), []
            for _ in range(a.reps):
                cpu0 = time.process_time()
                m = trainer.step(groups)
                cpu_packed = min(cpu_packed, time.process_time() - cpu0)
                if best is None or m["step_time_s"] < best["step_time_s"]:
                    best = m
                naive_runs.append(naive_step(trainer, groups, a.micro_batch))
            assert best is not None
            comp_tokens = a.groups * PER_GROUP * c_len
            t_packed = best["step_time_s"]
            print(f"| {mode} | {shape} | packed | {int(best['tokens'])} | {t_packed:.2f} | {cpu_packed:.1f} | "
                  f"{best['tokens_per_s']:.0f} | {best['mfu']:.3f} | {diff} | {rss_gb():.2f} |", flush=True)
            t_naive, naive_tokens = min(r[0] for r in naive_runs), naive_runs[0][2]
            cpu_naive = min(r[1] for r in naive_runs)
            mfu_naive = 6 * (body * naive_tokens + head * comp_tokens) / t_naive / peak
            print(f"| {mode} | {shape} | naive | {naive_tokens} | {t_naive:.2f} | {cpu_naive:.1f} | "
                  f"{naive_tokens / t_naive:.0f} | {mfu_naive:.3f} | - | {rss_gb():.2f} |", flush=True)
            key = shape if mode == "lora" else f"{shape}_full"
            # Process CPU time, not wall time: on a shared machine the wall clock mostly measures
            # the other jobs; the work our process did is what the layouts change.
            speedup[key] = cpu_naive / cpu_packed
            wall_speedup[key] = t_naive / t_packed
            # Headline MFU: the packed Clue step (full weights if run), else the first packed step.
            if (shape == "clue" and (mode == "full" or not mfu_clue)) or not mfu_clue:
                mfu_clue = best["mfu"]
        del policy
    print("# wall-clock speedups: " + " ".join(f"{k}={v:.2f}" for k, v in wall_speedup.items()))
    heads = " ".join(f"{k}_speedup={v:.2f}" for k, v in speedup.items())
    print(f"{heads} mfu={mfu_clue:.3f} peak_rss_gb={rss_gb():.2f}")


if __name__ == "__main__":
    main()
