"""Finding and loading model folders: local HF folders, run directories, and offline aliases.

No model hub is reached at run time. An alias (system/aliases.py: "smollm2-135m-instruct", the
opt-in "qwen2.5-coder-0.5b-instruct") is converted once from the GGUF file shipped inside PyPI
packages into a cached HF folder (SmolLM2 the first time ~25 s, later loads ~0.5 s), which
transformers and vLLM then both load like any other folder.
"""

from __future__ import annotations

import copy
import json
import os
import re
import struct
from pathlib import Path
from typing import Any

from sleuth.errors import UserError
from sleuth.system import aliases, fsio

SMOLLM2_ALIAS = aliases.SMOLLM2.name


def cache_dir() -> Path:
    """Where converted models live: $SLEUTH_CACHE, else ~/.cache/sleuth."""
    return Path(os.environ.get("SLEUTH_CACHE") or Path.home() / ".cache" / "sleuth")


def _alias_folder(name: str) -> Path:
    return cache_dir() / "models" / name


def _convert_gguf(gguf: Path, out: Path, name: str) -> None:
    """De-quantize a GGUF into an HF folder (float32 safetensors + tokenizer), atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    # The de-quantized weights are plain tensors now; drop the GGUF marker so loaders
    # (transformers, vLLM) treat the folder as an ordinary checkpoint.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # transformers 5 also keeps the GGUF quantizer on the model and refuses to save while it is set.
    model.hf_quantizer = None
    model.config.name_or_path = name
    with fsio.atomic_folder(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)


def _convert_alias(alias: aliases.GgufAlias) -> Path:
    out = _alias_folder(alias.name)
    if not (out / "config.json").is_file():
        gguf = aliases.gguf_file(alias, out.parent)
        try:
            _convert_gguf(gguf, out, alias.name)
        finally:
            if gguf.parent == out.parent:  # a joined file: rebuilt from the parts when needed
                gguf.unlink(missing_ok=True)
    return out


def resolve_model_path(path_or_alias: str) -> Path:
    """A loadable HF folder for a folder path, a run directory (its latest weights) or an alias."""
    if path_or_alias in aliases.ALIASES:
        return _convert_alias(aliases.ALIASES[path_or_alias])
    path = Path(path_or_alias).expanduser()
    if (path / "config.json").is_file():
        return path
    if path.is_dir() and (path / "model" / "config.json").is_file():
        return path / "model"
    if not path.exists():
        raise UserError(f"model '{path_or_alias}' is neither a folder nor a known alias "
                        f"({', '.join(aliases.ALIASES)})")
    raise UserError(f"model folder {path} has no config.json")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
"""A folder needs one of these for its tokenizer to load (vocab.json also needs merges.txt)."""


def check_model_folder(path_or_alias: str) -> str:
    """Validate a model reference without loading weights (for --dry-run and before loading):
    config.json, every weights file's completeness, the tokenizer's files. Returns a description."""
    if path_or_alias in aliases.ALIASES and not converted(path_or_alias):
        return f"{path_or_alias} (from {aliases.describe(aliases.ALIASES[path_or_alias])})"
    folder = resolve_model_path(path_or_alias)
    model_config(folder)
    check_weights_files(folder)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(f"model folder {folder} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)})")
    if (folder / "vocab.json").is_file() and not (folder / "tokenizer.json").is_file() \
            and not (folder / "merges.txt").is_file():
        raise UserError(f"model folder {folder} has vocab.json but no merges.txt")
    return f"{path_or_alias} ({folder})" if path_or_alias in aliases.ALIASES else str(folder)


def converted(path_or_alias: str) -> bool:
    """Whether a model reference is a folder already (an alias only once converted)."""
    return path_or_alias not in aliases.ALIASES or (_alias_folder(path_or_alias) / "config.json").is_file()


def config_class(model_type: str) -> Any:
    """transformers' own config class for a model_type (None if it has none). Not AutoConfig's
    current entry: vLLM registers config classes of its own for some model types (DeepSeek V3.2
    and V4, Kimi Linear) when it loads such a model, which transformers' model classes then reject
    in the same process."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    name = CONFIG_MAPPING_NAMES.get(model_type)
    return getattr(transformers, name, None) if name else None


