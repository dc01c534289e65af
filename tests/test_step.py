"""The packed training step equals the naive per-completion computation, and it learns."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from sleuth.config import AlgorithmConfig, LoraConfig, ModelConfig, TrainerConfig
from sleuth.errors import UserError
from sleuth.records import Completion, Group, Problem
from sleuth.rewards.advantages import compute_advantages
from sleuth.system.attention import PACKED, register_packed_attention
from sleuth.testing.tiny_model import build_model, build_tokenizer
from sleuth.train.packing import loss_mask, pack_groups
from sleuth.train.policy import Policy
from sleuth.train.step import METRIC_KEYS, SelfCheckError, Trainer, _PassCache, split_mini_batches

VOCAB = 272


def make_policy(lora: bool, need_reference: bool = False, seed: int = 0, attn: str = PACKED) -> Policy:
    register_packed_attention()
    model = build_model(hidden=32, layers=2, heads=4, kv_heads=2, seed=seed)
    model.set_attn_implementation(attn)
    cfg = ModelConfig(path="unused", dtype="float32", lora=LoraConfig(enabled=lora, rank=4, alpha=8.0))
    policy = Policy(model, build_tokenizer(), cfg, need_reference=need_reference, device="cpu")
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # move the policy away from its reference so KL and ratios are non-trivial
        for name, p in policy.model.named_parameters():
            if p.requires_grad and ("lora_B" in name or not lora):
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return policy


def random_groups(seed: int, n_groups: int = 3, n_comp: int = 3) -> list[Group]:
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 9))]
        comps = []
        for _ in range(n_comp):
            ids = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))]
            comps.append(Completion(prompt, ids, [-rng.uniform(3.0, 8.0) for _ in ids], "stop", "",
                                    reward=float(rng.random() < 0.5)))
        adv = [rng.uniform(-1.5, 1.5) for _ in comps]
        groups.append(Group(Problem(f"p{g}", [], None), prompt, comps, adv))
    return groups


def random_tree_groups(seed: int, n_groups: int = 2) -> list[Group]:
    """Multi-turn episodes: three share a first reply and tool result (>= MIN_SHARED tokens) and then
    diverge, one repeats another exactly, two diverge at once (one with a further turn), and one
    call has its own prompt (the first prompt plus the shared reply plus new tokens)."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(n)]

    groups = []
    for g in range(n_groups):
        prompt = toks(rng.randint(3, 9))
        shared = [(toks(rng.randint(16, 20)), 1), (toks(rng.randint(16, 24)), 0)]  # reply, tool result
        trajs = [[*shared, (toks(rng.randint(1, 6)), 1)] for _ in range(3)]
        trajs.append(list(trajs[1]))
        trajs += [[(toks(rng.randint(2, 6)), 1), (toks(rng.randint(3, 8)), 0), (toks(rng.randint(1, 5)), 1)]
                  for _ in range(2)]
        trajs[-1] += [(toks(4), 0), (toks(3), 1)]
        prompts = [prompt] * len(trajs)
        trajs.append([(toks(rng.randint(1, 5)), 1)])
        prompts.append(prompt + shared[0][0] + toks(3))
        comps = []
        for own, spans in zip(prompts, trajs, strict=True):
            ids = [t for span, _ in spans for t in span]
            mask = [m for span, m in spans for _ in span]
            comps.append(Completion(own, ids, [-rng.uniform(3.0, 8.0) if m else 0.0 for m in mask], "stop", "",
                                    loss_mask=mask))
        groups.append(Group(Problem(f"t{g}", [], None), prompt, comps, [rng.uniform(-1.5, 1.5) for _ in comps]))
    return groups


def sampled(comp: Completion) -> torch.Tensor:
    return torch.tensor(loss_mask(comp), dtype=torch.bool)


