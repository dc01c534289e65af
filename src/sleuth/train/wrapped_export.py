"""Export a language model trained out of a multimodal checkpoint in that checkpoint's own layout.

sleuth trains the language model of a vision-language folder (Mistral 3, Gemma 3/4, Qwen3.5,
Llama 4: a top config holding a text_config) as a plain causal LM (models.load_causal_lm). Its
export goes back where it came from: the trained tensors under the names the original checkpoint
uses for them, every other tensor of the original (vision tower, projector) copied unchanged, and
the original config, so whatever loaded the original loads the export.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from sleuth.errors import UserError
from sleuth.system.models import WRAPPED_LM_PREFIXES, model_config, wrapped_text_config

WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json", "*.bin", "pytorch_model.bin.index.json")


def wrapped_source(model_path: str) -> Path | None:
    """The model folder when it holds a multimodal wrapper's checkpoint, else None."""
    folder = Path(model_path)
    if not (folder / "config.json").is_file():
        return None
    return folder if wrapped_text_config(model_config(folder)) is not None else None


def _original_names(folder: Path) -> dict[str, str]:
    """{tensor name: file} of the original checkpoint's safetensors files."""
    from safetensors import safe_open

    names: dict[str, str] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            names.update(dict.fromkeys(fh.keys(), f.name))
    if not names:
        raise UserError(f"{folder}: exporting a multimodal checkpoint needs its weights as *.safetensors")
    return names


def _published_name(name: str, original: dict[str, str]) -> str | None:
    """The original checkpoint's name of a language-model tensor; None when it has none (an output
    head tied to the embedding). transformers itself reverts the load's key mapping on save
    (models.load_causal_lm's), so names usually arrive as the original's already."""
    if name in original:
        return name
    for wrapped, own in WRAPPED_LM_PREFIXES:
        if name.startswith(own) and wrapped + name[len(own):] in original:
            return wrapped + name[len(own):]
    return None


def write_wrapped_export(out: Path, source: Path, state: dict[str, torch.Tensor]) -> None:
    """model.safetensors with `state` (the language model's tensors, published names) under the
    original's names plus the original's other tensors; the original's config and other files."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    original = _original_names(source)
    merged: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        published = _published_name(name, original)
        if published is None:
            if "lm_head." in name:  # tied to the embedding in the original: not stored
                continue
            raise UserError(f"cannot export into {source}'s layout: the checkpoint has no tensor for {name}")
        merged[published] = tensor
    for file in sorted(set(original.values())):
        with safe_open(str(source / file), "pt") as fh:
            for name in (n for n, f in original.items() if f == file and n not in merged):
                merged[name] = fh.get_tensor(name)
    for f in source.iterdir():  # config, processor and tokenizer files: as the original has them
        if f.is_file() and not any(f.match(p) for p in WEIGHT_FILES):
            shutil.copy2(f, out / f.name)
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization_config", None)  # the export holds dequantized weights
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in merged.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
