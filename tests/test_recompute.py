"""MLPs and RMSNorms that rebuild their cheap activations in backward compute bit-identical
gradients and keep less between forward and backward."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from sleuth.train.kernels import recompute
from sleuth.train.kernels.lora_inputs import keep_inputs_in_base_dtype
from sleuth.train.kernels.recompute import recompute_cheap_activations


def _lora(tiny_model_dir):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    peft = get_peft_model(model, cfg, autocast_adapter_dtype=True)
    for name, p in peft.named_parameters():  # B starts at zero: give the adapter a real effect
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    keep_inputs_in_base_dtype(peft)  # as Policy does
    return peft


def _full(tiny_model_dir):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


@pytest.mark.parametrize("build", [_lora, _full], ids=["lora-bf16", "full-float32"])
def test_bit_identical_gradients_with_less_kept(tiny_model_dir, lm_backward, build):
    reference = build(tiny_model_dir)
    switched = copy.deepcopy(reference)
    layers = switched.config.num_hidden_layers
    norms = sum(type(m).__name__.endswith("RMSNorm") for m in switched.modules())
    assert recompute_cheap_activations(switched) == layers + norms  # every MLP and norm
    ids = torch.randint(0, reference.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(1))
    loss_ref, grads_ref, kept_ref = lm_backward(reference, ids)
    loss, grads, kept = lm_backward(switched, ids)
    assert torch.equal(loss, loss_ref)
    assert grads.keys() == grads_ref.keys() and grads
    for name, g in grads.items():
        assert torch.equal(g, grads_ref[name]), name
    # At least act(gate) and the product are gone from every MLP: 2 x tokens x intermediate.
    element = next(switched.parameters()).element_size()
    dropped = 2 * ids.shape[1] * switched.config.intermediate_size * element * layers
    assert kept <= kept_ref - dropped, (kept, kept_ref, dropped)
    assert switched.state_dict().keys() == reference.state_dict().keys()


def test_inference_and_a_second_backward_match(tiny_model_dir):
    reference = _lora(tiny_model_dir)
    switched = copy.deepcopy(reference)
    recompute_cheap_activations(switched)
    ids = torch.randint(0, reference.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(switched(input_ids=ids).logits, reference(input_ids=ids).logits)
    for model in (reference, switched):  # two steps: recipes hold nothing from the first
        for _ in range(2):
            model(input_ids=ids).logits.float().square().mean().backward()
    for (name, p), q in zip(switched.named_parameters(), reference.parameters(), strict=True):
        if p.requires_grad:
            assert torch.equal(p.grad, q.grad), name


class _OtherNorm(torch.nn.Module):
    """An RMSNorm by name that computes something else (Gemma-style 1 + weight)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((width,), 0.5))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return ((1 + self.weight) * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class _FusedMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Linear(8, 32)
        self.down_proj = torch.nn.Linear(16, 8)


def test_modules_it_must_not_touch():
    OtherRMSNorm = type("GemmaLikeRMSNorm", (_OtherNorm,), {})
    model = torch.nn.Sequential(OtherRMSNorm(8), _FusedMLP())
    assert recompute_cheap_activations(model) == 0
    assert "forward" not in vars(model[0])  # the class's own forward is left in place


def test_replaced_tensors_are_freed_after_forward(tiny_model_dir, monkeypatch):
    """What a recipe replaces is gone once forward returns (autograd keeps the pack hook itself)."""
    model = _lora(tiny_model_dir)
    recompute_cheap_activations(model)
    replaced = []
    add = recompute.Recipes.add

    def tracking_add(self, tensor, build):
        replaced.append(weakref.ref(tensor))
        add(self, tensor, build)

    monkeypatch.setattr(recompute.Recipes, "add", tracking_add)
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(3))
    loss = model(input_ids=ids).logits.float().square().mean()
    gc.collect()
    assert replaced and all(ref() is None for ref in replaced)
    loss.backward()  # rebuilt from what is kept


