import errno
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from sleuth.errors import UserError
from sleuth.run.checkpoint import CheckpointManager, verify_manifest, write_manifest


class LinearPolicy:
    """A real trainable module with the save/load pair the checkpoint manager needs."""

    def __init__(self, seed: int = 0, fail_on_save: Exception | None = None) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(4, 3)
        self.fail_on_save = fail_on_save

    def save(self, directory):
        Path(directory).mkdir(parents=True)
        save_file(self.model.state_dict(), str(Path(directory) / "weights.safetensors"))
        if self.fail_on_save is not None:
            raise self.fail_on_save

    def load_weights(self, directory):
        self.model.load_state_dict(load_file(str(Path(directory) / "weights.safetensors")))


def train_steps(policy: LinearPolicy, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(8, 4)
        loss = policy.model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_roundtrip_continues_exactly(tmp_path):
    policy = LinearPolicy()
    opt = torch.optim.AdamW(policy.model.parameters(), lr=1e-2)
    train_steps(policy, opt, 3)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"iteration": 1}\n')
    mgr = CheckpointManager(tmp_path / "ckpt", keep_last=2)
    path = mgr.save(3, policy, opt, {"data_position": 24, "val_reward": 0.5}, metrics_file=metrics)
    assert (path / "metrics.jsonl").read_text() == '{"iteration": 1}\n'
    assert json.loads((path / "state.json").read_text())["data_position"] == 24

    # Uninterrupted continuation.
    train_steps(policy, opt, 2)
    expected = {k: v.clone() for k, v in policy.model.state_dict().items()}
    expected_draws = (random.random(), float(np.random.rand()), torch.rand(1).item())

    # Fresh objects, different init and RNG, restored from the checkpoint.
    random.seed(123)
    np.random.seed(123)
    other = LinearPolicy(seed=99)
    other_opt = torch.optim.AdamW(other.model.parameters(), lr=1e-2)
    state = mgr.restore(mgr.find("latest"), other, other_opt)
    assert state["iteration"] == 3 and state["data_position"] == 24
    train_steps(other, other_opt, 2)
    for k, v in other.model.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == expected_draws


# A full disk as Python reports it, and as safetensors' writer does (its own exception type; seen in a
# run whose disk filled while saving its last checkpoint).
@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
                                   SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")],
                         ids=["oserror", "safetensors"])
def test_failed_save_leaves_previous_intact(tmp_path, error):
    policy = LinearPolicy()
    opt = torch.optim.SGD(policy.model.parameters(), lr=0.1)
    mgr = CheckpointManager(tmp_path, keep_last=3)
    mgr.save(1, policy, opt, {})
    before = (tmp_path / "iter-000001" / "policy" / "weights.safetensors").read_bytes()
    with pytest.raises(UserError) as err:
        mgr.save(2, LinearPolicy(seed=5, fail_on_save=error), opt, {})
    assert str(err.value) == (f"cannot write {tmp_path / 'iter-000002'}: No space left on device (the disk is "
                              "full); iter-000001 is intact and --resume continues from it")
    assert [c.iteration for c in mgr.list()] == [1]
    assert (tmp_path / "iter-000001" / "policy" / "weights.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter-000001"]


def test_killed_save_leftovers_are_ignored_and_cleaned(tmp_path):
    policy = LinearPolicy()
    opt = torch.optim.SGD(policy.model.parameters(), lr=0.1)
    mgr = CheckpointManager(tmp_path, keep_last=2)
    mgr.save(1, policy, opt, {})
    # What SIGKILL in the middle of a save leaves: a temp folder with part of a checkpoint, and a
    # folder with a valid name but no state.json would be equally ignored.
    partial = tmp_path / ".tmp-iter-000002-pid999999999-abc"
    (partial / "policy").mkdir(parents=True)
    (partial / "state.json").write_text("{}")
    (tmp_path / "iter-000003").mkdir()
    assert [c.iteration for c in mgr.list()] == [1]
    mgr.save(4, policy, opt, {})
    assert not partial.exists()
    assert [c.iteration for c in mgr.list()] == [1, 4]


