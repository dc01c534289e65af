"""The `task:` section of the config: what every task has, and one nested section per kind of task
(temporal_clue, reasoning_gym, episode, sandbox, environment) that only the tasks reading it may set
(checked at start-up by sleuth.loop.checks.check_task_sections). sleuth.config holds the rest."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from sleuth.section import Section


class TemporalClueConfig(Section):
    """task.temporal_clue: the Temporal Clue task's settings (task.name temporal_clue; `sleuth sft`)."""

    owner: ClassVar[str] = "a temporal_clue setting"
    readers: ClassVar[tuple[str, ...]] = ("temporal_clue",)
    difficulty: int | str = 1
    """Puzzle difficulty 1..6 for puzzles generated on the fly, or a rung of the ladder below 1
    (lookup, elim1, elim2: each answer one clue away, one or two eliminations away;
    sleuth.tasks.curriculum), or a curriculum "lookup -> elim1 at 0.8 -> 1 at 0.6": start at the first,
    move on once an iteration's mean rollout reward reaches the threshold (held-out problems stay at
    eval_difficulty). Checked at start-up (sleuth.loop.checks)."""
    eval_difficulty: int | str | None = None
    """The level of the generated held-out puzzles (a difficulty or rung as in difficulty); None: the
    schedule's first level. Printed with every held-out result."""
    curriculum_fade: int = Field(0, ge=0)
    """With a difficulty schedule: iterations over which the previous stage keeps a share of the
    iterations after each climb, falling from 1/2 to 0 (0: the old level stops at once)."""
    list_choices: bool = True
    """List the valid choices under each question, which makes a small model's start learnable (it
    otherwise copies the answer placeholders)."""
    stop_after_sheet: bool = False
    """End each completion where a line would start the question after the sheet's last (`\nI.`
    after question H), in training and evaluation alike. A small model otherwise goes on writing
    answers to questions that do not exist until rollout.max_tokens; those lines earn nothing, cost
    tokens and take the completion's advantage (Task.stop_strings)."""
    reasoning: Literal["direct", "deduce"] = "direct"
    """direct: the completion is the answer sheet; deduce: the prompt numbers the clues and asks first
    for `Deductions:` (one short line per question citing clues by number), then `Answers:` and the
    sheet; only the text after the last `Answers:` line is graded (no such line: 0), and guided sheet
    sampling (rollout.guided_samples) is off. Give rollout.max_tokens room for the deduction (a few
    hundred tokens). `sleuth sft` teaches this form (tasks/temporal_clue/reasoning.py)."""
    deduction_credit: bool = False
    """deduce form under algorithm.credit=answer: each deduction line (`C: clue 2: ... => Lounge`)
    takes question C's own advantage, as its sheet line does. The line's `=> ANSWER` is where the
    answer is decided (the sheet copies it), so otherwise that decision is trained by the whole
    completion's advantage: six questions of noise for one of signal (rewards/credit.py). Measured
    on the main job (20 RL iterations, development set): -3.3 SE against off; the lines shrink to
    `C: clue 1 => X` and the bonus line goes unwritten (docs/log.md, 2026-12-07 evening). Off."""


class ReasoningGymConfig(Section):
    """task.reasoning_gym: which reasoning-gym dataset (task.name reasoning_gym)."""

    owner: ClassVar[str] = "a reasoning_gym setting"
    readers: ClassVar[tuple[str, ...]] = ("reasoning_gym",)
    dataset: str | None = None
    """The dataset name, e.g. knights_knaves."""
    dataset_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the dataset's config, e.g. {n_people: 3} for knights_knaves."""


class EpisodeConfig(Section):
    """task.episode: episode tasks, whose own code talks to the model through the gateway (math_python,
    environments, user tasks with a rollout function)."""

    owner: ClassVar[str] = "a setting of episode tasks (math_python, environments, user tasks with a rollout)"
    readers: ClassVar[tuple[str, ...]] = ()  # any task with an episode function (checked at start-up)
    rollout: str | None = None
    """The episode function "module:function" (or "path/file.py:function"),
    `async def rollout(client, problem) -> float | {"reward": r, "metrics": {...}}`; setting it makes
    any task an episode task. None: a user task module's own `rollout`, or the task's built-in one
    (math_python, environments)."""
    timeout_s: float = Field(300.0, gt=0)
    """An episode that runs longer scores 0 and is counted (rollout/episode_timeouts)."""
    max_turns: int = Field(8, ge=1)
    """Most model calls per episode; a call past it is refused with HTTP 400."""
    max_tokens: int | None = Field(None, ge=1)
    """Most tokens the model may sample per episode (None: max_turns x rollout.max_tokens)."""


