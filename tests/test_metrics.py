"""MetricsWriter: metrics.jsonl, samples.jsonl, TensorBoard event files, optional trackers."""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from sleuth.config import LoggingConfig
from sleuth.errors import UserError
from sleuth.run.metrics import MetricsWriter, read_metrics


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def tb_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_log_writes_jsonl_iteration_first_and_flushes_each_line(tmp_path: Path) -> None:
    w = MetricsWriter(tmp_path, LoggingConfig(tensorboard=False))
    w.log(0, {"reward_mean": 0.25, "loss": -1.5, "note": "warmup", "iteration": 99})
    # Flushed before close: a reader (or a killed process) sees the line already.
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert rows == [{"iteration": 0, "reward_mean": 0.25, "loss": -1.5, "note": "warmup"}]
    assert next(iter(rows[0])) == "iteration"
    w.log(1, {"reward_mean": np.float32(0.5), "tokens": np.int64(1200), "bad": float("nan"),
              "flag": True})
    w.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert rows[1] == {"iteration": 1, "reward_mean": 0.5, "tokens": 1200, "bad": None, "flag": True}
    assert not list(tmp_path.glob("events.out.tfevents.*"))


def test_tensorboard_event_files_hold_every_numeric_metric(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path, LoggingConfig()) as w:
        for it in range(5):
            w.log(it, {"reward_mean": it / 10, "kl": 0.01 * it, "phase": "train"})
    scalars = tb_scalars(tmp_path)
    assert set(scalars) == {"reward_mean", "kl"}  # the string metric is not a scalar
    assert [s for s, _ in scalars["reward_mean"]] == [0, 1, 2, 3, 4]
    assert [v for _, v in scalars["reward_mean"]] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    assert scalars["kl"][3] == (3, pytest.approx(0.03))


def test_log_samples_appends_records_with_iteration(tmp_path: Path) -> None:
    w = MetricsWriter(tmp_path, LoggingConfig(tensorboard=False))
    w.log_samples(3, [
        {"problem_id": "p1", "reward": 1.0, "kind": "best", "text": "<answer>A</answer>"},
        {"problem_id": "p1", "reward": 0.0, "kind": "worst", "text": "no idea", "tokens": 3},
    ])
    w.close()
    rows = read_jsonl(tmp_path / "samples.jsonl")
    assert [r["kind"] for r in rows] == ["best", "worst"]
    assert all(r["iteration"] == 3 and next(iter(r)) == "iteration" for r in rows)
    assert rows[1]["tokens"] == 3 and rows[0]["text"] == "<answer>A</answer>"


def test_appends_across_writers_and_truncate_after_drops_later_iterations(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path, LoggingConfig()) as w:
        for it in range(6):
            w.log(it, {"reward_mean": float(it)})
            w.log_samples(it, [{"problem_id": f"p{it}", "reward": 0.0, "kind": "best", "text": "x"}])
    # A resumed run reopens the directory and rewinds to its checkpoint at iteration 2.
    with MetricsWriter(tmp_path, LoggingConfig()) as w:
        with (tmp_path / "metrics.jsonl").open("a") as f:
            f.write('{"iteration": 6, "rew')  # a line half-written when the process was killed
        w.truncate_after(2)
        assert [r["iteration"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2]
        assert [r["iteration"] for r in read_jsonl(tmp_path / "samples.jsonl")] == [0, 1, 2]
        w.log(3, {"reward_mean": 30.0})
        w.log(4, {"reward_mean": 40.0})
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["iteration"], r["reward_mean"]) for r in rows] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0),
                                                                  (4, 40.0)]
    # TensorBoard drops the stale points of iterations 3..5 thanks to the purge step.
    points = tb_scalars(tmp_path)["reward_mean"]
    assert points == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_reopening_drops_a_partial_last_line_so_appends_stay_readable(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 0, "loss": 1.0}\n{"iteration": 1, "lo')
    (tmp_path / "samples.jsonl").write_text('{"iteration": 0, "te')
    with MetricsWriter(tmp_path, LoggingConfig(tensorboard=False)) as w:
        w.log(1, {"loss": 0.5})
        w.log_samples(1, [{"problem_id": "p", "reward": 1.0, "kind": "best", "text": "t"}])
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"iteration": 0, "loss": 1.0}, {"iteration": 1, "loss": 0.5}]
    assert [r["iteration"] for r in read_jsonl(tmp_path / "samples.jsonl")] == [1]


