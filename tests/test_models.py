"""Model folders: every broken part is a one-line error naming the file, in --dry-run too."""

import shutil
from pathlib import Path

import pytest

from sleuth.cli import main
from sleuth.config import ModelConfig
from sleuth.errors import UserError
from sleuth.system.models import load_causal_lm, load_tokenizer


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture
def broken(tiny, tmp_path) -> Path:
    return Path(shutil.copytree(tiny, tmp_path / "model"))


def dry_run_error(capsys, *overrides: str) -> str:
    assert main(["train", "--dry-run", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sleuth: error: "), err
    return err[0]


def test_truncated_weights_name_the_file(broken, capsys):
    weights = broken / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 3])
    with pytest.raises(UserError, match=f"{weights} is truncated \\({len(data) // 3} bytes, its header needs {len(data)}\\)"):
        load_causal_lm(str(broken), "float32")
    assert f"{weights} is truncated" in dry_run_error(capsys, f"model.path={broken}")
    weights.write_bytes(b"\x05")
    assert "is not a safetensors file" in dry_run_error(capsys, f"model.path={broken}")


def test_missing_tokenizer_files_are_named(broken, capsys):
    (broken / "tokenizer.json").unlink()
    with pytest.raises(UserError, match="has no tokenizer files"):
        load_tokenizer(str(broken))
    assert "has no tokenizer files (one of tokenizer.json" in dry_run_error(capsys, f"model.path={broken}")


def test_corrupt_config_json_is_caught_by_dry_run(broken, capsys):
    (broken / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    assert dry_run_error(capsys, f"model.path={broken}").endswith(f"{broken / 'config.json'}: not valid JSON")
    (broken / "config.json").write_text('{"model_type": "no_such_architecture"}')
    assert "no_such_architecture" in dry_run_error(capsys, f"model.path={broken}")


def test_latent_attention_with_fewer_kv_heads_is_refused_in_one_line(tmp_path, capsys):
    """transformers' latent-attention models (DeepSeek V3, Mistral 4 ...) crash in their first
    forward pass when num_key_value_heads != num_attention_heads; the folder is refused up front."""
    import json

    from sleuth.testing.tiny_model import write_tiny_model

    folder = write_tiny_model(tmp_path / "mla", arch="deepseek_v3")  # 4 heads, 4 kv heads: loads
    load_causal_lm(str(folder), "float32")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"num_attention_heads": 8}))
    with pytest.raises(UserError, match=r"config.json: latent attention \(kv_lora_rank 32\) needs "
                                        r"num_key_value_heads equal to num_attention_heads \(4 against 8\)"):
        load_causal_lm(str(folder), "float32")
    capsys.readouterr()  # the tiny model's writing progress
    assert "needs num_key_value_heads equal to num_attention_heads" in dry_run_error(capsys, f"model.path={folder}")


def test_lora_targets_are_checked_against_the_model(tiny, capsys):
    message = dry_run_error(capsys, f"model.path={tiny}", "model.lora.enabled=true", "model.lora.target_modules=[q_proj,qproj]")
    assert "model.lora.target_modules: 'qproj' is not a module of the model (its linear layers: " in message
    assert "q_proj" in message
    from sleuth.train.policy import Policy

    with pytest.raises(UserError, match="'qproj' is not a module of the model"):
        Policy.from_config(ModelConfig(path=str(tiny), dtype="float32",
                                       lora={"target_modules": ["qproj"]}), need_reference=False, device="cpu")


def test_model_config_is_transformers_own_class_whatever_autoconfig_holds(tiny, monkeypatch):
    """vLLM registers config classes of its own into AutoConfig for some model types (DeepSeek V3.2
    and V4, Kimi Linear) when it loads such a model; the folder's config must still be the class
    transformers' model takes, so a later export or reload in the same process works."""
    from transformers import AutoConfig, LlamaConfig, Qwen2Config
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from sleuth.system.models import causal_lm_class, model_config

    monkeypatch.setitem(CONFIG_MAPPING._extra_content, "llama", Qwen2Config)  # what AutoConfig.register does
    assert type(AutoConfig.from_pretrained(tiny)) is Qwen2Config
    config = model_config(Path(tiny))
    assert type(config) is LlamaConfig
    assert causal_lm_class(config).__name__ == "LlamaForCausalLM"