def naive_loss(policy: Policy, groups: list[Group], algo: AlgorithmConfig, max_tokens: int,
               old: dict[tuple[int, int], torch.Tensor]) -> torch.Tensor:
    """Each completion as its own [prompt | completion] sequence, full-vocabulary logits; the loss
    over its sampled (loss-mask one) tokens only."""
    lm = policy.causal_lm
    n_seqs = sum(len(g.completions) for g in groups)
    n_tokens = sum(sum(loss_mask(c)) for g in groups for c in g.completions)
    total = torch.zeros(())
    for gi, group in enumerate(groups):
        for ci, comp in enumerate(group.completions):
            prompt = comp.prompt_ids or group.prompt_ids
            p, keep = len(prompt), sampled(comp)
            ids = torch.tensor([prompt + comp.completion_ids])
            target = torch.tensor(comp.completion_ids)

            def logprobs(model: torch.nn.Module, ids: torch.Tensor = ids, p: int = p, keep: torch.Tensor = keep,
                         target: torch.Tensor = target) -> tuple[torch.Tensor, torch.Tensor]:
                """(logprob, entropy) of each sampled token."""
                logits = model(input_ids=ids).logits[0, p - 1 : p - 1 + len(target)].float()
                full = torch.log_softmax(logits, -1)
                return full.gather(-1, target[:, None])[:, 0][keep], -(full.exp() * full).sum(-1)[keep]

            logp, entropy = logprobs(lm)
            n = logp.numel()
            old_lp = old.get((gi, ci), logp.detach())
            adv = group.advantages[ci] if comp.token_advantages is None else torch.tensor(comp.token_advantages)[keep]
            if algo.loss == "ppo_clip":
                ratio = torch.exp(logp - old_lp)
            else:
                s = torch.exp((logp - old_lp).mean())
                ratio = s.detach() * torch.exp(logp - logp.detach())
            obj = torch.minimum(ratio * adv, ratio.clamp(1 - algo.clip_low, 1 + algo.clip_high) * adv)
            engine = torch.tensor(comp.logprobs)[keep]
            weighted = algo.tis_cap and not comp.guided  # guided samples: no weight to their sampler
            tis = torch.exp(old_lp - engine).clamp(max=algo.tis_cap) if weighted else torch.ones(n)
            tok = -obj * tis
            if algo.kl_beta > 0:
                with torch.no_grad(), policy.reference() as ref_model:
                    ref = logprobs(ref_model)[0]
                tok = tok + algo.kl_beta * (torch.exp(ref - logp) - (ref - logp) - 1)
            if algo.entropy_coef > 0:
                tok = tok - algo.entropy_coef * entropy
            if algo.aggregation == "token_mean":
                total = total + tok.sum() / n_tokens
            elif algo.aggregation == "seq_mean_token_mean":
                total = total + tok.mean() / n_seqs
            else:
                total = total + tok.sum() / (max_tokens * n_seqs)
    return total


def grads(policy: Policy) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in policy.trainable_parameters()]


