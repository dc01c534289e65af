"""FSDP2 ranks (2 real processes, gloo, float32) compute the single-process step, and sharded
checkpoints move between 2 ranks and 1 plain process."""

from __future__ import annotations

import gc
import pickle
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from sleuth.config import AlgorithmConfig, TrainerConfig
from sleuth.errors import UserError
from sleuth.train.fsdp import balance_rows, empty_row
from sleuth.train.packing import pack_groups
from sleuth.train.sharded import is_sharded_checkpoint, load_checkpoint, save_checkpoint
from sleuth.train.step import Trainer
from test_step import make_policy, random_groups

WORLD = 2
ROW_TOKENS = 40
ALGO = AlgorithmConfig(loss="ppo_clip", aggregation="token_mean", kl_beta=0.1, tis_cap=2.0, entropy_coef=0.05)
SEED = {True: 3, False: 4}


def trainer_cfg() -> TrainerConfig:
    # A large lr makes a step move the weights visibly, so "equal after the step" means something.
    return TrainerConfig(lr=1e-2, grad_clip=0.5, row_tokens=ROW_TOKENS, weight_decay=0.01)


def batch(lora: bool) -> list:
    # One large group and several small ones: 2 ranks get an unequal number of rows.
    big = random_groups(SEED[lora] + 100, n_groups=1, n_comp=6)
    return big + random_groups(SEED[lora], n_groups=4, n_comp=2)


def weights(policy: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.model.state_dict().items()}


def optimizer_state(policy: Any, trainer: Trainer) -> dict[str, dict[str, torch.Tensor]]:
    """Adam state keyed by parameter name (plain process)."""
    names = {id(p): n for n, p in policy.model.named_parameters()}
    return {names[id(p)]: {k: v.detach().clone() for k, v in s.items()} for p, s in trainer.optimizer.state.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, out: str, plain_ckpt: str) -> None:
    """One FSDP2 rank: a LoRA step, a full step, a sharded save, and a load of a plain save."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from sleuth.train.fsdp import FSDPTrainer, gathered, init_distributed

    torch.set_num_threads(1)
    init_distributed(rank, WORLD, "127.0.0.1", port)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    results: dict[str, Any] = {}
    for lora in (True, False):
        policy = make_policy(lora, need_reference=True, seed=SEED[lora])
        trainer = FSDPTrainer(policy, ALGO, trainer_cfg(), max_tokens=8)
        metrics = trainer.step(batch(lora))
        with gathered(policy):
            merged = {n: t.clone() for n, t in policy.sync_state()}
        model_sd, optim_sd = get_state_dict(policy.model, trainer.optimizer, options=full)
        results[lora] = {"metrics": metrics, "shares": trainer.last_shares, "weights": model_sd,
                         "merged": merged, "optimizer": optim_sd.get("state")}
        if not lora:
            save_checkpoint(Path(out) / "sharded", policy, trainer)
    # The other direction: a checkpoint written by one plain process, loaded into 2 ranks.
    policy = make_policy(False, need_reference=True, seed=7)
    trainer = FSDPTrainer(policy, ALGO, trainer_cfg(), max_tokens=8)
    load_checkpoint(plain_ckpt, policy, trainer)
    model_sd, optim_sd = get_state_dict(policy.model, trainer.optimizer, options=full)
    results["loaded"] = {"weights": model_sd, "optimizer": optim_sd.get("state")}  # rank 0's only
    if rank == 0:
        torch.save(results, Path(out) / "rank0.pt")
    # Both ranks leave together: a rank that tears gloo down while its peer still has work in
    # flight can abort in C++ ("terminate called without an active exception"; seen once in CI).
    torch.distributed.barrier()
    del policy, trainer, results, model_sd, optim_sd
    gc.collect()  # FSDP's cycles hold gloo work objects; free them while the interpreter is whole
    torch.distributed.destroy_process_group()


def single_process(lora: bool) -> dict[str, Any]:
    policy = make_policy(lora, need_reference=True, seed=SEED[lora])
    trainer = Trainer(policy, ALGO, trainer_cfg(), max_tokens=8)
    metrics = trainer.step(batch(lora))
    return {"metrics": metrics, "weights": weights(policy), "merged": dict(policy.sync_state()),
            "optimizer": optimizer_state(policy, trainer), "policy": policy, "trainer": trainer}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the 2-rank session once (real processes); return rank 0's results and the plain save."""
    out = tmp_path_factory.mktemp("fsdp")
    plain = single_process(False)  # a plain-process step, saved sharded for the ranks to load
    plain_ckpt = out / "plain"
    save_checkpoint(plain_ckpt, plain["policy"], plain["trainer"])
    mp.spawn(_rank_main, args=(free_port(), str(out), str(plain_ckpt)), nprocs=WORLD, join=True)
    results = torch.load(out / "rank0.pt", weights_only=False)
    results["dir"], results["plain"] = out, plain
    return results


