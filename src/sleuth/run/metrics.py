"""Per-iteration metrics and sample completions of a run, written where people look at them.

    writer = MetricsWriter(run_dir, cfg.logging, config=cfg.model_dump(mode="json"))
    writer.log(iteration, {"rollout/reward_mean": 0.4, "train/loss": 0.01})
    writer.log_samples(iteration, [{"problem_id": "p3", "reward": 1.0, "kind": "best", "text": "..."}])
    writer.close()

RUN_DIR/metrics.jsonl is the record of truth (one JSON object per `log` call, "iteration" first,
flushed per line so a killed run loses nothing). Every numeric value is mirrored to TensorBoard
event files in RUN_DIR and, when enabled, to Weights & Biases and MLflow; none of those is needed
to train (an enabled one that is not installed is a UserError). Sample completions go to
RUN_DIR/samples.jsonl. Opening a run directory again appends; a last line cut off by a kill is
dropped first, and `truncate_after(iteration)` rewinds both files (and TensorBoard) on resume.

Keys are grouped by stage: `rollout/...`, `train/...`, `sync/...`, `val/...`, `time/...`, plus
`iteration` (README, "Metrics", lists every key). Runs written before the namespaces used flat names;
`upgrade_row` maps those to today's keys, so readers (sleuth report, resume) handle both.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sleuth.config import LoggingConfig
from sleuth.errors import UserError

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"


OLD_NAMES: dict[str, str] = {
    **{k: f"rollout/{k}" for k in ("reward_mean", "reward_se", "reward_max", "verifier_errors",
                                   "verifier_timeouts", "completion_tokens_mean", "tokens", "truncated_frac",
                                   "tokens_per_s")},
    **{k: f"train/{k}" for k in ("groups", "groups_dropped", "advantage_abs_mean", "loss", "clip_frac_low",
                                 "clip_frac_high", "grad_norm", "kl", "entropy", "tis_weight_mean",
                                 "tis_capped_frac", "mfu", "peak_mem_gb", "skipped", "rows", "sequences",
                                 "completion_tokens", "lr", "step_time_s", "self_check_max_diff",
                                 "self_check_mean_diff")},
    "train_tokens": "train/tokens", "train_tokens_per_s": "train/tokens_per_s",
    **{f"time_{k}_s": f"time/{k}_s" for k in ("rollout", "score", "train", "sync", "eval", "iteration")},
    **{f"val_{k}": f"val/{k}" for k in ("reward", "reward_se", "completion_tokens", "chance",
                                                     "accuracy")},
}
"""Flat metric name of runs written before the namespaces -> today's key (val_pass@k / val_maj@k too)."""


