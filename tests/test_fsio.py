import os
import subprocess
import sys
from pathlib import Path

import pytest

from sleuth.errors import UserError
from sleuth.system import fsio


def read_tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_write_text_replaces_whole_file_and_leaves_no_temp(tmp_path):
    target = tmp_path / "sub" / "config.yaml"
    fsio.write_text(target, "a: 1\n")
    fsio.write_text(target, "a: 2\n")
    assert target.read_text() == "a: 2\n"
    assert [p.name for p in target.parent.iterdir()] == ["config.yaml"]


def test_write_into_a_folder_path_is_one_line_error(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(UserError, match="it is a folder, not a file"):
        fsio.write_text(tmp_path / "out", "x")


def test_atomic_folder_replaces_existing_folder(tmp_path):
    target = tmp_path / "model"
    with fsio.atomic_folder(target) as tmp:
        (tmp / "a.txt").write_text("old")
    with fsio.atomic_folder(target) as tmp:
        # While the new folder is being written the old one is still complete.
        assert read_tree(target) == {"a.txt": b"old"}
        (tmp / "b.txt").write_text("new")
    assert read_tree(target) == {"b.txt": b"new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_killed_writers_temporary_folder_is_removed_by_the_next_write(tmp_path):
    stale = tmp_path / ".tmp-model-pid999999999-abc"
    (stale / "sub").mkdir(parents=True)
    with fsio.atomic_folder(tmp_path / "model") as tmp:
        (tmp / "a.txt").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_failed_folder_write_keeps_old_target(tmp_path):
    target = tmp_path / "model"
    with fsio.atomic_folder(target) as tmp:
        (tmp / "a.txt").write_text("old")
    with pytest.raises(RuntimeError), fsio.atomic_folder(target) as tmp:
        (tmp / "half.txt").write_text("x")
        raise RuntimeError("crashed while writing")
    assert read_tree(target) == {"a.txt": b"old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_writers_own_error_after_it_removed_its_folder_propagates_unchanged(tmp_path):
    """Only the environment's failures become one-line errors: the disk probe sits in the target's
    parent, so a writer that deleted its temporary folder and then failed is not reported as a
    missing folder."""
    import shutil

    target = tmp_path / "out"
    with pytest.raises(RuntimeError, match="the writer's own bug"), fsio.atomic_folder(target) as tmp:
        shutil.rmtree(tmp)
        raise RuntimeError("the writer's own bug")
    assert not target.exists()


def test_aside_protocol_and_recovery_after_a_crash_between_renames(tmp_path, monkeypatch):
    target = tmp_path / "model"
    with fsio.atomic_folder(target) as tmp:
        (tmp / "a.txt").write_text("old")
    # Without renameat2 (another OS, a file system that lacks it) the old folder goes aside first.
    monkeypatch.setattr(fsio, "_exchange", lambda a, b: False)
    with fsio.atomic_folder(target) as tmp:
        (tmp / "b.txt").write_text("new")
    assert read_tree(target) == {"b.txt": b"new"}
    # A crash after "old aside" and before "new in" leaves no target, only the complete old copy
    # under the aside name of a process that is gone: the next reader puts it back.
    aside = tmp_path / ".old-model-pid999999999"
    os.replace(target, aside)
    fsio.clean_leftovers(tmp_path)
    assert read_tree(target) == {"b.txt": b"new"} and not aside.exists()


def test_clean_leftovers_spares_live_writers(tmp_path):
    dead = tmp_path / ".tmp-iter-000002-pid999999999-abc"
    live = tmp_path / f".tmp-iter-000003-pid{os.getppid()}-abc"
    for d in (dead, live):
        d.mkdir()
    (tmp_path / ".tmp-legacy").write_text("x")  # no pid: nobody is writing it
    fsio.clean_leftovers(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name]


# Run in its own process: a file-size limit (RLIMIT_FSIZE, with SIGXFSZ ignored so that a write past
# it fails with EFBIG) stands in for a full disk, as the real writers meet it.
_LIMITED_WRITERS = r"""
import resource, signal, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from sleuth.errors import UserError
from sleuth.system import fsio
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
target = Path(sys.argv[1])
with fsio.atomic_folder(target) as tmp:
    (tmp / "old.txt").write_text("complete")
resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))
writers = {"safetensors": lambda p: save_file({"w": torch.zeros(1 << 18)}, str(p)),
           "torch": lambda p: torch.save({"w": torch.zeros(1 << 18)}, p)}
for name, write in writers.items():
    try:
        with fsio.atomic_folder(target) as tmp:
            write(tmp / "big")
    except UserError as e:
        print(name, e)
"""


def test_a_native_writer_failing_on_the_disk_is_a_one_line_error_and_keeps_the_old_target(tmp_path):
    target = tmp_path / "checkpoint"
    out = subprocess.run([sys.executable, "-c", _LIMITED_WRITERS, str(target)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"{name} cannot write {target}: File too large" for name in ("safetensors", "torch")]
    assert read_tree(target) == {"old.txt": b"complete"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]


def test_check_writable_names_path_and_cause(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file, not a folder"):
        fsio.check_writable(tmp_path / "file" / "run")
    if os.geteuid() == 0:  # root ignores permission bits; /sys refuses new entries even to root
        readonly = Path("/sys/sleuth-test")
    else:
        readonly = tmp_path / "ro"
        readonly.mkdir(mode=0o555)
    with pytest.raises(UserError) as err:
        fsio.check_writable(readonly)
    text = str(err.value)
    assert text.startswith("cannot write into ") and "\n" not in text
    assert "ermission denied" in text or "not permitted" in text or "ead-only" in text


def test_folder_lock_names_the_holder_and_survives_dead_holders(tmp_path):
    # A process that takes the lock and is killed: its lock goes with it.
    code = ("import sys, os, signal; from sleuth.system.fsio import FolderLock; FolderLock(sys.argv[1]).acquire(); "
            "print('locked', flush=True); sys.stdin.readline()")
    env = dict(os.environ, PYTHONPATH=str(Path(fsio.__file__).parents[1]))
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(UserError, match=f"in use by another sleuth process \\(pid {holder.pid}\\)"):
        fsio.FolderLock(tmp_path).acquire()
    holder.kill()
    holder.wait()
    with fsio.FolderLock(tmp_path) as lock:  # the stale lock of the dead process is no obstacle
        assert lock.path.read_text() == str(os.getpid())
    assert lock.path.read_text() == ""