def test_retention_keeps_last_and_best(tmp_path):
    policy = LinearPolicy()
    opt = torch.optim.SGD(policy.model.parameters(), lr=0.1)
    mgr = CheckpointManager(tmp_path, keep_last=2)
    vals = {1: 0.1, 2: 0.9, 3: None, 4: 0.3, 5: 0.2}
    for it, val in vals.items():
        mgr.save(it, policy, opt, {"val_reward": val})
    assert [c.iteration for c in mgr.list()] == [2, 4, 5]
    assert mgr.find("best").iteration == 2
    assert mgr.find("latest").iteration == 5
    assert mgr.find("iter-000004").iteration == 4
    assert mgr.find(str(tmp_path / "iter-000005")).iteration == 5
    with pytest.raises(UserError, match="no checkpoint 'iter-000001'"):
        mgr.find("iter-000001")
    # Re-saving an iteration (a resumed run redoing it) replaces the folder.
    mgr.save(5, policy, opt, {"val_reward": 0.95})
    assert mgr.find("best").iteration == 5
    assert [c.iteration for c in mgr.list()] == [4, 5]


def test_empty_directory(tmp_path):
    mgr = CheckpointManager(tmp_path / "none")
    assert mgr.latest() is None and mgr.best() is None
    with pytest.raises(UserError, match="no valid checkpoint"):
        mgr.find("latest")


def corrupt(path: Path, how: str) -> None:
    if how == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        path.write_bytes(b"\x80\x04garbage")
    elif how == "delete":
        path.unlink()


@pytest.mark.parametrize("file, how", [
    ("policy/weights.safetensors", "truncate"), ("trainer.pt", "truncate"), ("rng.json", "garbage"),
    ("state.json", "delete"), ("manifest.json", "delete"), ("manifest.json", "garbage"),
])
def test_corrupt_latest_checkpoint_falls_back_to_the_newest_valid(tmp_path, file, how):
    policy = LinearPolicy()
    opt = torch.optim.AdamW(policy.model.parameters(), lr=1e-2)
    mgr = CheckpointManager(tmp_path, keep_last=3, warn=(warnings := []).append)
    mgr.save(1, policy, opt, {"data_position": 8})
    expected = {k: v.clone() for k, v in policy.model.state_dict().items()}
    train_steps(policy, opt, 1)
    mgr.save(2, policy, opt, {"data_position": 16})
    corrupt(tmp_path / "iter-000002" / file, how)
    before = sorted(p.name for p in tmp_path.iterdir())

    other = LinearPolicy(seed=7)
    restored = mgr.restore_latest(other, torch.optim.AdamW(other.model.parameters(), lr=1e-2))
    assert restored is not None and restored.iteration == 1 and restored.state["data_position"] == 8
    for k, v in other.model.state_dict().items():
        assert torch.equal(v, expected[k]), k
    if file != "state.json":  # without state.json the folder is not a checkpoint at all
        assert len(warnings) == 1 and warnings[0].startswith("skipped checkpoint iter-000002: ")
        assert "\n" not in warnings[0]
    assert mgr.find("latest").iteration == 1
    # a reader of the weights alone (export, eval, model.init) checks only policy/
    expected_for_weights = 1 if file.startswith(("policy/", "state.json", "manifest.json")) else 2
    assert mgr.find("latest", only="policy").iteration == expected_for_weights
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing deleted


def test_no_usable_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    policy = LinearPolicy()
    opt = torch.optim.SGD(policy.model.parameters(), lr=0.1)
    mgr = CheckpointManager(tmp_path, warn=lambda text: None)
    mgr.save(1, policy, opt, {})
    corrupt(tmp_path / "iter-000001" / "trainer.pt", "truncate")
    with pytest.raises(UserError, match=r"none of the 1 checkpoints in .* is usable"):
        mgr.restore_latest(policy, opt)
    with pytest.raises(UserError, match=r"iter-000001 is not usable: trainer.pt has .* bytes, the manifest says"):
        mgr.find("iter-000001")
    assert CheckpointManager(tmp_path / "none").restore_latest(policy, opt) is None


def test_a_manifest_of_the_wrong_shape_is_unreadable_not_a_crash(tmp_path):
    folder = tmp_path / "iter-000001"
    (folder / "policy").mkdir(parents=True)
    (folder / "policy" / "w.bin").write_bytes(b"1234")
    (folder / "trainer.pt").write_bytes(b"x")
    write_manifest(folder)
    assert verify_manifest(folder) is None and verify_manifest(folder, only="policy") is None
    manifest = json.loads((folder / "manifest.json").read_text())
    for files in ([1, 2], {"policy/w.bin": 3}, "text"):
        (folder / "manifest.json").write_text(json.dumps({**manifest, "files": files}))
        assert verify_manifest(folder).startswith("unreadable manifest.json"), files
    (folder / "manifest.json").write_text(json.dumps({**manifest, "files": {"trainer.pt": manifest["files"]["trainer.pt"]}}))
    assert verify_manifest(folder) is None
    assert verify_manifest(folder, only="policy") == "manifest.json lists no policy/ files"