def test_enabled_tracker_without_package_is_a_user_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(UserError, match=r"logging\.wandb is enabled but the 'wandb' package"):
        MetricsWriter(tmp_path / "a", LoggingConfig(wandb=True))
    with pytest.raises(UserError, match=r"logging\.mlflow is enabled but the 'mlflow' package"):
        MetricsWriter(tmp_path / "b", LoggingConfig(mlflow=True))
    # Nothing was created for a writer that failed to start.
    assert not (tmp_path / "a" / "metrics.jsonl").exists()


class _RecordingWandb(types.ModuleType):
    """Records the calls sleuth makes to the wandb module API (wandb itself is not installed here)."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.calls: list[tuple[str, Any]] = []

    def init(self, **kwargs: Any) -> Any:
        self.calls.append(("init", kwargs))
        module = self
        return types.SimpleNamespace(id="run123", finish=lambda: module.calls.append(("finish", None)))

    def log(self, data: dict[str, float], step: int) -> None:
        self.calls.append(("log", (dict(data), step)))


def test_wandb_receives_numeric_metrics_per_iteration_and_resumes_same_run(tmp_path: Path,
                                                                            monkeypatch) -> None:
    fake = _RecordingWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = LoggingConfig(tensorboard=False, wandb=True, project="proj")
    with MetricsWriter(tmp_path, cfg, config={"trainer": {"lr": 1e-5}}) as w:
        w.log(7, {"reward_mean": 0.5, "inf": math.inf, "label": "x"})
    init = fake.calls[0]
    assert init[0] == "init" and init[1]["project"] == "proj" and init[1]["id"] is None
    assert init[1]["config"] == {"trainer": {"lr": 1e-5}}
    assert fake.calls[1] == ("log", ({"reward_mean": 0.5, "inf": math.inf}, 7))
    assert fake.calls[-1] == ("finish", None)
    assert (tmp_path / "wandb_id.txt").read_text() == "run123"
    with MetricsWriter(tmp_path, cfg):
        pass
    assert fake.calls[-2][1]["id"] == "run123"


class _RecordingMlflow(types.ModuleType):
    """Records the calls sleuth makes to the mlflow module API (mlflow itself is not installed here)."""

    def __init__(self) -> None:
        super().__init__("mlflow")
        self.calls: list[tuple[str, Any]] = []

    def set_tracking_uri(self, uri: str) -> None:
        self.calls.append(("uri", uri))

    def set_experiment(self, name: str) -> None:
        self.calls.append(("experiment", name))

    def start_run(self, run_id: str | None = None, run_name: str | None = None) -> Any:
        self.calls.append(("start", (run_id, run_name)))
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id=run_id or "mlrun1"))

    def log_params(self, params: dict[str, str]) -> None:
        self.calls.append(("params", dict(params)))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append(("metrics", (dict(metrics), step)))

    def end_run(self) -> None:
        self.calls.append(("end", None))


def test_mlflow_gets_a_run_in_the_run_dir_params_and_finite_metrics(tmp_path: Path, monkeypatch) -> None:
    fake = _RecordingMlflow()
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = LoggingConfig(tensorboard=False, mlflow=True)
    with MetricsWriter(tmp_path / "run", cfg, config={"trainer": {"lr": 1e-5}}) as w:
        w.log(2, {"loss": 0.25, "kl": math.nan})
    calls = dict(fake.calls)
    assert calls["uri"] == (tmp_path / "run" / "mlruns").resolve().as_uri()
    assert calls["experiment"] == "sleuth" and calls["start"] == (None, "run")
    assert calls["params"] == {"trainer.lr": "1e-05"}
    assert calls["metrics"] == ({"loss": 0.25}, 2)  # MLflow rejects NaN: left out
    assert fake.calls[-1] == ("end", None)
    with MetricsWriter(tmp_path / "run", cfg):  # a resumed run continues the same MLflow run
        pass
    assert fake.calls[-2] == ("start", ("mlrun1", None))


def test_read_metrics_gives_todays_keys_for_new_and_old_rows(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path, LoggingConfig(tensorboard=False)) as w:
        w.log(1, {"time/iteration_s": 2.5, "rollout/reward_mean": 0.25})
    with (tmp_path / "metrics.jsonl").open("a") as f:  # a row as runs before the namespaces wrote it
        f.write(json.dumps({"iteration": 2, "time_iteration_s": 3.0, "val_pass@4": 0.5}) + "\n")
    rows = read_metrics(tmp_path)
    assert rows == [{"iteration": 1, "time/iteration_s": 2.5, "rollout/reward_mean": 0.25},
                    {"iteration": 2, "time/iteration_s": 3.0, "val/pass@4": 0.5}]
    with pytest.raises(UserError, match=r"no metrics\.jsonl"):
        read_metrics(tmp_path / "elsewhere")
