"""`model.init`: start a run from another run's weights (a `sleuth sft` warm start, or any run).

    folder = init_folder(cfg.model)          # RUN_DIR -> its latest checkpoint's policy folder
    load_init(policy, cfg.model)             # the adapter (LoRA) or full weights, loaded in place

Decision: with LoRA the earlier run's adapter is loaded as this run's starting adapter (not merged
into the base): the base model, the rollout engine's starting weights and the KL reference (the
base without adapter) stay those of model.path, and the adapter keeps training. So the earlier run
must have used the same base model and the same LoRA shape (rank, targets, layers); both are
checked, naming what differs. Without LoRA its full weights are loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sleuth.config import ModelConfig
from sleuth.errors import UserError

ADAPTER_FILE = "adapter_model.safetensors"
WARM_START_DIR = "sft"


def warm_start_dir(run_dir: Path) -> Path:
    """Where `sleuth train` runs sft.warm_start's SFT phase (loop/sft.py); RL starts from its weights."""
    return run_dir / WARM_START_DIR


def init_folder(model_cfg: ModelConfig) -> Path:
    """The weights folder model.init names: a run's latest valid checkpoint, or a policy folder."""
    from sleuth.run.checkpoint import POLICY_DIR, CheckpointManager

    assert model_cfg.init is not None
    path = Path(model_cfg.init).expanduser()
    if not path.is_dir():
        raise UserError(f"model.init {path}: no such folder (give a sleuth sft or sleuth train run directory)")
    if (path / ADAPTER_FILE).is_file() or any(path.glob("*.safetensors")):
        return path
    if (path / "checkpoints").is_dir():
        _check_same_base(path, model_cfg)
        checkpoint = CheckpointManager(path / "checkpoints").newest_valid(only=POLICY_DIR)  # weights alone
        if checkpoint is None:
            raise UserError(f"model.init {path}: the run has no valid checkpoint")
        return checkpoint.path / POLICY_DIR
    raise UserError(f"model.init {path}: neither a run directory (no checkpoints/) nor a weights folder")


def _check_same_base(run_dir: Path, model_cfg: ModelConfig) -> None:
    import yaml

    try:
        data = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return  # a run without a readable config: the weights' own shape check still applies
    model = data.get("model") if isinstance(data, dict) else None
    base = model.get("path") if isinstance(model, dict) else None
    if isinstance(base, str) and base != model_cfg.path:
        raise UserError(f"model.init {run_dir} was trained on model.path={base}, this run uses "
                        f"{model_cfg.path}: set model.path={base}")


def _check_lora_shape(folder: Path, model_cfg: ModelConfig) -> None:
    try:
        saved = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return
    lora = model_cfg.lora
    if saved.get("r") not in (None, lora.rank):
        raise UserError(f"model.init {folder}: its adapter has rank {saved.get('r')}, this run's "
                        f"model.lora.rank is {lora.rank}")
    if saved.get("lora_alpha") not in (None, lora.alpha):
        raise UserError(f"model.init {folder}: its adapter has alpha {saved.get('lora_alpha')}, this run's "
                        f"model.lora.alpha is {lora.alpha}")


def load_init(policy: Any, model_cfg: ModelConfig) -> Path:
    """Load model.init's weights into `policy`; returns the folder they came from."""
    folder = init_folder(model_cfg)
    has_adapter = (folder / ADAPTER_FILE).is_file()
    if model_cfg.lora.enabled and not has_adapter:
        raise UserError(f"model.init {folder} holds full weights but model.lora.enabled is true: "
                        "set model.lora.enabled=false, or start from a LoRA run")
    if not model_cfg.lora.enabled and has_adapter:
        raise UserError(f"model.init {folder} holds a LoRA adapter but model.lora.enabled is false: "
                        "set model.lora.enabled=true with the same rank")
    if has_adapter:
        _check_lora_shape(folder, model_cfg)
    try:
        policy.load_weights(folder)
    except UserError as e:
        raise UserError(f"model.init: {e}") from None
    except Exception as e:  # safetensors / peft errors: the folder does not fit this model
        raise UserError(f"model.init {folder} does not fit this model ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None
    return folder