def model_config(folder: Path) -> Any:
    """The folder's transformers config (by transformers' own class, config_class); a corrupt or
    unknown config.json is a one-line error."""
    from transformers import AutoConfig

    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        own = config_class(raw.get("model_type", "")) if isinstance(raw, dict) else None
        config = (own or AutoConfig).from_pretrained(folder)
    except (ValueError, OSError, KeyError) as e:
        why = "not valid JSON" if isinstance(e, json.JSONDecodeError | UnicodeDecodeError) else \
            (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UserError(f"{path}: {why}") from None
    check_latent_attention_heads(config, path)
    return config


def check_latent_attention_heads(config: Any, path: Path) -> None:
    """Latent attention (kv_lora_rank: DeepSeek V2/V3, Mistral 4, Kimi Linear ...) expands keys and
    values to every query head, and transformers' models of it still repeat them by
    num_attention_heads // num_key_value_heads: unequal counts crash in the first forward pass."""
    for c in (config, getattr(config, "text_config", None)):
        if c is None or getattr(c, "kv_lora_rank", None) is None:
            continue
        heads, kv = getattr(c, "num_attention_heads", None), getattr(c, "num_key_value_heads", None)
        if kv is not None and heads is not None and kv != heads:
            raise UserError(f"{path}: latent attention (kv_lora_rank {c.kv_lora_rank}) needs num_key_value_heads "
                            f"equal to num_attention_heads ({kv} against {heads}): its keys and values cover "
                            "every head")


def check_weights_files(folder: Path) -> None:
    """Every safetensors file complete (its size matches its header) and every shard present."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, OSError):
            raise UserError(f"{index} is not a valid shard index") from None
        for name in sorted(shards):
            if not (folder / name).is_file():
                raise UserError(f"model folder {folder}: shard {name} is missing")
    files = sorted(folder.glob("*.safetensors"))
    if not files and not any(folder.glob("*.bin")):
        raise UserError(f"model folder {folder} has no weights (*.safetensors)")
    for f in files:
        size = f.stat().st_size
        try:
            with f.open("rb") as fh:
                n = struct.unpack("<Q", fh.read(8))[0]
                header = json.loads(fh.read(n)) if 0 < n <= size - 8 else None
            ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"] if header else None
        except (struct.error, ValueError, KeyError, TypeError, IndexError):
            ends = None
        if ends is None:
            raise UserError(f"{f} is not a safetensors file (corrupt or truncated header)")
        needed = 8 + n + max(ends, default=0)
        if size < needed:
            raise UserError(f"{f} is truncated ({size} bytes, its header needs {needed})")


def causal_lm_class(config: Any) -> Any:
    """The transformers causal-LM class of a config: the auto mapping's, or else (an architecture
    transformers carries with no auto mapping, as Mistral 4) the config's own `architectures` entry
    or `<Name>ForCausalLM` from the model_type's module. None of them: a one-line UserError."""
    import importlib

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(config, "model_type", "")
    names = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "")]
    names += [a for a in getattr(config, "architectures", None) or [] if a.endswith("ForCausalLM")]
    try:
        module = importlib.import_module(f"transformers.models.{model_type}")
        names += [n for n in dir(module) if n.endswith("ForCausalLM")]
    except ImportError:
        module = None
    for name in filter(None, names):
        cls = getattr(transformers, name, None) or getattr(module, name, None)
        if cls is not None and isinstance(config, cls.config_class):
            return cls
    raise UserError(f"transformers {transformers.__version__} has no causal LM class for model_type "
                    f"{model_type!r} (config class {type(config).__name__})")


WRAPPED_LM_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                       ("language_model.lm_head.", "lm_head."))
"""Checkpoint name prefixes of a multimodal wrapper's language model -> the causal LM's own names
(transformers 5's in-memory layout first, the published layout transformers saves after)."""


def wrapped_text_config(config: Any) -> Any | None:
    """The language model's config when `config` is a multimodal wrapper's (Mistral 3, Gemma 3/4,
    Qwen3.5, Llama 4 checkpoints: a top config holding a text_config), else None. The wrapper ties
    the output head to the embedding by its own tie_word_embeddings, so the copy carries that."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is config:
        return None
    text = copy.deepcopy(text)
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", text.tie_word_embeddings))
    return text


def model_skeleton(folder: Path) -> Any:
    """The model's modules with no weights (meta device): what LoRA targets are checked against."""
    import torch

    config = model_config(folder)
    config = wrapped_text_config(config) or config
    try:
        with torch.device("meta"):
            return causal_lm_class(config)._from_config(config)
    except (ValueError, KeyError) as e:
        raise UserError(f"{folder / 'config.json'}: {str(e).splitlines()[0][:200]}") from None


