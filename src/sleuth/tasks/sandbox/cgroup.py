"""Per-call cgroups for the Python sandbox: one memory and process limit over a whole call.

    group = CallGroup.create("call-610004", memory_bytes=2**30, pids=10)   # None where unavailable
    ...  # the runner writes "0" into each of group.procs_files before it forks
    group.oom_killed(); group.kill_and_remove(deadline)

cgroup v2 where its memory and pids controllers can be enabled (a `sleuth-sandbox` group beside
this process's own, or under the root when this process is in the root): memory.max,
memory.swap.max=0, pids.max. Else cgroup v1 where the memory and pids hierarchies are mounted
(`sleuth-sandbox` under this process's own group in each): memory.limit_in_bytes (and
memory.memsw.limit_in_bytes), pids.max. Else None: the caller falls back to per-process and
per-uid rlimits (weaker: several processes of a call each get the memory limit).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

GROUP = "sleuth-sandbox"
NEEDED = {"memory", "pids"}


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fstype, options) of every cgroup file system this process sees."""
    rows = []
    with contextlib.suppress(OSError), open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 4 and fields[2] in ("cgroup", "cgroup2"):
                rows.append((fields[1].replace("\\040", " "), fields[2], set(fields[3].split(","))))
    return rows


def _own_paths() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and under "" its v2 path."""
    paths: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                paths[c] = path
    return paths


def _words(path: Path) -> set[str]:
    return set(path.read_text().split())


def _v2_parent(mount: str, own: str) -> Path | None:
    base = Path(mount) if own in ("", "/") else (Path(mount) / own.lstrip("/")).parent
    if not _words(base / "cgroup.controllers") >= NEEDED:
        return None
    if not _words(base / "cgroup.subtree_control") >= NEEDED:
        (base / "cgroup.subtree_control").write_text("+memory +pids")
    parent = base / GROUP
    parent.mkdir(mode=0o755, exist_ok=True)
    if not _words(parent / "cgroup.subtree_control") >= NEEDED:
        (parent / "cgroup.subtree_control").write_text("+memory +pids")
    return parent


@functools.cache
def parents() -> tuple[int, tuple[Path, ...]] | None:
    """Where call groups go: (2, (group,)), (1, (memory group, pids group)) or None (probed once)."""
    if os.geteuid() != 0:
        return None
    mounts, own = _mounts(), _own_paths()
    for mount, fstype, _ in mounts:
        if fstype == "cgroup2":
            with contextlib.suppress(OSError):
                found = _v2_parent(mount, own.get("", "/"))
                if found is not None:
                    return 2, (found,)
    v1 = {c: mount for mount, fstype, opts in mounts if fstype == "cgroup" for c in opts & NEEDED}
    if set(v1) == NEEDED:
        with contextlib.suppress(OSError):
            dirs = []
            for c in ("memory", "pids"):
                d = Path(v1[c]) / own.get(c, "/").lstrip("/") / GROUP
                d.mkdir(mode=0o755, exist_ok=True)
                dirs.append(d)
            return 1, tuple(dirs)
    return None


@dataclass
class CallGroup:
    version: int
    dirs: tuple[Path, ...]

    @classmethod
    def create(cls, name: str, memory_bytes: int, pids: int) -> CallGroup | None:
        """A fresh group per hierarchy with the limits set; None where cgroups are unavailable."""
        found = parents()
        if found is None:
            return None
        version, where = found
        group = cls(version, tuple(p / name for p in where))
        group.kill_and_remove(time.monotonic() + 2)  # a group of a crashed earlier call of this uid
        try:
            for d in group.dirs:
                d.mkdir(mode=0o755)
            if version == 2:
                (group.dirs[0] / "memory.max").write_text(str(memory_bytes))
                with contextlib.suppress(OSError):  # absent without swap accounting
                    (group.dirs[0] / "memory.swap.max").write_text("0")
                (group.dirs[0] / "pids.max").write_text(str(pids))
            else:
                (group.dirs[0] / "memory.limit_in_bytes").write_text(str(memory_bytes))
                with contextlib.suppress(OSError):
                    (group.dirs[0] / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
                (group.dirs[1] / "pids.max").write_text(str(pids))
        except OSError:
            group.kill_and_remove(time.monotonic() + 2)
            return None
        return group

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def oom_killed(self) -> bool:
        """Whether the kernel's OOM killer ended a process of this call (the memory limit)."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        with contextlib.suppress(OSError, ValueError):
            for line in (self.dirs[0] / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value) > 0
        return False

    def kill_and_remove(self, deadline: float) -> bool:
        """SIGKILL every process in the group and remove it; False if it outlived `deadline`."""
        for d in self.dirs:
            if not d.exists():
                continue
            kill = d / "cgroup.kill"
            with contextlib.suppress(OSError):
                if self.version == 2 and kill.exists():
                    kill.write_text("1")
            while True:
                with contextlib.suppress(OSError, ValueError):
                    for pid in (d / "cgroup.procs").read_text().split():
                        with contextlib.suppress(OSError):
                            os.kill(int(pid), signal.SIGKILL)
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        return False
                    time.sleep(0.002)
        return True