class SandboxConfig(Section):
    """task.sandbox: the Python sandbox of tasks that run model-written code (math_python)."""

    owner: ClassVar[str] = "a setting of tasks that run code in the sandbox (math_python)"
    readers: ClassVar[tuple[str, ...]] = ("math_python",)
    isolation: Literal["strict", "warn"] = "strict"
    """At start-up the sandbox probes its layers once; strict refuses to start (one line, exit 2)
    when a namespace or the own uid cannot be set up (needs root with CAP_SYS_ADMIN, CAP_SETUID,
    CAP_SETGID); warn prints a warning and runs the code with what holds. docs/reliability.md,
    "Sandbox"."""


class EnvironmentConfig(Section):
    """task.environment: environments from other libraries (task.name verifiers:ENV_ID or openenv:...)."""

    owner: ClassVar[str] = "an environment setting (verifiers:ENV_ID, openenv:URL_OR_MODULE)"
    readers: ClassVar[tuple[str, ...]] = ("verifiers:", "openenv:")
    args: dict[str, Any] = Field(default_factory=dict)
    """The environment's own settings. verifiers: its taskset config's fields (e.g. {num_tasks: 100}),
    plus `agent` / `timeout` for the env config's own; openenv: `action_field` (the action's text
    field, default "message"), `action` (other fixed action fields), `observation_field` and `reset`
    (keyword arguments of reset())."""


class TaskConfig(Section):
    """What every task has; each kind's own settings are in its section below (task.temporal_clue,
    task.reasoning_gym, task.episode, task.sandbox, task.environment). A section changed from its
    defaults that the task does not read is a start-up error (sleuth.loop.checks): each section's
    `readers` are the task names (or name prefixes ending in ":") that read it, `owner` says so in
    the error."""

    name: str = "temporal_clue"
    """Registered task name: temporal_clue, math, math_python, reasoning_gym, a user task
    "module:function", or an environment: "verifiers:ENV_ID" (a verifiers taskset module or package) or
    "openenv:http://HOST:PORT" / "openenv:MODULE" (an OpenEnv server, running or started by sleuth);
    README, "Environments"."""
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
    system_prompt: str | None = None
    """A system message put before every problem's prompt (None: the prompt is the only message)."""
    verifier: str | None = None
    """User tasks: the verifier "module:function" (or "path/file.py:function"), called as
    function(answer, completion_text) -> float. None: the task module's own `verify` function."""
    verifier_timeout_s: float = Field(5.0, gt=0)
    """A verifier call that takes longer scores 0 and is counted."""
    verifier_isolation: Literal["process", "inline"] = "process"
    """process: run verifiers in a worker process that is killed and restarted when a call
    exceeds verifier_timeout_s (enforces the limit even on C-level hangs); inline: run them in the
    calling process, limited by a SIGALRM timer (main thread only; cannot stop C code). Inline, a
    verifier's sys.exit is caught and scored 0 and its KeyboardInterrupt stops the run as Ctrl-C does
    (checkpoint first), but nothing protects the run from os._exit or a crash of the interpreter:
    use process isolation for verifiers you do not trust."""
    verifier_workers: int = Field(1, ge=1)
    """Worker processes for verifiers in process isolation (more for slow verifiers like math)."""
    temporal_clue: TemporalClueConfig = Field(default_factory=TemporalClueConfig)
    reasoning_gym: ReasoningGymConfig = Field(default_factory=ReasoningGymConfig)
    episode: EpisodeConfig = Field(default_factory=EpisodeConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig)

    def changed_sections(self) -> dict[str, str]:
        """Each kind section changed from its defaults -> its first changed key (e.g.
        {"temporal_clue": "difficulty"})."""
        changed = {}
        for name in type(self).model_fields:
            section = getattr(self, name)
            if isinstance(section, Section):
                defaults = type(section)().model_dump()
                diff = [k for k, v in section.model_dump().items() if v != defaults[k]]
                if diff:
                    changed[name] = diff[0]
        return changed


MOVED_KEYS = {f"task.{old}": f"task.{new}" for old, new in {
    "difficulty": "temporal_clue.difficulty", "eval_difficulty": "temporal_clue.eval_difficulty",
    "curriculum_fade": "temporal_clue.curriculum_fade", "list_choices": "temporal_clue.list_choices",
    "stop_after_sheet": "temporal_clue.stop_after_sheet", "reasoning": "temporal_clue.reasoning",
    "dataset": "reasoning_gym.dataset", "dataset_args": "reasoning_gym.dataset_args",
    "rollout": "episode.rollout", "episode_timeout_s": "episode.timeout_s", "max_turns": "episode.max_turns",
    "episode_max_tokens": "episode.max_tokens", "sandbox_isolation": "sandbox.isolation",
    "env_args": "environment.args"}.items()}
"""Keys that moved into a task kind's section: an old config names its new home in the error."""
