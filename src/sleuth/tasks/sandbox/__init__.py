"""Run untrusted Python (a model's tool call) in a sandboxed subprocess.

    check_isolation("strict")                   # at start-up: refuse if a layer is missing
    result = run_python("print(2**10)", SandboxLimits(wall_s=10))
    result.reason, result.stdout          # "ok", "1024\\n"

Each call gets a uid of its own (no other live call on the machine has it), a cgroup where
available, and a child process (runner.py) that isolates itself before it runs the code.
Layers (`result.layers` says which held; CORE_LAYERS are what `isolation="strict"` requires):

- netns: a new network namespace: no network, no host abstract Unix sockets;
- mountns: a new mount namespace with a file view built from an allow-list (the system and
  interpreter directories read-only, /dev's harmless devices, a fresh /proc, the work dir as a
  size-capped tmpfs): no host /tmp, /run, other calls' dirs or data files, no Unix socket files;
- ipcns: a new IPC namespace: SysV shared memory, semaphores and queues die with the call;
- pidns: a new pid namespace: the call sees only its own processes, and ending its first process
  ends them all (the clean-up is one kill);
- uid: the code runs as the call's own uid/gid, which owns nothing but the work dir (its kernel
  keyrings emptied, a new session keyring);
- cgroup: memory.max and pids.max over all of the call's processes (where a cgroup v2 with those
  controllers, or the v1 memory and pids hierarchies, are writable; else only the rlimits hold);
- rlimits: CPU seconds, address space, processes (per uid), file and output size, open files;
- audit: a Python audit hook that names the first forbidden action (socket, process, write
  outside the work dir) as the reason.

The namespaces need CAP_SYS_ADMIN, the uid CAP_SETUID and CAP_SETGID (root has them all). The
wall-clock limit covers the call from start to clean-up.

`reason` is one of REASONS: "ok"; "error" (the code raised: its traceback is the output, which a
model may learn from); or a limit or forbidden action: "timeout", "memory", "output", "network",
"filesystem", "process", "killed" (ended by a signal). A sandbox that cannot set up what
`isolation="strict"` requires raises SandboxUnavailable instead of running the code.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sleuth.errors import UserError
from sleuth.tasks.sandbox.cgroup import CallGroup

RUNNER = Path(__file__).with_name("runner.py")
REASONS = ("ok", "error", "timeout", "memory", "output", "network", "filesystem", "process", "killed")
_EXIT_REASONS = {0: "ok", 1: "error", 3: "memory", 4: "network", 5: "filesystem", 6: "process", 7: "output"}
EXIT_SANDBOX = 8
CORE_LAYERS = ("netns", "mountns", "ipcns", "pidns", "uid", "rlimits", "audit")
NEEDS = {"netns": "CAP_SYS_ADMIN", "mountns": "CAP_SYS_ADMIN", "ipcns": "CAP_SYS_ADMIN",
         "pidns": "CAP_SYS_ADMIN", "uid": "CAP_SETUID and CAP_SETGID"}
UID_BASE, UID_COUNT = 610_000, 60_000
"""Sandbox calls use uids UID_BASE.. (no account needs to exist), each held by one live call."""
UID_LOCKS = ("/run/sleuth-sandbox/uids", "/var/run/sleuth-sandbox/uids")
"""Root-only folders of lock files, one per uid in use (flock, held for the call's life)."""
CLEAN_UP_S = 0.25
"""Kept of a call's wall-clock limit for the clean-up (killing its processes takes ~10 ms)."""
Isolation = Literal["strict", "warn"]


class SandboxUnavailable(UserError):
    """The sandbox cannot isolate code as promised on this machine (one line: what and why)."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    """The whole call, clean-up included."""
    cpu_s: int = 10
    memory_mb: int = 1024
    """Per call (all its processes and its work dir) where a cgroup holds; per process otherwise."""
    output_bytes: int = 64 * 1024
    """Per stream (stdout, stderr) and per file written in the work dir."""
    disk_mb: int = 64
    """Size of the work dir (a tmpfs in the call's mount namespace)."""
    max_processes: int = 8
    isolation: Isolation = "strict"
    """strict: a call whose CORE_LAYERS do not all hold raises SandboxUnavailable; warn: it runs."""


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


def _lock_dir() -> Path | None:
    """The first usable root-only folder of uid locks (created 0700; refused if others can write)."""
    for path in map(Path, UID_LOCKS):
        with contextlib.suppress(OSError):
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = path.stat()
            if st.st_uid == 0 and not st.st_mode & 0o077:
                return path
    return None


@contextlib.contextmanager
def claim_uid() -> Iterator[int]:
    """The lowest uid that no other live call on this machine holds, for as long as the block runs
    (a call's processes are all dead before it ends, so the next call may reuse its uid)."""
    locks = _lock_dir()
    if locks is None:
        raise SandboxUnavailable(f"no root-only folder for the sandbox's uid locks ({', '.join(UID_LOCKS)})")
    for uid in range(UID_BASE, UID_BASE + UID_COUNT):
        fd = os.open(locks / str(uid), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield uid
        finally:
            os.close(fd)
        return
    raise SandboxUnavailable(f"all {UID_COUNT} sandbox uids are in use")


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid` (where no pid namespace or cgroup holds the call's processes)."""
    for _ in range(10):
        found = False
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                status = Path(entry.path, "status").read_text()
            except OSError:
                continue
            line = next((ln for ln in status.splitlines() if ln.startswith("Uid:")), "")
            if line.split()[1:2] == [str(uid)]:
                found = True
                with contextlib.suppress(OSError):
                    os.kill(int(entry.name), signal.SIGKILL)
        if not found:
            return


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` as a script in a fresh sandbox; never raises for anything the code does."""
    limits = limits or SandboxLimits()
    start = time.perf_counter()
    if os.geteuid() != 0:
        return _run(code, limits, None, start)
    with claim_uid() as uid:
        return _run(code, limits, uid, start)


def _run(code: str, limits: SandboxLimits, uid: int | None, start: float) -> SandboxResult:
    work = Path(tempfile.mkdtemp(prefix="sleuth-sandbox-"))  # the work dir where no mount namespace holds
    private = Path(tempfile.mkdtemp(prefix="sleuth-sandbox-run-"))  # ours: code, output, layers, root
    group = None
    try:
        (private / "code.py").write_text(code)
        (private / "root").mkdir()
        if uid is not None:
            os.chown(work, uid, uid)
            group = CallGroup.create(f"call-{uid}", (limits.memory_mb + limits.disk_mb) * 2**20,
                                     limits.max_processes + 2)
        work.chmod(0o700)
        cfg = {"code_file": str(private / "code.py"), "host_work": str(work), "root": str(private / "root"),
               "uid": uid, "cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb, "disk_kb": limits.disk_mb * 1024,
               "max_processes": limits.max_processes, "file_bytes": limits.output_bytes + 1,
               "layers_file": str(private / "layers"), "cgroup_procs": group.procs_files if group else [],
               "required": CORE_LAYERS if limits.isolation == "strict" else []}
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        with open(private / "stdout", "wb") as out, open(private / "stderr", "wb") as err:
            proc = subprocess.Popen([sys.executable, "-I", str(RUNNER), json.dumps(cfg)], stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, cwd=private, env=env, start_new_session=True)
            deadline = start + limits.wall_s - min(CLEAN_UP_S, limits.wall_s / 10)
            try:
                code_ = proc.wait(timeout=max(0.0, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                code_ = None
            layers_text, oom = _end(proc, uid, group, private / "layers")
        reason, code_ = _reason(code_, oom)
        stdout, stderr = (_read(private / name, limits.output_bytes) for name in ("stdout", "stderr"))
        failed = layers_text is None or layers_text.startswith("!")
        if reason == "sandbox" and failed:  # the runner's own exit 8, not the code's os._exit(8)
            why = layers_text[1:] if layers_text else stderr.decode(errors="replace").strip()
            raise SandboxUnavailable(f"sandbox: {why[:500]}")
        if reason == "sandbox":
            reason = "error"
        layers = () if failed or layers_text is None else tuple(layers_text.split())
        if reason in ("ok", "error") and max(len(stdout), len(stderr)) > limits.output_bytes:
            reason = "output"
        return SandboxResult(reason, stdout.decode(errors="replace"), stderr.decode(errors="replace"), code_,
                             time.perf_counter() - start, layers)
    finally:
        if group is not None:
            group.kill_and_remove(time.monotonic() + 2)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(private, ignore_errors=True)


def _reason(code: int | None, oom: bool) -> tuple[str, int]:
    """The reason a call ended, from the runner's exit code (None: past the wall-clock limit)."""
    if code is not None and code > 128:
        code = 128 - code  # the code's process ended by a signal, as the runner reports it
    if oom:
        return "memory", code if code is not None else -signal.SIGKILL
    if code is None:
        return "timeout", -signal.SIGKILL
    if code == EXIT_SANDBOX:
        return "sandbox", code
    if code in (-signal.SIGXCPU, -signal.SIGKILL):
        return "timeout", code  # the CPU limit: SIGXCPU, then SIGKILL at the hard limit
    return _EXIT_REASONS.get(code, "killed" if code < 0 else "error"), code


def _end(proc: subprocess.Popen[bytes], uid: int | None, group: CallGroup | None,
         layers_file: Path) -> tuple[str | None, bool]:
    """Kill the call's processes (the runner's process group holds the pid namespace's first
    process, whose end ends the namespace); returns the layers file's text (None: not written)
    and whether the cgroup's memory limit killed a process."""
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    text = layers_file.read_text(errors="replace") if layers_file.exists() else None
    oom = group is not None and group.oom_killed()
    if group is not None:
        group.kill_and_remove(time.monotonic() + 2)
    elif uid is not None and "pidns" not in (text or "").split():
        _kill_uid(uid)
    return text, oom


def _read(path: Path, limit: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(limit + 1)


@functools.cache
def _probe() -> tuple[tuple[str, ...], str]:
    """The layers that hold on this machine, or why the sandbox cannot start (once per process)."""
    try:
        return run_python("pass", SandboxLimits(wall_s=30, isolation="warn")).layers, ""
    except SandboxUnavailable as e:
        return (), str(e)


def probe() -> tuple[str, ...]:
    """The layers that hold on this machine (one trivial call, once per process)."""
    return _probe()[0]


def check_isolation(mode: Isolation) -> tuple[str, ...]:
    """At start-up of a task that uses the sandbox: strict raises SandboxUnavailable (one line)
    when a layer of CORE_LAYERS does not hold; warn prints a warning. Either raises when no call
    can run at all. Returns the layers."""
    layers, why = _probe()
    if why:  # no call can run at all, in either mode
        raise SandboxUnavailable(f"the Python sandbox cannot run code on this machine: {why}")
    missing = [name for name in CORE_LAYERS if name not in layers]
    if missing:
        what = ", ".join(f"{name} (needs {NEEDS[name]})" if name in NEEDS else name for name in missing)
        if mode == "strict":
            raise SandboxUnavailable(f"task.sandbox.isolation=strict: the Python sandbox cannot set up {what} on "
                                     "this machine; run as root with those capabilities, or set "
                                     "task.sandbox.isolation=warn to run model code with less isolation")
        _say(f"sleuth: warning: the Python sandbox runs model code WITHOUT {what} (task.sandbox.isolation=warn)")
    if "cgroup" not in layers:
        _say("sleuth: note: no writable memory+pids cgroup: the sandbox limits memory per process and "
             "processes per uid only (rlimits)")
    return layers


@functools.cache
def _say(line: str) -> None:
    """Print a line on stderr once per process (a task is built once per curriculum level)."""
    print(line, file=sys.stderr)