def check_packed_equals_naive(policy: Policy, algo: AlgorithmConfig, groups: list[Group], row_tokens: int,
                              seed: int) -> None:
    """Packed loss and gradients (off-policy "old" logprobs, so the clip bites) equal the naive ones."""
    trainer = Trainer(policy, algo, TrainerConfig(row_tokens=row_tokens), max_tokens=8)
    batch = pack_groups(groups, row_tokens)
    assert len(batch.rows) > 1
    # "Old" logprobs away from the current ones (as in a later epoch), so the clip bites somewhere.
    gen = torch.Generator().manual_seed(seed)
    old: dict[tuple[int, int], torch.Tensor] = {}
    with torch.no_grad():
        for gi, group in enumerate(groups):
            for ci, comp in enumerate(group.completions):
                naive = policy.naive_logprobs(comp.prompt_ids or group.prompt_ids, comp.completion_ids)[sampled(comp)]
                old[(gi, ci)] = naive + 0.2 * torch.randn(naive.shape, generator=gen)
    cache = _PassCache()
    for row in batch.rows:
        cache.old.append(torch.cat([old[(pl.group, pl.completion)] for pl in row.placements]))
        cache.ref.append(policy.reference_logprobs(row))
    trainer.optimizer.zero_grad()
    stats = trainer._pass(batch, cache, first=False)
    packed_grads = grads(policy)
    assert stats["clip_frac_low"] + stats["clip_frac_high"] > 0
    trainer.optimizer.zero_grad()
    expected = naive_loss(policy, groups, algo, 8, old)
    expected.backward()
    naive_grads = grads(policy)
    assert stats["loss"] == pytest.approx(expected.item(), rel=1e-5)
    for a, b in zip(packed_grads, naive_grads):
        assert float((a - b).norm()) <= 1e-5 * float(b.norm()) + 1e-9
    assert sum(float(g.norm()) for g in naive_grads) > 0


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("loss", ["ppo_clip", "gspo"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "constant"])
def test_packed_loss_and_gradients_equal_naive(lora: bool, loss: str, aggregation: str) -> None:
    seed = 10 * ["token_mean", "seq_mean_token_mean", "constant"].index(aggregation) + 2 * (loss == "gspo") + lora
    policy = make_policy(lora, need_reference=True, seed=seed)
    algo = AlgorithmConfig(loss=loss, aggregation=aggregation, kl_beta=0.1, tis_cap=2.0,
                           clip_low=0.05, clip_high=0.08)
    # A small row budget forces several rows, split groups and several groups per row.
    check_packed_equals_naive(policy, algo, random_groups(seed, n_groups=3, n_comp=4), 24, seed)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_entropy_bonus_packed_equals_naive(lora: bool, aggregation: str) -> None:
    """algorithm.entropy_coef: the packed loss and gradients, entropy term included, equal the
    naive full-vocabulary ones (LoRA: the frozen head's entropy basis; full: the trained, tied head
    recomputes its chunks), and the term changes the gradient."""
    seed = 40 + lora + 2 * (aggregation == "token_mean")
    policy = make_policy(lora, need_reference=True, seed=seed)
    algo = AlgorithmConfig(aggregation=aggregation, kl_beta=0.1, tis_cap=2.0, clip_low=0.05, clip_high=0.08,
                           entropy_coef=0.3)
    groups = random_groups(seed, n_groups=3, n_comp=4)
    check_packed_equals_naive(policy, algo, groups, 24, seed)
    with_bonus = grads(policy)
    policy.model.zero_grad()
    check_packed_equals_naive(policy, algo.model_copy(update={"entropy_coef": 0.0}), groups, 24, seed)
    without = grads(policy)
    assert sum(float((a - b).norm()) for a, b in zip(with_bonus, without, strict=True)) > 1e-3


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize(("loss", "aggregation"), [("ppo_clip", "token_mean"), ("gspo", "seq_mean_token_mean"),
                                                   ("ppo_clip", "constant")])
def test_tree_packed_loss_and_gradients_equal_naive(lora: bool, loss: str, aggregation: str) -> None:
    """Multi-turn masks, branching after shared turns, a duplicate episode and a call with its own
    prompt; small rows split the trees (first group) and fit several in one (second)."""
    seed = 100 + 10 * ["token_mean", "seq_mean_token_mean", "constant"].index(aggregation) + lora
    policy = make_policy(lora, need_reference=True, seed=seed)
    algo = AlgorithmConfig(loss=loss, aggregation=aggregation, kl_beta=0.1, tis_cap=2.0,
                           clip_low=0.05, clip_high=0.08)
    groups = random_tree_groups(seed)
    batch = pack_groups(groups, 96)
    assert max(pl.depth for r in batch.rows for pl in r.placements) >= 3
    assert batch.n_tokens < sum(len(pl.positions) for r in batch.rows for pl in r.placements)
    check_packed_equals_naive(policy, algo, groups, 96, seed)


@pytest.mark.parametrize(("loss", "aggregation"), [("ppo_clip", "token_mean"), ("gspo", "seq_mean_token_mean")])
def test_per_token_advantages_packed_equal_naive(loss: str, aggregation: str) -> None:
    """Per-answer credit (Completion.token_advantages): each token's own advantage reaches the
    loss, packed as naive, through split groups and shared rows."""
    seed = 200 + (loss == "gspo")
    policy = make_policy(True, need_reference=True, seed=seed)
    algo = AlgorithmConfig(loss=loss, aggregation=aggregation, kl_beta=0.1, tis_cap=2.0, clip_low=0.05,
                           clip_high=0.08)
    groups = random_groups(seed, n_groups=3, n_comp=4)
    rng = random.Random(seed)
    for g in groups:
        for c in g.completions[::2]:  # some completions per token, the others per sequence
            c.token_advantages = [rng.uniform(-2.0, 2.0) for _ in c.completion_ids]
    check_packed_equals_naive(policy, algo, groups, 24, seed)


