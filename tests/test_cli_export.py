import shutil
from io import StringIO

import pytest
import torch
from safetensors.torch import load_file

from sleuth.cli import main
from sleuth.config import load_config
from sleuth.loop.train import train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_dir, lowercase_task):
    root = tmp_path_factory.mktemp("export")
    tiny = tiny_model_dir
    cfg = load_config(None, [
        f"model.path={tiny}", "model.dtype=float32", "model.lora.rank=4", f"task.name={lowercase_task}:problems",
        "task.eval_size=2", "task.verifier_isolation=inline", "rollout.engine=hf", "rollout.max_tokens=6",
        "rollout.samples_per_task=4", "loop.iterations=2", "loop.tasks_per_iteration=2", "loop.checkpoint_every=1",
        "trainer.lr=0.05", "eval.k=2", "logging.tensorboard=false",
    ])
    train(cfg, root / "run", out=StringIO())
    return root / "run", tiny


def test_export_merges_latest_checkpoint(run_dir, tmp_path, capsys):
    run, tiny = run_dir
    out = tmp_path / "merged"
    assert main(["export", str(run), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    merged = load_file(str(out / "model.safetensors"))
    # The end-of-run export (RUN_DIR/model) and a re-export of the last checkpoint agree exactly.
    final = load_file(str(run / "model" / "model.safetensors"))
    assert merged.keys() == final.keys()
    assert all(torch.equal(merged[k], final[k]) for k in merged)
    base = load_file(str(tiny / "model.safetensors"))
    assert any(not torch.equal(merged[k], base[k]) for k in base)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("hi", return_tensors="pt").input_ids
    assert model(ids).logits.shape[-1] == 272


def test_export_earlier_checkpoint_differs(run_dir, tmp_path):
    run, _ = run_dir
    assert main(["export", str(run), "--out", str(tmp_path / "first"), "--checkpoint", "iter-000001"]) == 0
    assert main(["export", str(run), "--out", str(tmp_path / "last")]) == 0
    first = load_file(str(tmp_path / "first" / "model.safetensors"))
    last = load_file(str(tmp_path / "last" / "model.safetensors"))
    assert any(not torch.equal(first[k], last[k]) for k in first)


def test_export_needs_only_the_policy_files_of_a_checkpoint(run_dir, tmp_path, capsys):
    """trainer.pt deleted to free disk: the weights still export; a damaged weights file does not."""
    run, _ = run_dir
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    last = sorted((copy / "checkpoints").glob("iter-*"))[-1]
    (last / "trainer.pt").unlink()
    assert main(["export", str(copy), "--out", str(tmp_path / "a"), "--checkpoint", last.name]) == 0
    merged = load_file(str(tmp_path / "a" / "model.safetensors"))
    final = load_file(str(run / "model" / "model.safetensors"))
    assert all(torch.equal(merged[k], final[k]) for k in final)
    weights = next(p for p in (last / "policy").rglob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    assert main(["export", str(copy), "--out", str(tmp_path / "b"), "--checkpoint", last.name]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "is not usable: policy/" in err and not (tmp_path / "b").exists(), err


def test_export_bad_inputs(run_dir, tmp_path, capsys):
    run, _ = run_dir
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    cases = [
        (["export", str(tmp_path), "--out", str(tmp_path / "x")], "not a sleuth run directory"),
        (["export", str(run), "--out", str(taken)], "already exists and is not an empty folder"),
        (["export", str(run), "--out", str(tmp_path / "y"), "--checkpoint", "iter-000099"], "no checkpoint"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("sleuth: error: ") and message in err[-1], err
    assert (taken / "keep.txt").read_text() == "mine"
    assert not (tmp_path / "y").exists()


def test_export_adapter_only_matches_the_merged_export(run_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run, tiny = run_dir
    assert main(["export", str(run), "--out", str(tmp_path / "merged")]) == 0
    assert main(["export", str(run), "--out", str(tmp_path / "adapter"), "--adapter-only"]) == 0
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = torch.tensor([list(range(20, 50))])
    with torch.no_grad():
        # W + BA merged once vs x@W + (x@B)@A: float32 rounding only (measured 1.4e-5 on logits ~2.4).
        assert torch.allclose(adapted(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-4, rtol=0)
