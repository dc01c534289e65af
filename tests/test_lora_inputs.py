"""LoRA layers that keep their bf16 input for backward compute what PEFT's float32 copies did, and
keep less."""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from sleuth.train.kernels.lora_inputs import UpcastLinear, keep_inputs_in_base_dtype


def _peft(tiny_model_dir, dropout: float = 0.0):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear", task_type="CAUSAL_LM")
    peft = get_peft_model(model, cfg, autocast_adapter_dtype=True)
    for name, p in peft.named_parameters():  # B starts at zero: give the adapter a real effect
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return peft


def test_same_loss_and_gradients_with_less_kept(tiny_model_dir, lm_backward):
    reference = _peft(tiny_model_dir)
    switched = copy.deepcopy(reference)
    n = keep_inputs_in_base_dtype(switched)
    assert n == sum(1 for m in switched.modules() if type(m).__name__ == "Linear" and hasattr(m, "lora_A"))
    assert n > 0 and any(isinstance(m, UpcastLinear) for m in switched.modules())
    ids = torch.randint(0, reference.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(1))
    loss_ref, grads_ref, kept_ref = lm_backward(reference, ids)
    loss, grads, kept = lm_backward(switched, ids)
    assert grads.keys() == grads_ref.keys() and any("lora_A" in k for k in grads)
    assert torch.equal(loss, loss_ref)
    for name, g in grads.items():
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, grads_ref[name], rtol=1e-5, atol=1e-7, msg=name)
    assert kept < kept_ref  # the float32 copies of inputs are gone
    # The state dict (what checkpoints, sync and export read) is unchanged.
    assert switched.state_dict().keys() == reference.state_dict().keys()


def test_layers_it_must_not_touch(tiny_model_dir):
    with_dropout = _peft(tiny_model_dir, dropout=0.1)  # the dropout mask is drawn on the float32 input
    assert keep_inputs_in_base_dtype(with_dropout) == 0
    torch.manual_seed(0)
    same_dtype = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    assert keep_inputs_in_base_dtype(same_dtype) == 0  # nothing is cast, nothing to save