def test_token_advantages_equal_to_the_sequence_advantage_change_nothing() -> None:
    algo = AlgorithmConfig()
    groups = random_groups(7, n_groups=3, n_comp=3)
    out = []
    for per_token in (False, True):
        policy = make_policy(True, seed=4)
        for g in groups:
            for c, a in zip(g.completions, g.advantages, strict=True):
                c.token_advantages = [a] * len(c.completion_ids) if per_token else None
        loss = Trainer(policy, algo, TrainerConfig(row_tokens=40), max_tokens=8).loss_and_gradients(groups)
        out.append((loss, grads(policy)))
    assert out[0][0] == out[1][0]
    assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1]))


def test_guided_samples_take_no_importance_weight() -> None:
    """rollout.guided_samples: a guided completion's tokens get no truncated IS weight (their
    sampler was the constrained policy); packed equals naive, and its engine logprobs change nothing."""
    algo = AlgorithmConfig(tis_cap=2.0)
    groups = random_groups(11, n_groups=3, n_comp=3)
    for g in groups:
        g.completions[-1].guided = True
    check_packed_equals_naive(make_policy(True, seed=5), algo, groups, row_tokens=40, seed=2)

    def step_grads(marked: bool, engine_shift: float) -> list[torch.Tensor]:
        policy = make_policy(True, seed=5)
        for g in groups:
            c = g.completions[-1]
            c.guided = marked
            c.logprobs = [lp + engine_shift for lp in c.logprobs]
        Trainer(policy, algo, TrainerConfig(row_tokens=40), max_tokens=8).loss_and_gradients(groups)
        for g in groups:  # undo the shift
            c = g.completions[-1]
            c.logprobs = [lp - engine_shift for lp in c.logprobs]
        return grads(policy)

    guided, shifted = step_grads(True, 0.0), step_grads(True, -30.0)
    assert all(torch.equal(a, b) for a, b in zip(guided, shifted))
    weighted = step_grads(False, 0.0)
    assert sum(float((a - b).norm()) for a, b in zip(guided, weighted)) > 1e-4


@pytest.mark.parametrize("attn", [PACKED, "sdpa"])
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_first_pass_matches_naive_on_policy(lora: bool, attn: str) -> None:
    policy = make_policy(lora, seed=3, attn=attn)
    algo = AlgorithmConfig(aggregation="seq_mean_token_mean")
    trainer = Trainer(policy, algo, TrainerConfig(row_tokens=40), max_tokens=8)
    groups = random_groups(5, n_groups=4, n_comp=3)
    loss = trainer.loss_and_gradients(groups)
    packed_grads = grads(policy)
    trainer.optimizer.zero_grad()
    expected = naive_loss(policy, groups, algo, 8, {})
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-5)
    for a, b in zip(packed_grads, grads(policy)):
        assert float((a - b).norm()) <= 1e-5 * float(b.norm()) + 1e-9


def test_zero_advantage_groups_give_no_gradient() -> None:
    policy = make_policy(True, seed=1)
    trainer = Trainer(policy, AlgorithmConfig(), TrainerConfig(row_tokens=64), max_tokens=8)
    groups = random_groups(2)
    for g in groups:
        for c in g.completions:
            c.reward = 1.0
    kept, metrics = compute_advantages(groups, "grpo", drop_zero=False)
    assert metrics["groups_dropped"] == 0
    trainer.loss_and_gradients(kept)
    assert all(float(g.abs().max()) == 0.0 for g in grads(policy))
    dropped, metrics = compute_advantages(groups, "grpo", drop_zero=True)
    assert dropped == [] and metrics["groups_dropped"] == 3
    before = [p.detach().clone() for p in policy.trainable_parameters()]
    out = trainer.step(dropped)
    assert out["skipped"] == 1.0 and out["loss"] == 0.0 and set(METRIC_KEYS) <= set(out)
    assert all(torch.equal(a, p) for a, p in zip(before, policy.trainable_parameters()))


def test_bad_input_is_a_clear_error() -> None:
    policy = make_policy(True, seed=1)
    trainer = Trainer(policy, AlgorithmConfig(), TrainerConfig(), max_tokens=8)
    groups = random_groups(4, n_groups=1)
    groups[0].completions[1].logprobs[-1] = math.nan
    with pytest.raises(UserError, match="completion 1 has a non-finite"):
        trainer.step(groups)
    groups = random_groups(4, n_groups=1)
    groups[0].completions[0].logprobs.append(-1.0)
    with pytest.raises(UserError, match=r"completion 0 has \d+ logprobs for \d+ tokens"):
        trainer.step(groups)
    groups = random_groups(4, n_groups=1)
    groups[0].completions = []
    groups[0].advantages = []
    with pytest.raises(UserError, match="has no completions"):
        trainer.step(groups)


