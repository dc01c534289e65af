"""Agent benchmark part (1): a multi-turn batch trained with prefix-tree packing vs one sequence per call.

    .venv/bin/python bench/agent_packing.py [--modes lora] [--reps 2] [--model smollm2-135m-instruct] [--smoke]
    (or as part 1 of bench/agent.py: `--parts 1,2,3`)

One group of `--episodes` episodes (8) of `--turns` turns (4) with random token ids: a shared
first prompt (150 tokens), then per turn a sampled reply (60 tokens, loss mask 1) followed, except
after the last turn, by a tool result (300 tokens plus 5 template tokens, loss mask 0).
"tree" is sleuth's Trainer.step on the episodes as they come from the gateway: one sequence per
episode, the group's first prompt computed once per row part.
"per call" is how trainers without prefix sharing compute the same batch: every model call is its
own sequence [prompt + history so far | reply] (each reply trained once, as in the tree layout),
packed into rows without padding (block-diagonal causal attention), through the same Trainer.
Step times: process CPU seconds (the headline; on a shared machine the wall clock mostly measures
the other jobs) and wall seconds; the fastest of --reps alternating steps of each layout is kept.
Last line: tree_step_speedup (per-call CPU s / tree CPU s) and tree_token_ratio (per-call tokens /
tree tokens). --smoke: the tiny model, 2 episodes of 2 turns, one step of each layout.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from _smoke import add_smoke_flag, tiny_model_folder
from sleuth.config import AlgorithmConfig, LoraConfig, ModelConfig, TrainerConfig
from sleuth.records import Completion, Group, Problem
from sleuth.system.hardware import cpu_description
from sleuth.train.packing import pack_groups
from sleuth.train.policy import Policy
from sleuth.train.step import Trainer

PROMPT, REPLY, TOOL, TEMPLATE = 150, 60, 300, 5
SMOKE = {"reps": 1, "episodes": 2, "turns": 2}
"""run_tree_packing's sizes in a --smoke run (with the tiny model)."""


def episode_groups(episodes: int, turns: int, vocab: int, seed: int) -> tuple[list[Group], list[Group]]:
    """(the tree layout: one group of episodes, the per-call layout: one group per model call)."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    prompt = toks(PROMPT)
    tree_comps: list[Completion] = []
    calls: list[Group] = []
    for e in range(episodes):
        ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        advantage = rng.uniform(-1, 1)
        for t in range(turns):
            reply = toks(REPLY)
            reply_lp = [-rng.uniform(0.1, 3.0) for _ in reply]
            calls.append(Group(Problem(f"e{e}t{t}", [], None), prompt + ids,
                               [Completion(prompt + ids, reply, reply_lp, "stop", "")], [advantage]))
            ids += reply
            mask += [1] * len(reply)
            logprobs += reply_lp
            if t < turns - 1:  # the tool's answer, wrapped in template tokens: inserted, not sampled
                inserted = toks(TOOL + TEMPLATE)
                ids += inserted
                mask += [0] * len(inserted)
                logprobs += [0.0] * len(inserted)
        tree_comps.append(Completion(prompt, ids, logprobs, "stop", "", loss_mask=mask))
    advantages = [calls[e * turns].advantages[0] for e in range(episodes)]  # type: ignore[index]
    return [Group(Problem("episodes", [], None), prompt, tree_comps, advantages)], calls


def run_tree_packing(model: str = "smollm2-135m-instruct", modes: tuple[str, ...] = ("lora",), reps: int = 2,
                     episodes: int = 8, turns: int = 4, row_tokens: int = 4096,
                     dtype: str = "float32") -> dict[str, float]:
    """Print the table; return {"tree_step_speedup", "tree_token_ratio"} (of the last mode)."""

    print("| mode | layout | sequences | tokens | trained tokens | step s (CPU) | step s (wall) | "
          "self-check max abs dlogp |")
    print("|---|---|---|---|---|---|---|---|")
    out: dict[str, float] = {}
    for mode in modes:
        cfg = ModelConfig(path=model, dtype=dtype, lora=LoraConfig(enabled=mode == "lora"))
        policy = Policy.from_config(cfg, need_reference=False, device="cpu")
        tree, calls = episode_groups(episodes, turns, int(policy.causal_lm.config.vocab_size), seed=1)
        trainer = Trainer(policy, AlgorithmConfig(), TrainerConfig(lr=1e-7, row_tokens=row_tokens, self_check=False),
                          max_tokens=REPLY)
        batches = {"tree": tree, "per call": calls}
        best: dict[str, tuple[float, float, dict[str, float]]] = {}
        for _ in range(reps):  # alternating, so both layouts see the same machine
            for name, groups in batches.items():
                cpu = time.process_time()
                m = trainer.step(groups)
                cpu = time.process_time() - cpu
                if name not in best or cpu < best[name][0]:
                    best[name] = (cpu, m["step_time_s"], m)
        check = trainer.self_check(tree, pack_groups(tree, row_tokens))["self_check_max_diff"]
        for name in batches:
            cpu, wall, m = best[name]
            print(f"| {mode} | {name} | {int(m['sequences'])} | {int(m['tokens'])} | {int(m['completion_tokens'])} | "
                  f"{cpu:.1f} | {wall:.1f} | {f'{check:.3g}' if name == 'tree' else '-'} |", flush=True)
        out = {"tree_step_speedup": best["per call"][0] / best["tree"][0],
               "tree_token_ratio": best["per call"][2]["tokens"] / best["tree"][2]["tokens"]}
        del policy, trainer
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--modes", default="lora")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--row-tokens", type=int, default=4096)
    ap.add_argument("--dtype", default="float32", help="float32 on CPUs without fast bf16 (AVX2)")
    add_smoke_flag(ap)
    a = ap.parse_args()
    if a.smoke:
        a.model, a.reps, a.episodes, a.turns = tiny_model_folder(), SMOKE["reps"], SMOKE["episodes"], SMOKE["turns"]
    torch.manual_seed(0)
    print(f"# cpu: {cpu_description()}", flush=True)  # run alone, not as part 1 of bench/agent.py
    print(f"# threads={torch.get_num_threads()} dtype={a.dtype}", flush=True)
    r = run_tree_packing(a.model, tuple(a.modes.split(",")), a.reps, a.episodes, a.turns, a.row_tokens, a.dtype)
    print(f"tree_step_speedup={r['tree_step_speedup']:.2f} tree_token_ratio={r['tree_token_ratio']:.2f}")


if __name__ == "__main__":
    main()
