"""The sandbox holds: every escape attempt ends with its reason, nothing leaks out."""

import os
from pathlib import Path

import pytest

from sleuth.tasks.sandbox import SandboxLimits, run_python

LIMITS = SandboxLimits(wall_s=4, cpu_s=2, memory_mb=512, output_bytes=4096)
ATTACKS = {
    "network": "import socket\ns = socket.socket()\ns.connect(('1.1.1.1', 80))",
    "filesystem": "open('/tmp/sleuth-sandbox-escape.txt', 'w').write('x')",
    "process": "import os\nwhile True:\n    os.fork()",
    "memory": "x = bytearray(10 * 2**30)",
    "output": "import sys\nsys.stdout.write('x' * (100 * 2**20))",
    "timeout": "while True:\n    pass",
}


def test_plain_code_runs_in_its_own_folder():
    r = run_python("import numpy, os\nopen('a.txt', 'w').write('hi')\nprint(open('a.txt').read(), 2**10)", LIMITS)
    assert (r.reason, r.stdout, r.exit_code) == ("ok", "hi 1024\n", 0)
    r = run_python("1/0", LIMITS)
    assert r.reason == "error" and "ZeroDivisionError" in r.stderr and "ZeroDivisionError" in r.output()


@pytest.mark.parametrize("reason", list(ATTACKS))
def test_escape_attempts_end_with_their_reason(reason):
    r = run_python(ATTACKS[reason], LIMITS)
    assert r.reason == reason, (r.reason, r.stderr[-300:])
    assert len(r.stdout) <= LIMITS.output_bytes + 1
    assert r.output().endswith(f"[sandbox: {reason}]")
    assert not Path("/tmp/sleuth-sandbox-escape.txt").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="the OS layers (namespaces, own uid) need root")
def test_os_layers_hold_without_the_audit_hook():
    assert set(run_python("print(1)", LIMITS).layers) >= {"netns", "mountns", "uid", "rlimits", "audit"}
    # ctypes goes around Python's audit hook: the OS layers must stop it on their own
    fork = run_python("import ctypes\nlibc = ctypes.CDLL(None)\nn = sum(libc.fork() >= 0 for _ in range(50))\n"
                      "print(n)", LIMITS)
    assert fork.reason == "ok" and all(int(line) < 50 for line in fork.stdout.split())  # process limit
    write = run_python("import ctypes\nlibc = ctypes.CDLL(None)\n"
                       "print(libc.open(b'/tmp/sleuth-sandbox-escape.txt', 0o101, 0o644))", LIMITS)
    assert write.stdout.strip() == "-1" and not Path("/tmp/sleuth-sandbox-escape.txt").exists()
    net = run_python("import ctypes\nlibc = ctypes.CDLL(None)\nfd = libc.socket(2, 1, 0)\n"
                     "addr = bytes([2, 0, 0, 80, 1, 1, 1, 1]) + bytes(8)\nprint(libc.connect(fd, addr, 16))", LIMITS)
    assert net.stdout.strip() == "-1"