def test_non_finite_loss_skips_the_update() -> None:
    policy = make_policy(True, seed=1)
    trainer = Trainer(policy, AlgorithmConfig(tis_cap=None), TrainerConfig(self_check=False), max_tokens=8)
    groups = random_groups(6)
    groups[1].advantages = [math.inf] * len(groups[1].completions)
    groups[1].advantages[0] = 1.0
    before = [p.detach().clone() for p in policy.trainable_parameters()]
    with pytest.raises(UserError, match="non-finite advantage"):
        trainer.step(groups)
    # An overflow inside the model (not in the input) is skipped and logged, not applied.
    with torch.no_grad():
        policy.causal_lm.get_output_embeddings().weight[0, 0] = math.nan
    out = trainer.step(random_groups(6))
    assert out["skipped"] == 1.0 and math.isnan(out["loss"])
    assert all(torch.equal(a, p) for a, p in zip(before, policy.trainable_parameters()))


def test_self_check_catches_a_model_that_ignores_the_mask() -> None:
    # transformers' eager attention adds a boolean 4D mask as 0/1 instead of masking with it.
    policy = make_policy(True, seed=2, attn="eager")
    trainer = Trainer(policy, AlgorithmConfig(), TrainerConfig(row_tokens=64), max_tokens=8)
    with pytest.raises(SelfCheckError, match="self-check failed"):
        trainer.step(random_groups(7))
    policy = make_policy(True, seed=2)
    trainer = Trainer(policy, AlgorithmConfig(), TrainerConfig(row_tokens=64), max_tokens=8)
    out = trainer.step(random_groups(7))
    assert set(METRIC_KEYS) <= set(out)
    assert out["self_check_max_diff"] < 1e-4
    assert out["skipped"] == 0.0 and out["tokens"] > 0 and out["mfu"] > 0 and out["peak_mem_gb"] > 0