def checkpoint_layout(model: Any, state: dict[str, Any]) -> dict[str, Any]:
    """Tensor names and layout of the model's published checkpoints: transformers 5 fuses some
    weights at load (MoE experts into one stack per layer) and splits them again on save; vLLM and
    other loaders read the published layout. `model` may be a skeleton (model_skeleton): only its
    class and config matter."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # an older transformers: names were never converted
        return state
    return {k: v.contiguous() for k, v in revert_weight_conversion(model, state).items()}


def check_lora_targets(model: Any, targets: list[str] | str) -> None:
    """Each named LoRA target must be a module of the model (PEFT matches names by suffix)."""
    if isinstance(targets, str):  # "all-linear"
        return
    names = [name for name, _ in model.named_modules()]
    for target in targets:
        if not any(name == target or name.endswith("." + target) for name in names):
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                             if type(m).__name__ == "Linear"})
            raise UserError(f"model.lora.target_modules: '{target}' is not a module of the model "
                            f"(its linear layers: {', '.join(linear)})")


def lora_layer_indices(model: Any, last_layers: int | None) -> list[int] | None:
    """The decoder-layer indices model.lora.last_layers adapts (PEFT's layers_to_transform), or
    None for every layer; more than the model has means all of them."""
    if last_layers is None:
        return None
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n = int(config.num_hidden_layers)
    return list(range(max(n - last_layers, 0), n))


def layer_linear_names(model: Any) -> list[str]:
    """The names (last part) of the linear modules inside numbered layers: what "all-linear" adapts
    there, spelled out for PEFT, which takes layers_to_transform only with a list of targets."""
    import torch

    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and re.search(r"\.\d+\.", name)})


def linears_with_own_forward(model: Any) -> list[str]:
    """Full names of a model's own modules (classes of transformers' model code) that subclass
    nn.Linear but replace its forward (Llama 4's router returns a tuple of scores and logits):
    PEFT's LoRA wrapper assumes a linear's tensor output, so "all-linear" must leave them out.
    Quantized linears (bitsandbytes) replace forward too and stay in."""
    import torch

    return [name for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and type(m).forward is not torch.nn.Linear.forward
            and type(m).__module__.startswith("transformers.models.")]


def load_tokenizer(path_or_alias: str) -> Any:
    from transformers import AutoTokenizer

    folder = resolve_model_path(path_or_alias)
    check_model_folder(str(folder))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as e:  # transformers raises many kinds (ValueError, OSError, ImportError hints)
        raise UserError(f"cannot load the tokenizer in {folder}: "
                        f"{(str(e).strip().splitlines() or [type(e).__name__])[0][:200]}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"tokenizer in {folder} has no chat template")
    return tokenizer


def load_causal_lm(path_or_alias: str, dtype: str = "float32", attn_implementation: str = "sdpa",
                   **from_pretrained: Any) -> Any:
    """The folder's causal LM (causal_lm_class) from a folder or alias; extra keywords (quantization_config, device_map)
    go to from_pretrained."""
    import torch

    folder = resolve_model_path(path_or_alias)
    check_model_folder(str(folder))
    from sleuth.system.hardware import resolve_dtype

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[resolve_dtype(dtype)]
    config = model_config(folder)
    text = wrapped_text_config(config)
    if text is not None:  # the language model alone, out of a multimodal checkpoint
        from transformers.utils import logging as hf_logging

        from_pretrained["config"] = text
        from_pretrained["key_mapping"] = {"^" + re.escape(a): b for a, b in WRAPPED_LM_PREFIXES}
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # else a table of every vision weight left unread
    try:
        cls = causal_lm_class(text or config)
        return cls.from_pretrained(folder, dtype=torch_dtype, attn_implementation=attn_implementation,
                                   **from_pretrained)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load model from {folder}: {str(e).splitlines()[0]}") from None
    finally:
        if text is not None:
            hf_logging.set_verbosity(verbosity)


def encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Prompt token ids: the chat template with the generation prompt (the assistant turn opened)."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if hasattr(out, "keys"):  # some tokenizer versions still return a BatchEncoding
        out = out["input_ids"]
    return [int(i) for i in out]
