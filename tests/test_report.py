"""`sleuth report`: plots, the power-law fit, the cost frontier, report.html, bad input, Chromium."""

from __future__ import annotations

import base64
import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from sleuth.cli import main
from sleuth.config import Config, LoggingConfig, dump_config
from sleuth.eval.plots import fit_power_law, pareto_frontier, reward_against_minutes
from sleuth.eval.report import load_eval_summaries, load_run, select_samples, write_report
from sleuth.run.metrics import MetricsWriter, upgrade_row

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALL_PLOTS = {"reward", "val_power_law", "completion_len", "entropy_kl", "clip_frac", "loss", "time"}


def make_run(run_dir: Path, iterations: int = 40, eval_every: int = 5, exponent: float = 0.3,
             flat: bool = False) -> Path:
    """A run directory written through MetricsWriter, with validation on an exact power law.

    flat: the metric names of runs written before the namespaces (reward_mean, time_rollout_s, ...)."""
    rng = np.random.default_rng(0)
    (run_dir).mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(Config()))
    with MetricsWriter(run_dir, LoggingConfig(tensorboard=False)) as w:
        for it in range(iterations):
            m = {"reward_mean": 0.2 + 0.01 * it, "loss": float(rng.normal()), "grad_norm": 1.0,
                 "kl": 0.001 * it, "entropy": 2.0 - 0.01 * it, "clip_frac_low": 0.01, "clip_frac_high": 0.02,
                 "completion_tokens_mean": 100 + it, "tokens": 4000, "time_rollout_s": 3.0,
                 "time_score_s": 0.2, "time_train_s": 2.0, "time_sync_s": 0.5}
            if it % eval_every == 0:
                m["val_reward"] = 0.05 * max(it, 1) ** exponent if it else 0.04
                w.log_samples(it, [
                    {"problem_id": f"p{j}", "reward": 1.0, "kind": "best",
                     "text": f"<answer>A & B</answer> it{it}"} for j in range(2)] + [
                    {"problem_id": f"p{j}", "reward": 0.0, "kind": "worst", "text": "<script>x</script>"}
                    for j in range(2)])
            w.log(it, m if flat else upgrade_row(m))
    return run_dir


def test_fit_power_law_recovers_exponent_and_ignores_nonpositive_points() -> None:
    x = np.array([0.0, 1, 2, 4, 8, 16, 32])
    y = 0.07 * np.where(x > 0, x, 1) ** 0.42
    y[0] = 0.0
    c, b = fit_power_law(x, y)
    assert c == pytest.approx(0.07) and b == pytest.approx(0.42)
    assert fit_power_law(np.array([0.0, 5.0]), np.array([0.1, 0.2])) is None  # one usable point


def test_power_law_fit_stops_at_the_best_validation_point() -> None:
    from sleuth.eval.plots import plot_power_law

    rows = [{"iteration": it, "val/reward": 0.1 * it**0.5} for it in (1, 2, 4, 8, 16)]
    rows += [{"iteration": 32, "val/reward": 0.2}, {"iteration": 64, "val/reward": 0.1}]  # decline
    plot, fit = plot_power_law(rows)
    assert fit is not None and fit[1] == pytest.approx(0.5) and fit[0] == pytest.approx(0.1)
    assert plot is not None and "fitted up to the best validation point (iteration 16)" in plot.note


def test_pareto_frontier_keeps_models_no_other_beats_on_both() -> None:
    costs = [1.0, 2.0, 3.0, 2.5, 0.5]
    accs = [0.4, 0.6, 0.7, 0.5, 0.1]
    assert pareto_frontier(costs, accs) == [4, 0, 1, 2]  # model 3 costs more than 1 and scores less


def test_select_samples_keeps_first_and_latest_within_budget() -> None:
    samples = [{"iteration": it, "problem_id": f"p{j}", "kind": kind, "reward": float(kind == "best")}
               for it in range(0, 100, 10) for j in range(2) for kind in ("worst", "best")]
    shown = select_samples(samples, 10)
    assert len(shown) == 10
    assert sorted({s["iteration"] for s in shown}) == [0, 80, 90]
    # Each problem's best right before its worst.
    assert [(s["problem_id"], s["kind"]) for s in shown[:4]] == [("p0", "best"), ("p0", "worst"),
                                                                 ("p1", "best"), ("p1", "worst")]
    assert select_samples(samples, 0) == []