def assert_close_rel(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> None:
    """|a - b| <= rel * |b| in the tensor's 2-norm.

    Per element is too strict after an AdamW step: its first update is about lr * sign(gradient),
    so a gradient element near zero (summed in another order over ranks) may flip its update.
    """
    err = float((a.double() - b.double()).norm()) / max(float(b.double().norm()), 1e-30)
    assert err <= rel, f"relative difference {err:.3g} > {rel}"


ADAM_EPS = 1e-8
"""torch.optim.AdamW's eps, which sleuth's optimizer keeps."""


def well_conditioned(state: dict[str, torch.Tensor] | None, like: torch.Tensor) -> torch.Tensor:
    """The elements whose first AdamW update, lr * g / (|g| + eps), does not hang on g's last bits:
    |g| above 1000 eps. Where the terms of a gradient element cancel, summing them in another order
    (over ranks) changes it by percents (measured: 6% at |g| = 2e-8, which moved that weight by
    1.4e-4 with lr 1e-2); such elements are compared through exp_avg instead. No Adam state: all."""
    if state is None:
        return torch.ones_like(like, dtype=torch.bool)
    return state["exp_avg"].abs() / (1 - trainer_cfg().betas[0]) > 1000 * ADAM_EPS


@pytest.mark.slow
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_two_ranks_step_equals_single_process(ranks: dict[str, Any], lora: bool) -> None:
    got = ranks[lora]
    want = ranks["plain"] if not lora else single_process(True)
    shares = got["shares"]
    assert len(shares[0]) != len(shares[1]), f"rows per rank should differ: {shares}"
    for key in ("loss", "grad_norm", "kl", "entropy", "clip_frac_low", "clip_frac_high"):
        assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5, abs=1e-9), key
    assert got["metrics"]["rows"] == want["metrics"]["rows"]
    assert got["metrics"]["skipped"] == 0.0
    assert set(got["weights"]) == set(want["weights"])
    moved = 0
    before = make_policy(lora, need_reference=False, seed=SEED[lora]).model.state_dict()
    for name, w in want["weights"].items():
        keep = well_conditioned(want["optimizer"].get(name), w)
        assert_close_rel(got["weights"][name][keep], w[keep])
        moved += not torch.equal(before[name], w)
    assert moved > 0  # the step changed weights, so equality is not trivially true
    for name, t in want["merged"].items():  # the full merged weights a weight sync would send
        keep = well_conditioned(want["optimizer"].get(name), t)
        assert_close_rel(got["merged"][name][keep], t[keep])
    for name, state in want["optimizer"].items():  # exp_avg = (1 - beta1) x the clipped gradient
        torch.testing.assert_close(got["optimizer"][name]["exp_avg"], state["exp_avg"], rtol=1e-4,
                                   atol=1e-5 * float(state["exp_avg"].abs().max()))


@pytest.mark.slow
def test_two_rank_checkpoint_loads_into_one_process(ranks: dict[str, Any]) -> None:
    directory = ranks["dir"] / "sharded"
    assert is_sharded_checkpoint(directory)
    policy = make_policy(False, need_reference=True, seed=11)  # different weights: the load must replace them all
    trainer = Trainer(policy, ALGO, trainer_cfg(), max_tokens=8)
    load_checkpoint(directory, policy, trainer)
    saved = ranks[False]
    for name, w in weights(policy).items():
        assert torch.equal(w, saved["weights"][name]), name
    state = optimizer_state(policy, trainer)
    assert set(state) == set(saved["optimizer"])
    for name, s in state.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s[key], saved["optimizer"][name][key]), (name, key)


@pytest.mark.slow
def test_one_process_checkpoint_loads_into_two_ranks(ranks: dict[str, Any]) -> None:
    plain, loaded = ranks["plain"], ranks["loaded"]
    for name, w in plain["weights"].items():
        assert torch.equal(loaded["weights"][name], w), name
    for name, s in plain["optimizer"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(loaded["optimizer"][name][key], s[key]), (name, key)


def test_balance_rows_spreads_tokens_and_keeps_order() -> None:
    groups = batch(True)
    rows = pack_groups(groups, ROW_TOKENS).rows
    shares = balance_rows(rows, 2)
    assert sorted(i for s in shares for i in s) == list(range(len(rows)))
    assert all(s == sorted(s) for s in shares)
    loads = [sum(rows[i].n_real_tokens for i in s) for s in shares]
    assert max(loads) - min(loads) <= max(r.n_real_tokens for r in rows)
    assert balance_rows(rows[:1], 3) == [[0], [], []]


def test_empty_row_is_a_valid_two_token_row() -> None:
    row = empty_row()
    assert row.n_real_tokens == 2 and row.target_ids.numel() == 1 and float(row.advantages.sum()) == 0.0


class _Boom:
    def __reduce__(self):  # what a crafted pickle does: call something on load
        return (Path.touch, (Path("/nonexistent-dir/never"),))


def test_checkpoint_index_that_would_run_code_is_refused(tmp_path: Path) -> None:
    policy = make_policy(True, seed=2)
    trainer = Trainer(policy, AlgorithmConfig(), trainer_cfg(), max_tokens=8)
    save_checkpoint(tmp_path / "ckpt", policy, trainer)
    fresh = make_policy(True, seed=3)
    load_checkpoint(tmp_path / "ckpt", fresh)  # the genuine index loads
    for name, w in weights(policy).items():
        if ".lora_" in name:
            assert torch.equal(weights(fresh)[name], w), name
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(UserError, match="refused"):
        load_checkpoint(tmp_path / "ckpt", fresh)
