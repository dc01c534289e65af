"""Run untrusted Python (a model's tool call) in a sandboxed subprocess.

    result = run_python("print(2**10)", SandboxLimits(wall_s=10))
    result.reason, result.stdout          # "ok", "1024\\n"

Each run gets a fresh temp dir and a child process (sandbox_runner.py) that isolates itself before
it runs the code. Layers (`result.layers` says which held on this machine):

- network: a new network namespace (root only); the audit hook also stops any socket at once;
- file system: a new mount namespace with /tmp, /var/tmp, /dev/shm read-only and a uid of its own
  that owns only the temp dir (root only); elsewhere the audit hook stops writes outside it;
- resources: CPU seconds, address space, process count, file/output size (rlimits), a wall-clock
  limit enforced here (the child's process group and every process of its uid are killed).

`reason` is one of REASONS: "ok"; "error" (the code raised: its traceback is the output, which a
model may learn from); or a limit or forbidden action: "timeout", "memory", "output", "network",
"filesystem", "process", "killed" (ended by a signal).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

RUNNER = Path(__file__).with_name("sandbox_runner.py")
REASONS = ("ok", "error", "timeout", "memory", "output", "network", "filesystem", "process", "killed")
_EXIT_REASONS = {0: "ok", 1: "error", 3: "memory", 4: "network", 5: "filesystem", 6: "process", 7: "output"}
_UID_BASE = 610_000
"""Sandbox runs use uids from here on (no account needs to exist): one per concurrent run, so
its process limit and the clean-up kill touch only its own processes."""
_uids = itertools.count()


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    output_bytes: int = 64 * 1024
    """Per stream (stdout, stderr) and per file written in the temp dir."""
    max_processes: int = 8


@dataclass
class SandboxResult:
    reason: str
    stdout: str
    stderr: str
    exit_code: int
    time_s: float
    layers: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.reason == "ok"

    def output(self, max_chars: int = 2000) -> str:
        """What a model sees as the tool result: stdout, then stderr, trimmed, with the reason."""
        text = self.stdout + (("\n" if self.stdout else "") + self.stderr if self.stderr else "")
        if len(text) > max_chars:
            text = text[: max_chars // 2] + "\n...\n" + text[-max_chars // 2:]
        return text if self.reason in ("ok", "error") else f"{text}\n[sandbox: {self.reason}]".lstrip()


def _next_uid() -> int:
    return _UID_BASE + (os.getpid() % 997) * 1000 + next(_uids) % 1000


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid` (what a fork that escaped the process group left behind)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            status = Path(entry.path, "status").read_text()
        except OSError:
            continue
        line = next((ln for ln in status.splitlines() if ln.startswith("Uid:")), "")
        if line.split()[1:2] == [str(uid)]:
            with contextlib.suppress(OSError):
                os.kill(int(entry.name), signal.SIGKILL)


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` as a script in a fresh sandbox; never raises for anything the code does."""
    limits = limits or SandboxLimits()
    uid = _next_uid()
    work = Path(tempfile.mkdtemp(prefix="sleuth-sandbox-"))
    private = Path(tempfile.mkdtemp(prefix="sleuth-sandbox-out-"))  # ours: output files, layers
    start = time.perf_counter()
    try:
        (work / "main.py").write_text(code)
        if os.geteuid() == 0:
            os.chown(work, uid, uid)
        work.chmod(0o700)
        cfg = {"work": str(work), "uid": uid, "cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb,
               "max_processes": limits.max_processes, "file_bytes": limits.output_bytes + 1,
               "layers_file": str(private / "layers")}
        env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        with open(private / "stdout", "wb") as out, open(private / "stderr", "wb") as err:
            proc = subprocess.Popen([sys.executable, "-I", str(RUNNER), json.dumps(cfg)], stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, cwd=work, env=env, start_new_session=True)
            try:
                code_ = proc.wait(timeout=limits.wall_s)
                reason = _EXIT_REASONS.get(code_, "killed" if code_ < 0 else "error")
            except subprocess.TimeoutExpired:
                code_, reason = -signal.SIGKILL, "timeout"
            finally:
                _end(proc, uid)
        if code_ in (-signal.SIGXCPU, -signal.SIGKILL) and reason == "killed":
            reason = "timeout"  # the CPU limit: SIGXCPU, then SIGKILL at the hard limit
        stdout, stderr = (_read(private / name, limits.output_bytes) for name in ("stdout", "stderr"))
        if reason in ("ok", "error") and max(len(stdout), len(stderr)) > limits.output_bytes:
            reason = "output"
        layers_file = private / "layers"
        layers = tuple(layers_file.read_text().split()) if layers_file.exists() else ()
        return SandboxResult(reason, stdout.decode(errors="replace"), stderr.decode(errors="replace"), code_,
                             time.perf_counter() - start, (*layers, "rlimits", "audit"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(private, ignore_errors=True)


def _end(proc: subprocess.Popen[bytes], uid: int) -> None:
    """Kill the run's process group and, where we switched uid, every process left of that uid."""
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if os.geteuid() == 0:
        _kill_uid(uid)


def _read(path: Path, limit: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(limit + 1)