def test_report_writes_every_plot_and_a_self_contained_page(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", exponent=0.3)
    out = tmp_path / "out"
    assert main(["report", str(run), "--out", str(out)]) == 0
    assert {p.stem for p in out.glob("*.png")} == ALL_PLOTS
    for png in out.glob("*.png"):
        assert png.read_bytes().startswith(PNG_MAGIC)
    page = (out / "report.html").read_text()
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == len(ALL_PLOTS)
    assert all(base64.b64decode(i).startswith(PNG_MAGIC) for i in images)
    assert "src=\"http" not in page and "<link" not in page  # nothing fetched from outside
    # The fitted exponent of the exact power law (iterations 5..35) is reported.
    m = re.search(r"iteration\^([0-9.]+)", page)
    assert m and float(m.group(1)) == pytest.approx(0.3, abs=1e-3)
    # Config and samples, HTML-escaped.
    assert "samples_per_task: 8" in page
    assert "&lt;answer&gt;A &amp; B&lt;/answer&gt; it35" in page
    assert "<script>x</script>" not in page and "&lt;script&gt;x&lt;/script&gt;" in page


def test_missing_metric_keys_give_only_the_plots_with_data(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with MetricsWriter(run, LoggingConfig(tensorboard=False)) as w:
        for it in range(5):
            w.log(it, {"rollout/reward_mean": it / 5, "time/rollout_s": 1.0})
    out = tmp_path / "out"
    page = write_report(run, out)
    assert {p.stem for p in out.glob("*.png")} == {"reward", "time"}
    assert "no config.yaml" in page.read_text()


def test_bad_input_exits_2_with_one_line(tmp_path: Path, capsys) -> None:
    assert main(["report", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "does not exist" in err
    run = tmp_path / "run"
    run.mkdir()
    assert main(["report", str(run)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    (run / "metrics.jsonl").write_text('{"iteration": 0, "reward_mean": 1}\n{"iter\n{"iteration": 2}\n')
    assert main(["report", str(run)]) == 2
    assert "metrics.jsonl line 2 is not valid JSON" in capsys.readouterr().err
    (run / "metrics.jsonl").write_text('{"iteration": "zero"}\n')
    assert main(["report", str(run)]) == 2
    assert "line 1 is not an object with an integer" in capsys.readouterr().err


def test_partial_last_line_is_skipped_with_a_warning(tmp_path: Path, capsys) -> None:
    run = make_run(tmp_path / "run", iterations=6)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"iteration": 6, "reward_m')
    assert main(["report", str(run)]) == 0
    captured = capsys.readouterr()
    assert "skipped a partial last line" in captured.err
    assert Path(captured.out.strip()) == run / "report" / "report.html"
    assert "skipped a partial last line" in (run / "report" / "report.html").read_text()


def _summary(folder: Path, model: str, acc: float, price: float, tokens: float) -> Path:
    """A summary.json in the shape `sleuth eval` writes (sleuth/cli/eval.py)."""
    folder.mkdir(parents=True, exist_ok=True)
    k = 4
    summary = {"k": k, "problems": 16, "avg": acc, "avg_se": 0.02, "pass_k": acc, "pass_se": 0.03, "maj": acc,
               "maj_se": 0.03, "mean_completion_tokens": tokens / k - 50, "chance": 0.1, "mean_prompt_tokens": 50,
               "time_s": 3.0, "per_problem": [acc] * 16, "model": model, "task": "temporal_clue",
               "tokens_per_problem": tokens, "price_per_million_tokens": price,
               "cost_per_problem": tokens * price / 1e6, f"avg@{k}": acc, f"pass@{k}": acc, f"maj@{k}": acc}
    (folder / "summary.json").write_text(json.dumps(summary, indent=1))
    (folder / "samples.jsonl").write_text('{"problem_id": "p0", "reward": 1.0, "text": "x"}\n')
    return folder / "summary.json"


def test_eval_summaries_give_a_cost_accuracy_plot(tmp_path: Path) -> None:
    evals = tmp_path / "evals"
    _summary(evals / "base-k4", "smollm2-135m-instruct", 0.2, 0.5, 1200)
    _summary(evals / "trained-k4", str(tmp_path / "runs" / "trained"), 0.5, 0.5, 1000)
    (evals / "other.json").write_text('{"unrelated": true}')  # skipped inside a folder
    entries = load_eval_summaries([evals])
    assert [e["model"] for e in entries] == ["smollm2-135m-instruct", "trained"]
    assert entries[0]["cost"] == pytest.approx(0.0006) and entries[1]["accuracy"] == 0.5
    assert entries[0]["pass"] == 0.2 and entries[0]["tokens"] == 1200
    out = tmp_path / "out"
    assert main(["report", "--eval", str(evals), "--out", str(out)]) == 0
    assert (out / "eval_frontier.png").read_bytes().startswith(PNG_MAGIC)
    page = (out / "report.html").read_text()
    assert "<td>trained</td>" in page and page.count("data:image/png;base64,") == 1
    # Zero prices (the default): tokens per problem stand in for cost.
    _summary(evals / "base-k4", "smollm2-135m-instruct", 0.2, 0.0, 1200)
    from sleuth.eval.plots import plot_eval_frontier

    plot, why = plot_eval_frontier(load_eval_summaries([evals]))
    assert plot is not None and why == "" and plot.png.startswith(PNG_MAGIC)
    # With a run directory too, the page holds the run's plots and the cost plot.
    run = make_run(tmp_path / "run", iterations=6)
    assert main(["report", str(run), "--eval", str(evals / "trained-k4" / "summary.json")]) == 0
    assert (run / "report" / "eval_frontier.png").exists() and (run / "report" / "reward.png").exists()


def test_bad_eval_summary_is_a_user_error(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": "m"}')
    assert main(["report", "--eval", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "has no numeric \"avg@k\"" in capsys.readouterr().err
    assert main(["report"]) == 2
    assert "needs a RUN_DIR or --eval" in capsys.readouterr().err


PROBE = """<script>window.addEventListener('load', () => {
  const imgs = [...document.images];
  document.body.setAttribute('data-img-widths', imgs.map(i => i.complete ? i.naturalWidth : -1).join(','));
  document.body.setAttribute('data-samples', document.querySelectorAll('div.sample').length);
  document.body.setAttribute('data-sample-text', document.querySelector('div.sample pre').textContent);
});</script>"""


def test_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        reason = "no chromium binary on PATH (apt-get install chromium; `bash install.sh dev` does it as root)"
        if os.environ.get("CI"):
            pytest.fail(f"CI must render the report: {reason}")
        print(f"skipping: {reason}")
        pytest.skip(reason)
    run = make_run(tmp_path / "run")
    page = write_report(run, tmp_path / "out", max_samples=6)
    # A copy with a probe script: the report itself carries no scripts.
    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", probe.as_uri()]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    body = re.search(r"<body([^>]*)>", done.stdout)
    assert body, done.stdout[:500]
    attrs = dict(re.findall(r'([\w-]+)="([^"]*)"', body.group(1)))
    widths = [int(w) for w in attrs["data-img-widths"].split(",")]
    assert len(widths) == len(ALL_PLOTS) and all(w > 0 for w in widths)  # every plot decoded
    assert attrs["data-samples"] == "6"
    # The browser shows the completion's text as written, not as markup.
    assert html.unescape(attrs["data-sample-text"]) == "<answer>A & B</answer> it0"


def test_held_out_reward_against_wall_clock_minutes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with MetricsWriter(run, LoggingConfig(tensorboard=False)) as w:
        w.log(0, {"val/reward": 0.10, "val/reward_se": 0.02, "val/chance": 0.4, "time/elapsed_min": 1.5})
        w.log(1, {"rollout/reward_mean": 0.2, "time/elapsed_min": 3.0})  # no evaluation: not a point
        w.log(2, {"rollout/reward_mean": 0.3, "val/reward": 0.25, "val/reward_se": 0.03, "time/elapsed_min": 4.5})
        w.log(3, {"rollout/reward_mean": 0.3, "val/reward": 0.30})  # no clock (an older run): not a point
    minutes, reward, se, key = reward_against_minutes(load_run(run).metrics)
    assert key == "val/reward"
    assert minutes.tolist() == [1.5, 4.5] and reward.tolist() == [0.10, 0.25] and se.tolist() == [0.02, 0.03]
    out = tmp_path / "out"
    page = write_report(run, out).read_text()
    assert (out / "reward_time.png").read_bytes().startswith(PNG_MAGIC)
    assert 'id="plot-reward_time"' in page
def test_a_run_with_the_old_flat_names_reports_the_same(tmp_path: Path) -> None:
    """Run directories written before the metric namespaces still give every plot and number."""
    new, old = make_run(tmp_path / "new"), make_run(tmp_path / "old", flat=True)
    assert "reward_mean" in (old / "metrics.jsonl").read_text()
    assert '"rollout/reward_mean"' in (new / "metrics.jsonl").read_text()
    assert load_run(old).metrics == load_run(new).metrics
    pages = [write_report(run, tmp_path / f"out-{run.name}") for run in (new, old)]
    assert {p.stem for p in (tmp_path / "out-old").glob("*.png")} == ALL_PLOTS
    assert pages[0].read_text().replace("new", "old") == pages[1].read_text()


@pytest.mark.parametrize("depth", [50, 900, 990, 5_000, 200_000])
def test_deeply_nested_lines_and_summaries_never_end_the_report(tmp_path: Path, capsys, depth: int) -> None:
    """Nested too deeply to read: the line is skipped with a warning; readable but deep: shown."""
    run = make_run(tmp_path / "run", iterations=6)
    nested = "[" * depth + "]" * depth
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"iteration": 6, "reward_mean": 0.5, "deep": ' + nested + "}\n")
        f.write('{"iteration": 7, "rollout/reward_mean": 0.5}\n')
    with (run / "samples.jsonl").open("a") as f:
        f.write('{"iteration": 6, "problem_id": "p", "reward": 1.0, "kind": "best", "text": ' + nested + "}\n")
    evals = tmp_path / "evals"
    evals.mkdir()
    (evals / "deep.json").write_text('{"avg@k": 0.5, "k": 1, "model": ' + nested + "}")
    _summary(evals / "ok", "m", 0.4, 1.0, 100.0)
    assert main(["report", str(run), "--eval", str(evals)]) == 0
    captured = capsys.readouterr()
    assert Path(captured.out.strip()) == run / "report" / "report.html"
    assert "Traceback" not in captured.err
    if depth > 2000:
        assert "nested too deeply" in captured.err
    assert main(["report", str(run), "--out", str(tmp_path / "r2"), "--eval", str(evals / "deep.json")]) in (0, 2)
    err = capsys.readouterr().err
    assert "Traceback" not in err and all(line.startswith("sleuth") for line in err.splitlines())


def test_per_kind_accuracy_is_a_curve_over_the_run(tmp_path: Path) -> None:
    """val/kind/KIND from every held-out evaluation (before, every few iterations, after) becomes
    one line per kind, in the who / weapon / where / when / why / bonus order."""
    from sleuth.eval.plots import plot_kinds
    from sleuth.eval.report import load_run

    run = tmp_path / "run"
    with MetricsWriter(run, LoggingConfig(tensorboard=False)) as w:
        for it in range(0, 9):
            m: dict = {"rollout/reward_mean": 0.3} if it else {}
            if it % 2 == 0:
                m |= {"val/reward": 0.3 + it / 50, "val/kind/bonus": 0.2, "val/kind/who": 0.3 + it / 40,
                      "val/kind/where": 0.5}
            w.log(it, m)
    rows = load_run(run).metrics
    plot = plot_kinds(rows)
    assert plot is not None and plot.name == "kinds" and plot.png.startswith(PNG_MAGIC)
    out = tmp_path / "out"
    write_report(run, out)
    assert (out / "kinds.png").is_file()
    assert plot_kinds([{"iteration": 1, "val/reward": 0.3}]) is None