def test_grouped_query_attention_keeps_the_key_value_heads_only(count_saved):
    """The packed attention keeps the key/value heads, not their repeats, and gives the same gradients."""
    from sleuth.records import Completion, Group, Problem
    from sleuth.train.kernels.packed_attention import row_layout
    from sleuth.train.packing import pack_groups

    prompt, comps = list(range(3, 40)), [[50, 51, 52], [60, 61, 62, 63, 64]]
    group = Group(Problem("p", [], None), prompt, [Completion(prompt, c, [0.0] * len(c), "stop", "") for c in comps],
                  [1.0, -1.0])
    (row,) = pack_groups([group], 256).rows
    layout = row_layout(row)
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, h, row.length, 8, generator=gen) for h in (6, 2, 2))

    def run(rep_inside: bool):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        with count_saved() as kept:
            keys, values = (kk, vv) if rep_inside else (t.repeat_interleave(3, dim=1) for t in (kk, vv))
            out = layout.attend(qq, keys, values, None)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return out.detach(), [t.grad for t in (qq, kk, vv)], sum(kept.values())

    out_ref, grads_ref, kept_ref = run(rep_inside=False)
    out, grads, kept = run(rep_inside=True)
    assert torch.equal(out, out_ref)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert torch.equal(g, g_ref)
    repeats = 2 * (6 - 2) * row.length * 8 * 4  # key and value: the 4 repeated heads of 6, float32
    assert kept <= kept_ref - repeats, (kept, kept_ref, repeats)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_training_row_also_rebuilds_norm_outputs_and_the_attention_output(tiny_model_dir, count_saved,
                                                                              monkeypatch, dtype):
    """The trainer's packed-row forward (Policy, LoRA, the sleuth_packed attention): besides the MLP's
    two, each layer's two norm outputs and the output projection's input (all saved by LoRA layers)
    are rebuilt in backward; every gradient stays bit-identical."""
    from sleuth.config import LoraConfig as SleuthLora
    from sleuth.config import ModelConfig
    from sleuth.records import Completion, Group, Problem
    from sleuth.train import policy as policy_module
    from sleuth.train.packing import pack_groups

    prompt, comps = list(range(3, 60)), [[70, 71, 72, 73], [80, 81], [90, 91, 92]]
    group = Group(Problem("p", [], None), prompt,
                  [Completion(prompt, c, [0.0] * len(c), "stop", "") for c in comps], [1.0, -0.5, -0.5])
    (row,) = pack_groups([group], 256).rows
    real = policy_module.recompute_cheap_activations

    def run(switch: bool):
        monkeypatch.setattr(policy_module, "recompute_cheap_activations", real if switch else lambda model: 0)
        torch.manual_seed(0)
        cfg = ModelConfig(path=str(tiny_model_dir), dtype=dtype, lora=SleuthLora(enabled=True, rank=4))
        policy = policy_module.Policy.from_config(cfg, need_reference=False)
        for name, p in policy.model.named_parameters():  # B starts at zero: give the adapter an effect
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(len(name)))
        with count_saved() as kept:
            logp, _ = policy.row_logprobs(row)
        (logp * row.advantages).sum().backward()
        grads = {n: p.grad for n, p in policy.model.named_parameters() if p.requires_grad}
        return logp.detach(), grads, sum(kept.values()), policy.causal_lm.config

    logp_ref, grads_ref, kept_ref, config = run(switch=False)
    logp, grads, kept, _ = run(switch=True)
    assert torch.equal(logp, logp_ref)
    assert grads.keys() == grads_ref.keys() and grads
    for name, g in grads.items():
        assert torch.equal(g, grads_ref[name]), name
    element = 2 if dtype == "bfloat16" else 4
    per_layer = (2 * config.intermediate_size + 3 * config.hidden_size) * element  # per token
    if dtype == "bfloat16":  # and the norms' float32 upcasts of their inputs
        per_layer += 2 * config.hidden_size * 4
    assert kept <= kept_ref - config.num_hidden_layers * row.length * per_layer, (kept, kept_ref)
