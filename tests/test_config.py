import pytest

from sleuth.config import Config, dump_config, load_config, valid_keys
from sleuth.errors import ConfigError
from sleuth.loop.checks import check_names


def test_defaults_and_overrides(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("trainer:\n  lr: 3.0e-4\nrollout:\n  samples_per_task: 4\n")
    cfg = load_config(cfg_file, ["trainer.lr=1e-5", "model.lora.rank=8", "rollout.stop=['</answer>']"])
    assert cfg.trainer.lr == 1e-5
    assert cfg.rollout.samples_per_task == 4
    assert cfg.model.lora.rank == 8
    assert cfg.rollout.stop == ["</answer>"]
    assert cfg.loop == Config().loop


def test_unknown_key_names_nearest():
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer.lrr' \(did you mean 'trainer.lr'\?\)"):
        load_config(None, ["trainer.lrr=1"])
    with pytest.raises(ConfigError, match="unknown config key 'trainr'"):
        load_config(None, ["trainr.lr=1"])


def test_mistyped_value_names_key():
    with pytest.raises(ConfigError, match=r"config key 'trainer.lr'.*'abc'"):
        load_config(None, ["trainer.lr=abc"])
    with pytest.raises(ConfigError, match=r"rollout\.engine': unknown rollout engine 'tgi'"):
        check_names(load_config(None, ["rollout.engine=tgi"]))


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(scalar)
    with pytest.raises(ConfigError, match="not of the form"):
        load_config(None, ["trainer.lr"])


def test_dump_roundtrip(tmp_path):
    cfg = load_config(None, ["loop.iterations=3"])
    p = tmp_path / "out.yaml"
    p.write_text(dump_config(cfg))
    assert load_config(p) == cfg


def test_every_field_documented():
    from pydantic import BaseModel

    def walk(model: type[BaseModel], prefix: str = ""):
        for name, info in model.model_fields.items():
            ann = info.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                yield from walk(ann, f"{prefix}{name}.")
            else:
                yield f"{prefix}{name}", info.description

    undocumented = [k for k, d in walk(Config) if not d and k.split(".")[-1] not in {"temperature", "top_p", "betas", "warmup_steps", "weight_decay"}]
    assert not undocumented, undocumented
    assert "trainer.lr" in valid_keys()


@pytest.mark.parametrize("override, message", [
    ("loop.iterations=true", "config key 'loop.iterations': expected a number, not a boolean"),
    ("trainer.lr=.inf", "config key 'trainer.lr': Input should be a finite number"),
    ("rollout.temperature=.nan", "config key 'rollout.temperature': Input should be a finite number"),
    ("trainer.betas=[0.9,1.0]", "config key 'trainer.betas.1': Input should be less than 1"),
    ("trainer.betas=[-0.1,0.9]", "config key 'trainer.betas.0': Input should be greater than or equal to 0"),
    ("trainer.betas=[true,0.9]", "config key 'trainer.betas': expected a number, not a boolean"),
    ("eval.price_per_million_tokens=nan", "Input should be a finite number"),
])
def test_numbers_are_finite_in_range_and_not_booleans(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_duplicate_keys_and_binary_files_are_refused(tmp_path):
    dup = tmp_path / "dup.yaml"
    dup.write_text("loop:\n  iterations: 2\ntrainer:\n  lr: 1.0e-5\nloop:\n  seed: 3\n")
    with pytest.raises(ConfigError, match=r"dup.yaml: line 5: key 'loop' is given twice"):
        load_config(dup)
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ConfigError, match=r"model.bin is not a text file \(not UTF-8\)"):
        load_config(binary)
    nul = tmp_path / "nul.yaml"
    nul.write_bytes(b"loop:\x00\n")
    with pytest.raises(ConfigError, match="holds NUL bytes"):
        load_config(nul)
