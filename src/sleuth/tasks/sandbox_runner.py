"""The child side of sleuth.tasks.sandbox: isolate this process, then run untrusted Python code.

Run as `python -I sandbox_runner.py CONFIG_JSON` by `run_python` (never imported: it imports
nothing from sleuth, so it works under `-I` with only the standard library). In order:

1. Started as root: a new network namespace (no interface but a downed loopback: no network) and
   a new mount namespace in which /tmp, /var/tmp and /dev/shm are read-only binds and only the
   work dir is writable; then switch to a uid/gid of its own that owns nothing but the work dir,
   so the rest of the file system is read-only to it and its process count limit is its own.
2. Resource limits: CPU seconds, address space, processes, file size (a file or output past the
   limit fails with EFBIG), open files.
3. An audit hook (PEP 578) that ends the process at once with a reason code on the first socket,
   process creation, or write outside the work dir. It names *why* a run failed; the OS layers in
   1-2 are what hold when code goes around Python (ctypes).

Exit codes (mirrored in sandbox.py): 0 ok, 1 uncaught exception, 3 memory, 4 network,
5 file system, 6 process, 7 output.
"""

import ctypes
import json
import os
import resource
import sys

EXIT_MEMORY, EXIT_NETWORK, EXIT_FILESYSTEM, EXIT_PROCESS, EXIT_OUTPUT = 3, 4, 5, 6, 7
CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
PROCESS_EVENTS = {"os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system",
                  "subprocess.Popen", "os.kill", "os.killpg", "pty.spawn"}
PATH_EVENTS = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.chmod", "os.chown", "os.symlink",
               "os.link", "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move"}


def _isolate(work: str, uid: int) -> list[str]:
    """Namespaces, read-only world-writable dirs and our own uid; returns the layers that hold."""
    layers = []
    if os.geteuid() != 0:
        return layers
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    if libc.unshare(CLONE_NEWNET) == 0:
        layers.append("netns")
    if libc.unshare(CLONE_NEWNS) == 0 and libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0:
        ok = True
        for d in WORLD_WRITABLE:
            if os.path.isdir(d):
                b = d.encode()
                ok &= libc.mount(b, b, None, MS_BIND | MS_REC, None) == 0
                ok &= libc.mount(None, b, None, MS_REMOUNT | MS_BIND | MS_RDONLY, None) == 0
        ok &= _expose([sys.base_prefix, sys.prefix, *sys.path], libc)
        w = work.encode()
        ok &= libc.mount(w, w, None, MS_BIND, None) == 0
        ok &= libc.mount(None, w, None, MS_REMOUNT | MS_BIND, None) == 0
        if ok:
            layers.append("mountns")
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    layers.append("uid")
    return layers


def _expose(paths: list[str], libc) -> bool:
    """Make the interpreter and its libraries reachable for the sandbox uid: a directory on their
    path that others cannot enter (e.g. /root, 0700) is covered, in our mount namespace only, by an
    empty tmpfs (0755) into which just the needed child directory is bound back."""
    covered: set[str] = set()
    for target in {os.path.realpath(p) for p in paths if p and os.path.isdir(p)}:
        parts = target.strip("/").split("/")
        for i in range(len(parts) - 1):
            parent, child = "/" + "/".join(parts[:i]), parts[i]
            here = os.path.join(parent, child)
            if os.stat(here).st_mode & 0o001 and here not in covered:
                continue
            below = os.path.join(here, parts[i + 1])
            fd = os.open(below, os.O_PATH)  # a handle to it before the tmpfs hides it
            try:
                if here not in covered:
                    if libc.mount(b"tmpfs", here.encode(), b"tmpfs", 0, b"mode=0755,size=64k") != 0:
                        return False
                    covered.add(here)
                os.makedirs(below, exist_ok=True)
                if libc.mount(f"/proc/self/fd/{fd}".encode(), below.encode(), None, MS_BIND | MS_REC, None) != 0:
                    return False
            finally:
                os.close(fd)
    return True


def _limit(cfg: dict) -> None:
    mem = cfg["memory_mb"] * 2**20
    for res, value in ((resource.RLIMIT_CPU, cfg["cpu_s"]), (resource.RLIMIT_AS, mem),
                       (resource.RLIMIT_NPROC, cfg["max_processes"]), (resource.RLIMIT_FSIZE, cfg["file_bytes"]),
                       (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, (value, value))


def _audit(work: str):
    root = os.path.realpath(work) + os.sep

    def outside(path) -> bool:
        if isinstance(path, int) or path is None:
            return False
        p = os.fsdecode(path)
        return not os.path.realpath(os.path.join(work, p)).startswith(root)

    def hook(event: str, args: tuple) -> None:
        if event.startswith("socket."):
            os._exit(EXIT_NETWORK)
        if event in PROCESS_EVENTS:
            os._exit(EXIT_PROCESS)
        if event == "open" and len(args) >= 3:
            path, mode, flags = args[0], args[1] or "", args[2] or 0
            writes = any(c in str(mode) for c in "wax+") or bool(flags & WRITE_FLAGS)
            if writes and outside(path):
                os._exit(EXIT_FILESYSTEM)
        elif event in PATH_EVENTS and any(outside(a) for a in args[:2] if isinstance(a, str | bytes)):
            os._exit(EXIT_FILESYSTEM)

    return hook


def main() -> None:
    cfg = json.loads(sys.argv[1])
    work = cfg["work"]
    with open(cfg["layers_file"], "w") as f:  # opened as root: the parent's folder
        f.write(" ".join(_isolate(work, cfg["uid"])))
    os.chdir(work)
    _limit(cfg)
    with open(os.path.join(work, "main.py")) as f:
        code = f.read()
    sys.addaudithook(_audit(work))
    sys.argv = ["main.py"]
    namespace = {"__name__": "__main__", "__file__": "main.py"}
    try:
        exec(compile(code, "main.py", "exec"), namespace)
    except MemoryError:
        os._exit(EXIT_MEMORY)
    except OSError as e:
        if e.errno == 27:  # EFBIG: output or a file past the size limit
            os._exit(EXIT_OUTPUT)
        raise
    finally:
        try:
            sys.stdout.flush()
        except OSError:
            os._exit(EXIT_OUTPUT)


if __name__ == "__main__":
    main()
