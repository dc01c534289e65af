"""One line with a resume hint when Ray's raylet dies under the driver.

When the raylet of the driver's node dies, Ray's core worker ends the driver process from C++
(exit status 1, no Python code runs, nothing printed). So a small watcher process, started once
the cluster is connected, holds a pipe from the driver: a driver that ends normally (any Python
exit, errors included) writes "done" first (`RayletWatch.close`, also at exit); a pipe that closes
without it while the raylet is dead means the raylet took the driver down, and the watcher prints

    sleuth: error: Ray's raylet on this machine (pid N) died, which ended the run; continue with
    `sleuth train --resume RUN` (from its newest valid checkpoint)

(one line) on the driver's stderr. It ignores SIGINT (Ctrl-C reaches the driver's process group).

    python -m sleuth.cluster.raylet_watch RAYLET_PID RUN_DIR   # stdin: the driver's pipe
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO

DONE = b"done\n"


def raylet_pid(socket_name: str) -> int | None:
    """The pid of the raylet process serving `socket_name` on this machine, if one is found."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmdline and cmdline[0].endswith(b"raylet") and f"--raylet_socket_name={socket_name}".encode() in cmdline:
            return int(entry.name)
    return None


def alive(pid: int) -> bool:
    """Whether pid runs (a zombie, dead but not yet reaped, counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def resume_hint(run_dir: Path) -> str:
    """How the stopped run continues (said at once: importing sleuth.run.checkpoint, i.e. torch, to name
    the checkpoint would cost the watcher seconds at the moment it speaks, or 150 MB while it waits)."""
    return f"continue with `sleuth train --resume {run_dir}` (from its newest valid checkpoint)"


class RayletWatch:
    """The driver's end: start the watcher; close() (also run at exit) tells it the end was normal."""

    def __init__(self, pid: int, run_dir: Path) -> None:
        self._proc: subprocess.Popen | None = subprocess.Popen(
            [sys.executable, "-m", "sleuth.cluster.raylet_watch", str(pid), str(run_dir)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        atexit.register(self.close)

    def close(self) -> None:
        if self._proc is None:
            return
        proc, self._proc = self._proc, None
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.write(DONE)
            proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        atexit.unregister(self.close)


def watch(pid: int, run_dir: Path, pipe: IO[bytes], err: IO[str]) -> bool:
    """Wait for the driver's pipe to close; print the line (and return True) when it closed without
    DONE and the raylet is dead."""
    data = pipe.read()
    if data.endswith(DONE) or alive(pid):
        return False
    print(f"sleuth: error: Ray's raylet on this machine (pid {pid}) died, which ended the run; "
          f"{resume_hint(run_dir)}", file=err, flush=True)
    return True


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.setpriority(os.PRIO_PROCESS, 0, 10)
    watch(int(sys.argv[1]), Path(sys.argv[2]), sys.stdin.buffer, sys.stderr)
