import io

from rich.console import Console

from sleuth.run.progress import Progress


def test_bars_count_and_draw_on_stderr_only(capsys):
    progress = Progress(enabled=True)
    progress.console = Console(file=io.StringIO(), force_terminal=True, width=100)
    progress._rich.live.console = progress.console
    with progress:
        bar = progress.bar("iterations", total=3)
        progress.advance(bar)
        progress.advance(bar, 2)
        task = progress._rich.tasks[0]
        assert (task.completed, task.total, task.finished) == (3, 3, True)
        inner = progress.bar("rollouts", total=4)
        progress.remove(inner)
        assert [t.description for t in progress._rich.tasks] == ["iterations"]
    drawn = progress.console.file.getvalue()
    assert "iterations" in drawn and "3/3" in drawn
    captured = capsys.readouterr()
    assert captured.out == ""


def test_disabled_when_not_a_terminal(capsys):
    progress = Progress()  # pytest captures stderr: not a terminal
    assert not progress.enabled
    with progress:
        progress.advance(progress.bar("x", total=1))
    assert capsys.readouterr().out == ""
