from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from sleuth.config import LoraConfig, ModelConfig
from sleuth.errors import UserError
from sleuth.records import Completion, Group, Problem
from sleuth.testing.tiny_model import write_tiny_model
from sleuth.train.kernels.packed_attention import backend_for
from sleuth.train.packing import pack_groups
from sleuth.train.policy import Policy

IDS = torch.tensor([[5, 9, 60, 61, 62, 70, 258]])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), hidden=32, layers=2)


def cfg(path: Path, lora: bool, **kw: object) -> ModelConfig:
    return ModelConfig(path=str(path), dtype="float32", lora=LoraConfig(enabled=lora, rank=4), **kw)


def perturb(policy: Policy, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen).to(p.device))


def logits(model: torch.nn.Module) -> torch.Tensor:
    """The model's logits for IDS, on the CPU (the inputs go to the model's own device)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        return model(input_ids=IDS.to(device)).logits.cpu()


def test_lora_policy_reference_is_the_base_model(tiny_dir: Path) -> None:
    policy = Policy.from_config(cfg(tiny_dir, True), need_reference=True)
    assert policy.is_lora and policy.attn_backend == backend_for(policy.device)
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    trainable = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert any("mlp.down_proj" in n for n in trainable)  # all-linear by default
    perturb(policy)
    assert not torch.allclose(logits(policy.model), logits(base))
    with policy.reference() as ref:
        torch.testing.assert_close(logits(ref), logits(base))
    # The adapter is active again after the context.
    assert not torch.allclose(logits(policy.model), logits(base))


def test_sync_state_is_merged_and_leaves_adapter_alone(tiny_dir: Path) -> None:
    policy = Policy.from_config(cfg(tiny_dir, True), need_reference=False)
    perturb(policy)
    before = logits(policy.model)
    adapter = {n: p.detach().clone() for n, p in policy.model.named_parameters() if "lora_" in n}
    state = dict(policy.sync_state())
    fresh = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    assert set(state) == {n for n, _ in fresh.named_parameters()}
    fresh.load_state_dict(state, strict=True)
    torch.testing.assert_close(logits(fresh), before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits(policy.model), before)
    for n, p in policy.model.named_parameters():
        if "lora_" in n:
            assert torch.equal(p, adapter[n])


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_export_merged_and_save_load(tiny_dir: Path, tmp_path: Path, lora: bool) -> None:
    policy = Policy.from_config(cfg(tiny_dir, lora), need_reference=False)
    perturb(policy, 1)
    expected = logits(policy.model)
    out = policy.export_merged(tmp_path / "merged")
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    torch.testing.assert_close(logits(loaded), expected, rtol=1e-5, atol=1e-5)
    assert (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file()
    policy.save(tmp_path / "saved")
    if lora:
        assert (tmp_path / "saved" / "adapter_model.safetensors").is_file()
    other = Policy.from_config(cfg(tiny_dir, lora), need_reference=False)
    assert not torch.allclose(logits(other.model), expected)
    other.load_weights(tmp_path / "saved")
    torch.testing.assert_close(logits(other.model), expected)
    with pytest.raises(UserError, match="safetensors"):
        other.load_weights(tmp_path / "empty-nothing-here")


def test_full_reference_is_a_frozen_copy_only_when_needed(tiny_dir: Path) -> None:
    policy = Policy.from_config(cfg(tiny_dir, False), need_reference=True)
    group = Group(Problem("p", [], None), [5, 9], [Completion([5, 9], [60, 61], [-1.0, -1.0], "stop", "")],
                  [1.0])
    (row,) = pack_groups([group], 64).rows
    ref_before = policy.reference_logprobs(row)
    perturb(policy)
    torch.testing.assert_close(policy.reference_logprobs(row), ref_before)
    assert not torch.allclose(policy.row_logprobs(row)[0].detach(), ref_before)
    no_ref = Policy.from_config(cfg(tiny_dir, False), need_reference=False)
    with pytest.raises(RuntimeError, match="without a reference"), no_ref.reference():
        pass


def test_gradient_checkpointing_gives_the_same_gradients(tiny_dir: Path) -> None:
    group = Group(Problem("p", [], None), [5, 9, 11],
                  [Completion([5, 9, 11], [60, 61, 62], [-1.0] * 3, "stop", ""),
                   Completion([5, 9, 11], [70], [-1.0], "stop", "")], [1.0, -1.0])
    (row,) = pack_groups([group], 64).rows
    grads = []
    for ckpt in (False, True):
        policy = Policy.from_config(cfg(tiny_dir, False, gradient_checkpointing=ckpt), need_reference=False)
        logp, _ = policy.row_logprobs(row)
        (logp * row.advantages.to(logp.device)).sum().backward()
        grads.append([p.grad.clone() for p in policy.trainable_parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_last_layers_adapts_only_the_top_layers_and_backward_stops_below(tiny_dir: Path, caplog) -> None:
    """model.lora.last_layers=1 on the 2-layer model: LoRA on layer 1 alone (no frozen-weight
    warning for layer 0), layer 0 runs forward without autograd, and with the same layer-1 adapter
    (and a zero layer-0 update in the all-layer one) the gradients equal the all-layer adapter's."""
    group = Group(Problem("p", [], None), [5, 9, 11],
                  [Completion([5, 9, 11], [60, 61, 62], [-1.0] * 3, "stop", ""),
                   Completion([5, 9, 11], [70], [-1.0], "stop", "")], [1.0, -1.0])
    (row,) = pack_groups([group], 64).rows
    with caplog.at_level("WARNING"):
        every, top = (Policy.from_config(ModelConfig(path=str(tiny_dir), dtype="float32", lora=LoraConfig(
            enabled=True, rank=4, last_layers=last)), need_reference=False) for last in (None, 1))
    assert "frozen" not in caplog.text
    perturb(every)
    named = dict(every.model.named_parameters())
    with torch.no_grad():
        for n, p in named.items():
            if ".layers.0." in n and "lora_B" in n:
                p.zero_()
        for n, p in top.model.named_parameters():
            if p.requires_grad:
                p.copy_(named[n])
    needs_grad = []
    layer0 = top.causal_lm.model.layers[0]
    layer0.register_forward_hook(lambda m, i, o: needs_grad.append((o[0] if isinstance(o, tuple) else o).requires_grad))
    grads = []
    for policy in (every, top):
        logp, _ = policy.row_logprobs(row)
        (logp * row.advantages.to(logp.device)).sum().backward()
        grads.append({n: p.grad for n, p in policy.model.named_parameters() if p.requires_grad})
    assert needs_grad == [False]
    assert {n.split(".layers.")[1].split(".")[0] for n in grads[0]} == {"0", "1"}
    assert {n.split(".layers.")[1].split(".")[0] for n in grads[1]} == {"1"}
    assert all(grads[1][n].abs().sum() > 0 for n in grads[1])
    for n, g in grads[1].items():
        torch.testing.assert_close(g, grads[0][n], rtol=1e-5, atol=1e-7)


def test_missing_model_folder_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="neither a folder nor a known alias"):
        Policy.from_config(cfg(tmp_path / "nope", True), need_reference=False)


@pytest.mark.parametrize(("lora_dtype", "expected"), [("float32", torch.float32), ("base", torch.bfloat16)])
def test_lora_adapter_dtype(tiny_dir: Path, lora_dtype: str, expected: torch.dtype) -> None:
    """On a bf16 base, adapters are float32 (PEFT's autocast) or the base's dtype when asked."""
    model_cfg = ModelConfig(path=str(tiny_dir), dtype="bfloat16",
                            lora=LoraConfig(enabled=True, rank=4, dtype=lora_dtype))
    policy = Policy.from_config(model_cfg, need_reference=False)
    dtypes = {p.dtype for p in policy.trainable_parameters()}
    assert dtypes == {expected}
    assert next(policy.causal_lm.parameters()).dtype == torch.bfloat16
