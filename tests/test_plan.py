"""cluster/plan.py: parameter counts from config.json, the memory plan and its warnings."""

import json

import pytest

from sleuth.cluster.plan import ModelShape, describe, trainer_memory
from sleuth.cluster.runtime import Node
from sleuth.config import load_config
from sleuth.system.models import layer_linear_names
from sleuth.testing.tiny_model import write_tiny_model

QWEN_14B = {"model_type": "qwen2", "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 48,
            "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064,
            "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_counts_match_the_model_and_its_lora_adapter(tiny):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    shape = ModelShape.from_folder(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny)
    assert shape.params() == sum(p.numel() for p in model.parameters())
    peft = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    assert shape.lora_params(4, "all-linear") == sum(p.numel() for p in peft.parameters() if p.requires_grad)
    base = AutoModelForCausalLM.from_pretrained(tiny)
    top = get_peft_model(base, LoraConfig(r=4, target_modules=layer_linear_names(base),
                                          layers_to_transform=[shape.layers - 1]))
    assert shape.lora_params(4, "all-linear", 1) == sum(p.numel() for p in top.parameters() if p.requires_grad)
    assert shape.lora_params(4, "all-linear", 99) == shape.lora_params(4, "all-linear")


def test_qwen_14b_count_is_the_published_one(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_14B))
    assert ModelShape.from_folder(tmp_path).params() / 1e9 == pytest.approx(14.77, abs=0.01)  # "14.7B"


def test_sharding_divides_state_but_not_activations(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_14B))
    shape = ModelShape.from_folder(tmp_path)
    cfg = load_config(None, ["model.dtype=bfloat16", "model.lora.enabled=false"])
    one, four = trainer_memory(cfg, shape, 1), trainer_memory(cfg, shape, 4)
    assert four["optimizer"] == pytest.approx(one["optimizer"] / 4)
    assert four["grads"] == pytest.approx(one["grads"] / 4)
    assert four["activations"] == one["activations"]
    assert one["optimizer"] == pytest.approx(2 * shape.params() * 2 / 2**30)  # AdamW: 2 moments, bf16


def test_plan_places_workers_and_warns_where_memory_runs_out(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_14B))
    nodes = [Node("n0", "node0", 64, 8, 1024, 80.0)]
    cfg = load_config(None, ["model.dtype=bfloat16", "model.lora.enabled=false", "model.gradient_checkpointing=true",
                             "cluster.trainer_workers=4",
                             "cluster.rollout_workers=4", "rollout.gpu_memory_utilization=0.9"])
    lines = describe(cfg, "vllm", tmp_path, nodes)
    assert lines[1].startswith("trainer rank 0 on node node0 GPU 0: params")
    assert lines[5].startswith("rollout worker 0 on node node0 GPU 4: weights 27.51 + KV cache 44.49")
    assert not any("WARNING" in line for line in lines), lines
    # one trainer rank for a full fine-tune of 14.8B does not fit on an 80 GB GPU
    one = describe(cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"trainer_workers": 1})}),
                   "vllm", tmp_path, nodes)
    assert "WARNING: exceeds the 80 GiB of a GPU" in one[1]
