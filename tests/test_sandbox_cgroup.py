"""Per-call cgroups of the sandbox, on this machine's real cgroup file system (root only)."""

import os
import subprocess
import sys
import time

import pytest

from sleuth.tasks.sandbox.cgroup import CallGroup, parents

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="cgroups are created and joined as root"),
    pytest.mark.skipif(os.geteuid() == 0 and parents() is None,
                       reason="no writable cgroup v2 with memory and pids, nor v1 memory and pids hierarchies"),
]


def test_limits_are_set_and_the_group_is_killed_and_removed():
    group = CallGroup.create(f"test-{os.getpid()}", memory_bytes=64 * 2**20, pids=5)
    assert group is not None and all(d.is_dir() for d in group.dirs)
    if group.version == 2:
        assert (group.dirs[0] / "memory.max").read_text().strip() == str(64 * 2**20)
        assert (group.dirs[0] / "pids.max").read_text().strip() == "5"
    else:
        assert (group.dirs[0] / "memory.limit_in_bytes").read_text().strip() == str(64 * 2**20)
        assert (group.dirs[1] / "pids.max").read_text().strip() == "5"
    # a process that joins every hierarchy, then forks past pids.max and detaches
    joined = "".join(f"open({f!r}, 'w').write('0')\n" for f in group.procs_files)
    code = (joined + "import os, time\nkids = 0\nfor _ in range(10):\n    try:\n        if os.fork() == 0:\n"
            "            os.setsid()\n            time.sleep(60)\n            os._exit(0)\n        kids += 1\n"
            "    except OSError:\n        break\nprint(kids, flush=True)\ntime.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert int(proc.stdout.readline()) == 4  # pids.max = 5 counts the parent
        assert not group.oom_killed()
        start = time.monotonic()
        assert group.kill_and_remove(time.monotonic() + 5)
        assert time.monotonic() - start < 1.0 and not any(d.exists() for d in group.dirs)
        assert proc.wait(timeout=5) == -9
    finally:
        proc.kill()
        proc.wait()


def test_a_group_left_by_a_crashed_call_is_replaced():
    name = f"test-stale-{os.getpid()}"
    first = CallGroup.create(name, memory_bytes=2**30, pids=10)
    second = CallGroup.create(name, memory_bytes=2**29, pids=3)  # the same uid's next call
    try:
        assert first is not None and second is not None and second.dirs == first.dirs
        limit = "memory.max" if second.version == 2 else "memory.limit_in_bytes"
        assert (second.dirs[0] / limit).read_text().strip() == str(2**29)
    finally:
        assert second is not None and second.kill_and_remove(time.monotonic() + 5)