def upgrade_row(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics.jsonl row with old flat names renamed to today's keys (new rows pass unchanged)."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        new = OLD_NAMES.get(key)
        if new is None and key.startswith(("val_pass@", "val_maj@")):
            new = "val/" + key.removeprefix("val_")
        out.setdefault(new or key, value)
    return out


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """RUN_DIR/metrics.jsonl as rows with today's keys (upgrade_row): what scripts that read a finished
    run's metrics (bench/) go through, so they follow a renamed key."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise UserError(f"{run_dir}: no {METRICS_FILE} (is it a sleuth run directory?)")
    return [upgrade_row(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def prefixed(namespace: str, metrics: dict[str, Any]) -> dict[str, Any]:
    """{f"{namespace}/{key}": value}: a stage's own metric names under its namespace."""
    return {f"{namespace}/{k}": v for k, v in metrics.items()}


@contextlib.contextmanager
def timed(metrics: dict[str, Any], step: str) -> Iterator[None]:
    """Record the wall time of the block as metrics[f"time/{step}_s"] (also when it raises)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        metrics[f"time/{step}_s"] = time.perf_counter() - start


def _numeric(value: Any) -> float | None:
    """The value as a float when it is a plain number (bools count), else None."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    # numpy scalars and 0-d tensors: anything with .item() returning a number
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", 0) == 0:
        try:
            out = item()
        except (TypeError, ValueError, RuntimeError):
            return None
        return float(out) if isinstance(out, int | float) else None
    return None


def json_safe(value: Any) -> Any:
    """Make a value strict JSON: NaN/inf become null (browsers and jq reject bare NaN)."""
    num = _numeric(value)
    if num is not None and not isinstance(value, bool):
        if not math.isfinite(num):
            return None
        return int(value) if isinstance(value, numbers.Integral) else num
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if value is None or isinstance(value, bool | str):
        return value
    return str(value)


def _keep_through(path: Path, iteration: int) -> None:
    """Rewrite a JSONL file keeping only the lines whose "iteration" is <= iteration.

    Unparseable lines (a line half-written when the process was killed) are dropped too.
    """
    if not path.exists():
        return
    kept = []
    with path.open() as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get("iteration"), int) and row["iteration"] <= iteration:
                kept.append(line if line.endswith("\n") else line + "\n")
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def _drop_partial_tail(path: Path) -> None:
    """Cut a last line that lacks its newline (a write interrupted by a kill), so the next
    appended line does not fuse with it into one unreadable line."""
    if not path.exists():
        return
    with path.open("rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        # Scan back in blocks for the last newline; lines are short, so this reads little.
        pos = size
        while pos > 0:
            start = max(0, pos - 65536)
            f.seek(start)
            cut = f.read(pos - start).rfind(b"\n")
            if cut >= 0:
                f.truncate(start + cut + 1)
                return
            pos = start
        f.truncate(0)


class MetricsWriter:
    """Appends metrics and samples to a run directory and mirrors metrics to the enabled trackers."""

    def __init__(self, run_dir: str | Path, cfg: LoggingConfig | None = None,
                 config: dict[str, Any] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.cfg = cfg or LoggingConfig()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / METRICS_FILE
        self.samples_path = self.run_dir / SAMPLES_FILE
        # Check optional trackers before creating any file, so a missing package fails fast.
        self._wandb = self._import_optional("wandb", self.cfg.wandb, "logging.wandb")
        self._mlflow = self._import_optional("mlflow", self.cfg.mlflow, "logging.mlflow")
        _drop_partial_tail(self.metrics_path)
        _drop_partial_tail(self.samples_path)
        self._metrics_f = self.metrics_path.open("a")
        self._samples_f = self.samples_path.open("a")
        self._tb: Any = None
        if self.cfg.tensorboard:
            self._tb = self._open_tensorboard(purge_step=None)
        self._wandb_run: Any = None
        if self._wandb is not None:
            self._wandb_run = self._start_wandb(config)
        self._mlflow_run: Any = None
        if self._mlflow is not None:
            self._mlflow_run = self._start_mlflow(config)
        self._closed = False

    # ------------------------------------------------------------ optional trackers

    @staticmethod
    def _import_optional(module: str, enabled: bool, key: str) -> Any:
        if not enabled:
            return None
        try:
            return __import__(module)
        except ImportError:
            raise UserError(
                f"{key} is enabled but the '{module}' package is not installed "
                f"(pip install {module}, or set {key}=false)"
            ) from None

    def _open_tensorboard(self, purge_step: int | None) -> Any:
        from torch.utils.tensorboard import SummaryWriter

        # flush_secs small so `tensorboard --logdir RUN_DIR` shows a live run within seconds;
        # purge_step makes TensorBoard hide events of iterations a resumed run is about to redo.
        return SummaryWriter(log_dir=str(self.run_dir), purge_step=purge_step, flush_secs=10)

    def _start_wandb(self, config: dict[str, Any] | None) -> Any:
        # The run id is kept in the run directory so a resumed run continues the same W&B run.
        id_file = self.run_dir / "wandb_id.txt"
        run_id = id_file.read_text().strip() if id_file.exists() else None
        run = self._wandb.init(project=self.cfg.project, name=self.run_dir.name, dir=str(self.run_dir),
                               config=config, id=run_id, resume="allow")
        if run_id is None and getattr(run, "id", None):
            id_file.write_text(str(run.id))
        return run

    def _start_mlflow(self, config: dict[str, Any] | None) -> Any:
        mlflow = self._mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            mlflow.set_tracking_uri((self.run_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(self.cfg.project)
        id_file = self.run_dir / "mlflow_run_id.txt"
        run_id = id_file.read_text().strip() if id_file.exists() else None
        run = mlflow.start_run(run_id=run_id, run_name=None if run_id else self.run_dir.name)
        if run_id is None:
            id_file.write_text(run.info.run_id)
            if config:
                flat = _flatten(config)
                mlflow.log_params({k: str(v)[:500] for k, v in flat.items()})
        return run

    # ------------------------------------------------------------ logging

    def log(self, iteration: int, metrics: dict[str, Any]) -> None:
        """Append one line {"iteration": iteration, **metrics} and mirror numeric values."""
        self._check_open()
        row: dict[str, Any] = {"iteration": int(iteration)}
        for key, value in metrics.items():
            if key != "iteration":
                row[str(key)] = json_safe(value)
        self._metrics_f.write(json.dumps(row, allow_nan=False) + "\n")
        self._metrics_f.flush()
        numeric = {k: v for k, v in ((k, _numeric(v)) for k, v in metrics.items() if k != "iteration")
                   if v is not None}
        if self._tb is not None:
            for key, value in numeric.items():
                self._tb.add_scalar(key, value, global_step=int(iteration))
        if self._wandb_run is not None:
            self._wandb.log(numeric, step=int(iteration))
        if self._mlflow_run is not None:
            self._mlflow.log_metrics({k: v for k, v in numeric.items() if math.isfinite(v)},
                                     step=int(iteration))

    def log_samples(self, iteration: int, records: list[dict[str, Any]]) -> None:
        """Append sample completions, each {"iteration", "problem_id", "reward", "kind", "text", ...}."""
        self._check_open()
        for record in records:
            row = {"iteration": int(iteration)}
            row.update({str(k): json_safe(v) for k, v in record.items() if k != "iteration"})
            self._samples_f.write(json.dumps(row, allow_nan=False) + "\n")
        self._samples_f.flush()

    def truncate_after(self, iteration: int) -> None:
        """Forget everything logged after `iteration` (a run resuming from that checkpoint).

        Rewrites metrics.jsonl and samples.jsonl, and reopens TensorBoard with a purge step so its
        viewer drops the stale points of later iterations instead of drawing two curves.
        """
        self._check_open()
        self._metrics_f.close()
        self._samples_f.close()
        _keep_through(self.metrics_path, iteration)
        _keep_through(self.samples_path, iteration)
        self._metrics_f = self.metrics_path.open("a")
        self._samples_f = self.samples_path.open("a")
        if self._tb is not None:
            self._tb.close()
            self._tb = self._open_tensorboard(purge_step=int(iteration) + 1)

    def flush(self) -> None:
        self._metrics_f.flush()
        self._samples_f.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._metrics_f.close()
        self._samples_f.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
        if self._mlflow_run is not None:
            self._mlflow.end_run()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("MetricsWriter is closed")

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