def test_self_check_covers_the_deepest_tree_path(monkeypatch: pytest.MonkeyPatch) -> None:
    groups = random_tree_groups(5)
    policy = make_policy(True, seed=2, attn="eager")
    with pytest.raises(SelfCheckError, match="self-check failed"):
        Trainer(policy, AlgorithmConfig(), TrainerConfig(row_tokens=96), max_tokens=8).step(groups)
    policy = make_policy(True, seed=2)
    checked: list[list[int]] = []
    naive = policy.naive_logprobs

    def spy(prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
        checked.append(prompt_ids + completion_ids)
        return naive(prompt_ids, completion_ids)

    monkeypatch.setattr(policy, "naive_logprobs", spy)
    out = Trainer(policy, AlgorithmConfig(), TrainerConfig(row_tokens=96), max_tokens=8).step(groups)
    assert out["self_check_max_diff"] < 1e-4 and out["skipped"] == 0.0
    placements = [pl for row in pack_groups(groups, 96).rows for pl in row.placements]
    depth = max(pl.depth for pl in placements)
    assert depth >= 3 and 2 <= len(checked) <= 3  # first, last, deepest (which may be one of those)
    deepest = [(groups[pl.group].completions[pl.completion].prompt_ids
                + groups[pl.group].completions[pl.completion].completion_ids) for pl in placements if pl.depth == depth]
    assert any(seq in deepest for seq in checked)


def sample_groups(policy: Policy, prompts: list[list[int]], n: int, length: int,
                  reward_fn: object, gen: torch.Generator) -> list[Group]:
    """Plain torch sampling from the policy (temperature 1), scored by reward_fn(first_token)."""
    lm = policy.causal_lm
    groups = []
    with torch.no_grad():
        for pi, prompt in enumerate(prompts):
            ids = torch.tensor([prompt] * n)
            logps = []
            for _ in range(length):
                logits = lm(input_ids=ids).logits[:, -1].float()
                lp = torch.log_softmax(logits, -1)
                tok = torch.multinomial(lp.exp(), 1, generator=gen)
                logps.append(lp.gather(-1, tok)[:, 0])
                ids = torch.cat([ids, tok], 1)
            comps = []
            for i in range(n):
                comp_ids = ids[i, len(prompt):].tolist()
                comps.append(Completion(prompt, comp_ids, [float(x[i]) for x in logps], "length", "",
                                        reward=float(reward_fn(comp_ids[0]))))  # type: ignore[operator]
            groups.append(Group(Problem(f"p{pi}", [], None), prompt, comps))
    return groups


@pytest.mark.slow
def test_grpo_learns_a_toy_reward() -> None:
    """Reward 1 when the first completion token is in a target set: mean reward must rise."""
    torch.manual_seed(0)
    policy = make_policy(False, seed=4)
    trainer = Trainer(policy, AlgorithmConfig(), TrainerConfig(lr=1e-2, row_tokens=256), max_tokens=4)
    target = set(range(0, VOCAB, 6))  # 1 in 6 tokens is rewarded at the start
    gen = torch.Generator().manual_seed(0)
    prompts = [[10, 20, 30, 40], [7, 8, 9], [100, 50, 25, 12, 6]]
    history = []
    for _ in range(30):
        groups = sample_groups(policy, prompts, 8, 3, lambda t: t in target, gen)
        history.append(sum(sum(g.rewards) for g in groups) / 24)
        kept, _ = compute_advantages(groups, "grpo", drop_zero=True)
        metrics = trainer.step(kept)
        assert metrics.get("skipped", 0.0) == 0.0 or not kept
    first, last = sum(history[:5]) / 5, sum(history[-5:]) / 5
    assert last > first + 0.3, [round(h, 2) for h in history]


def test_state_dict_resumes_exactly(tmp_path: Path) -> None:
    algo = AlgorithmConfig(kl_beta=0.05)
    tcfg = TrainerConfig(lr=1e-3, schedule="cosine", warmup_steps=1, row_tokens=40, epochs_per_iteration=2)
    batches = [random_groups(20 + i) for i in range(3)]
    policy = make_policy(True, seed=5)
    trainer = Trainer(policy, algo, tcfg, total_steps=3, max_tokens=8)
    for groups in batches[:2]:
        metrics = trainer.step(groups)
    assert metrics["skipped"] == 0.0 and metrics["kl"] > 0
    # The second epoch sees a ratio != 1 (the first update moved the policy).
    policy.save(tmp_path / "ckpt")
    torch.save(trainer.state_dict(), tmp_path / "trainer.pt")
    trainer.step(batches[2])
    expected = [p.detach().clone() for p in policy.trainable_parameters()]

    resumed = make_policy(True, seed=5)
    resumed.load_weights(tmp_path / "ckpt")
    trainer2 = Trainer(resumed, algo, tcfg, total_steps=3, max_tokens=8)
    trainer2.load_state_dict(torch.load(tmp_path / "trainer.pt", weights_only=False))
    assert trainer2.step_count == 2
    trainer2.step(batches[2])
    for a, b in zip(expected, resumed.trainable_parameters()):
        torch.testing.assert_close(b.detach(), a, rtol=0, atol=0)
    assert trainer2.scheduler.get_last_lr() == trainer.scheduler.get_last_lr()


def test_step_reports_each_packed_row_for_a_progress_bar() -> None:
    policy = make_policy(True, seed=2)
    trainer = Trainer(policy, AlgorithmConfig(), TrainerConfig(row_tokens=24, epochs_per_iteration=2,
                                                               self_check=False), max_tokens=8)
    groups, _ = compute_advantages(random_groups(3), "grpo", drop_zero=True)
    calls: list[tuple[int, int]] = []
    out = trainer.step(groups, on_row=lambda done, total: calls.append((done, total)))
    rows = int(out["rows"])
    assert rows >= 2
    assert calls == [(i, 2 * rows) for i in range(1, 2 * rows + 1)]


def test_split_mini_batches_keeps_order_and_balances_sizes() -> None:
    groups = random_groups(9, n_groups=5)
    parts = split_mini_batches(groups, 3)
    assert [len(p) for p in parts] == [2, 2, 1]
    assert [g for p in parts for g in p] == groups
    assert [len(p) for p in split_mini_batches(groups, 8)] == [1] * 5  # never an empty mini-batch
    assert split_mini_batches(groups, 1) == [groups]


def test_mini_batches_are_one_optimizer_step_each() -> None:
    """trainer.mini_batches=2 over two groups is exactly one step on the first group and then one
    on the second: each takes its own logprobs before its step as "old", and the IS weight corrects
    the second to the engine's logprobs (decoupled PPO)."""
    algo = AlgorithmConfig(tis_cap=2.0)
    groups = random_groups(31, n_groups=2, n_comp=4)
    split = Trainer(make_policy(True, seed=8), algo, TrainerConfig(lr=1e-2, mini_batches=2, self_check=False),
                    total_steps=4, max_tokens=8)
    out = split.step(groups)
    assert out["skipped"] == 0.0 and split.scheduler.last_epoch == 2  # two optimizer steps
    one = Trainer(make_policy(True, seed=8), algo, TrainerConfig(lr=1e-2, self_check=False),
                  total_steps=4, max_tokens=8)
    first = one.step(groups[:1])
    second = one.step(groups[1:])
    for a, b in zip(split.policy.trainable_parameters(), one.policy.trainable_parameters(), strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=0)
    assert out["completion_tokens"] == first["completion_tokens"] + second["completion_tokens"]
    assert out["grad_norm"] == pytest.approx((first["grad_norm"] + second["grad_norm"]) / 2)
    # The second mini-batch's IS weights differ from a single step's (its policy moved first).
    whole = Trainer(make_policy(True, seed=8), algo, TrainerConfig(lr=1e-2, self_check=False),
                    total_steps=4, max_tokens=8).step(groups)
    assert out["tis_weight_mean"] != pytest.approx(whole["tis_weight_mean"], abs=1e-6)


USER_ALGOS = '''
from sleuth.rewards.advantages import grpo
from sleuth.train.losses import ppo_clip


def doubled(rewards):
    return [2.0 * a for a in grpo(rewards)]


def winners_only(rewards):
    return [max(a, 0.0) for a in grpo(rewards)]


def reversed_ppo(logp, old_logp, advantages, token_seq, clip_low, clip_high):
    return ppo_clip(logp, old_logp, -advantages, token_seq, clip_low, clip_high)
'''


def _one_step(advantage: str, loss: str, groups: list[Group]) -> tuple[float, list[torch.Tensor]]:
    """(loss, weight change) of one step from the same start with the named algorithm."""
    policy = make_policy(False, seed=6)
    before = [p.detach().clone() for p in policy.trainable_parameters()]
    algo = AlgorithmConfig(advantage=advantage, loss=loss, tis_cap=None)
    trainer = Trainer(policy, algo, TrainerConfig(lr=1e-3, row_tokens=64, self_check=False), max_tokens=8)
    kept, _ = compute_advantages(groups, algo.advantage, drop_zero=True)
    out = trainer.step(kept)
    return out["loss"], [p.detach() - b for p, b in zip(policy.trainable_parameters(), before, strict=True)]


def test_user_advantage_and_loss_change_the_update(tmp_path: Path) -> None:
    """A user advantage (2 x GRPO) doubles the loss, another (GRPO's positive part) moves the weights
    differently; a user loss (PPO with the advantage negated) negates the loss and moves every weight
    the opposite way (Adam's first step is sign(g) x lr, so 2 x GRPO alone moves them the same)."""
    algos = tmp_path / "my_algos.py"
    algos.write_text(USER_ALGOS)
    groups = random_groups(11)
    for g in groups:  # rewards that are not constant within a group, so GRPO keeps every group
        g.completions[0].reward, g.completions[1].reward = 1.0, 0.0
    base_loss, base_delta = _one_step("grpo", "ppo_clip", groups)
    adv_loss, adv_delta = _one_step(f"{algos}:doubled", "ppo_clip", groups)
    neg_loss, neg_delta = _one_step("grpo", f"{algos}:reversed_ppo", groups)
    _, pos_delta = _one_step(f"{algos}:winners_only", "ppo_clip", groups)
    assert base_loss != 0.0
    assert adv_loss == pytest.approx(2 * base_loss, rel=1e-5)
    assert neg_loss == pytest.approx(-base_loss, rel=1e-5)
    moved = [d for d in base_delta if d.abs().max() > 0]
    assert moved
    for b, a, n in zip(base_delta, adv_delta, neg_delta, strict=True):
        torch.testing.assert_close(n, -b, rtol=1e-3, atol=1e-7)
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-7)
    assert any(not torch.allclose(p, b, atol=1e-7) for p, b in zip(pos_delta, base_delta, strict=True))
