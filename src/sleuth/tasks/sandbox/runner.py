"""The child side of sleuth.tasks.sandbox: isolate, then run untrusted Python code.

Run as `python -I runner.py CONFIG_JSON` by `run_python` (never imported: it imports
nothing from sleuth, so it works under `-I` with only the standard library). Three processes:

1. This one (root, in the host's pid namespace): joins the call's cgroups (memory.max, pids.max
   over every process of the call), unshares the network, IPC, mount and pid namespaces, forks,
   and exits with what the fork's exit status says (a signal s as 128 + s).
2. The fork, pid 1 of the new pid namespace: builds the call's file view from an allow-list (a
   private tmpfs root with read-only binds of /usr, /lib*, /bin, /sbin, a few /etc files and the
   interpreter's own directories, sleuth's own package hidden under an empty tmpfs, since its data
   holds answer keys; /dev with null, zero, full, random, urandom; a fresh /proc of
   this pid namespace; the work dir /sandbox, a size-capped tmpfs owned by the call's uid, also
   reachable as /tmp, where an interpreter directory under the host's /tmp is bound read-only at
   its own path), pivots into it, forks the code's process and waits for it. When it exits,
   the kernel kills everything left in the namespace.
3. The code's process: its own uid/gid (no supplementary groups, no new privileges), rlimits
   (CPU seconds, address space, processes, file size: a file or output past the limit fails with
   EFBIG, open files), then an audit hook (PEP 578) that ends it at once with a reason code on the
   first socket, process creation, or write outside the work dir. The hook names *why* a call
   failed; the OS layers are what hold when code goes around Python (ctypes).

Each layer that holds is written to the layers file just before the code runs; a layer in the
config's "required" that did not hold, or any failed set-up step, instead writes "!" and one line
there and exits 8 (never running the code). Exit codes (mirrored in sandbox.py): 0 ok, 1 uncaught
exception, 3 memory, 4 network, 5 file system, 6 process, 7 output, 8 sandbox set-up failed (only
with the "!" line: the code could exit 8 itself).
"""

import ctypes
import json
import os
import resource
import signal
import sys

EXIT_MEMORY, EXIT_NETWORK, EXIT_FILESYSTEM, EXIT_PROCESS, EXIT_OUTPUT, EXIT_SANDBOX = 3, 4, 5, 6, 7, 8
NAMESPACES = (("netns", 0x40000000), ("ipcns", 0x08000000), ("mountns", 0x00020000), ("pidns", 0x20000000))
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_REC, MS_PRIVATE, MNT_DETACH = 16384, 1 << 18, 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217, "riscv64": 41}
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219, "ppc64le": 271, "s390x": 280, "riscv64": 219}
KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_CLEAR, KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING = 1, 7, -4, -5
WORK = "/sandbox"
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/localtime")
DEVICES = ("null", "zero", "full", "random", "urandom")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
PROCESS_EVENTS = {"os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system",
                  "subprocess.Popen", "os.kill", "os.killpg", "pty.spawn"}
PATH_EVENTS = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.chmod", "os.chown", "os.symlink",
               "os.link", "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move"}


class SetupError(Exception):
    """A step of the isolation failed (one line: the step and the OS error)."""


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    return libc


def _mount(libc, source, target, fstype=None, flags=0, data=None) -> None:
    source, target, fstype, data = (s.encode() if isinstance(s, str) else s for s in (source, target, fstype, data))
    if libc.mount(source, target, fstype, flags, data) != 0:
        raise SetupError(f"mount {target.decode()}: {os.strerror(ctypes.get_errno())}")


def _in_view(root: str, path: str) -> str:
    """Where a host path lies in the view at `root`: /tmp is a link to the work dir there, so a
    path under /tmp (a project or virtual environment cloned under /tmp) lies inside the work dir."""
    if path == "/tmp" or path.startswith("/tmp/"):
        return root + WORK + path[len("/tmp"):]
    return root + path


def _bind_ro(libc, src: str, root: str) -> None:
    target = _in_view(root, src)
    if os.path.isdir(src):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(libc, src, target, None, MS_BIND)
    _mount(libc, None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def python_dirs() -> list[str]:
    """The interpreter's directories (prefixes and import path), outermost only, /usr's excluded
    (and / or /tmp themselves, which would show the host's whole tree or its other calls' dirs)."""
    found = [os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, sys.base_exec_prefix, sys.exec_prefix,
                                            *sys.path) if p and os.path.isdir(p)]
    system = [os.path.realpath(d) for d in SYSTEM_DIRS if os.path.isdir(d)]
    keep: list[str] = []
    for p in sorted(set(found), key=len):
        if p not in ("/", "/tmp") and not any(p == k or p.startswith(k.rstrip("/") + "/") for k in keep + system):
            keep.append(p)
    return keep


def _build_root(libc, root: str, uid: int, disk_kb: int) -> None:
    """The allow-list file view at `root`, then pivot into it (this mount namespace only)."""
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    _mount(libc, "tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    os.makedirs(root + WORK)
    _mount(libc, "tmpfs", root + WORK, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
           f"mode=0700,uid={uid},gid={uid},size={disk_kb}k,nr_inodes={max(256, disk_kb // 4)}")
    os.symlink(WORK, root + "/tmp")
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            os.symlink(os.readlink(d), root + d)
        elif os.path.isdir(d):
            _bind_ro(libc, d, root)
    for path in [f for f in ETC_FILES if os.path.isfile(f)] + python_dirs():
        _bind_ro(libc, path, root)
    package = os.path.realpath(os.path.join(os.path.dirname(__file__), "..", ".."))
    hidden = _in_view(root, package)
    if os.path.isdir(hidden):  # sleuth itself, answer keys in sleuth/data included: an empty dir
        _mount(libc, "tmpfs", hidden, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k")
    os.makedirs(root + "/dev")
    _mount(libc, "tmpfs", root + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
    for dev in DEVICES:
        if os.path.exists("/dev/" + dev):
            open(f"{root}/dev/{dev}", "a").close()
            _mount(libc, "/dev/" + dev, f"{root}/dev/{dev}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    os.makedirs(root + "/proc")
    _mount(libc, "proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise SetupError(f"pivot_root: no system call number known for {os.uname().machine}")
    os.chdir(root)
    if libc.syscall(number, b".", b".") != 0:
        raise SetupError(f"pivot_root: {os.strerror(ctypes.get_errno())}")
    if libc.umount2(b".", MNT_DETACH) != 0:
        raise SetupError(f"umount old root: {os.strerror(ctypes.get_errno())}")
    os.chdir("/")
    _mount(libc, None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


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


def _drop_privileges(uid: int) -> bool:
    try:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    except OSError:
        return False
    return True


def _fresh_keyrings(libc) -> None:
    """Kernel keyrings are per uid, not per namespace: empty the uid's own keyrings (what an earlier
    call of this uid left) and join a new session keyring (not the runner's, which the next call
    would share). Where keyctl is unavailable (seccomp), the code cannot use keyrings either."""
    number = SYS_KEYCTL.get(os.uname().machine)
    if number is not None:
        for keyring in (KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING):
            libc.syscall(number, KEYCTL_CLEAR, keyring)
        libc.syscall(number, KEYCTL_JOIN_SESSION_KEYRING, None)


def _status_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def _wait_for(pid: int) -> int:
    """Reap children (pid 1 inherits orphans) until `pid` ends; its exit code (signal s: 128+s)."""
    while True:
        try:
            done, status = os.wait()
        except ChildProcessError:
            return EXIT_SANDBOX
        if done == pid:
            return _status_code(status)


def _fail(layers_fd: int, message: str) -> None:
    """End the call because a set-up step failed: the message, marked "!", goes where the layers
    would (a file the code never reaches: an exit code alone could be faked by the code), exit 8."""
    try:
        os.write(layers_fd, ("!" + message.replace("\n", " ")).encode())
    finally:
        os._exit(EXIT_SANDBOX)


def _code_process(cfg: dict, code: str, layers: list[str], note: str, libc, layers_fd: int) -> None:
    """The forked process that runs the code (never returns)."""
    try:
        work = WORK if "mountns" in layers else cfg["host_work"]
        if os.geteuid() == 0 and _drop_privileges(cfg["uid"]):
            layers.append("uid")
            _fresh_keyrings(libc)
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        layers += ["rlimits", "audit"]
        missing = [name for name in cfg["required"] if name not in layers]
        if missing:
            _fail(layers_fd, f"the sandbox could not set up {', '.join(missing)}{note}")
        os.environ.update(HOME=work, TMPDIR=work)
        os.chdir(work)
        with open("main.py", "w") as f:
            f.write(code)
        _limit(cfg)
        os.write(layers_fd, " ".join(layers).encode())  # opened before the pivot: a host file
        os.close(layers_fd)
        sys.addaudithook(_audit(work))
    except BaseException as e:
        _fail(layers_fd, f"the sandbox failed to start: {type(e).__name__}: {e}")
    status = 1
    try:
        status = _execute(code)
    finally:
        os._exit(status)


def _execute(code: str) -> int:
    """Run the code; its exit status (never raises, whatever the code did to sys.stdout/stderr)."""
    sys.argv = ["main.py"]
    namespace = {"__name__": "__main__", "__file__": "main.py"}
    status = 0
    try:
        exec(compile(code, "main.py", "exec"), namespace)
    except MemoryError:
        return EXIT_MEMORY
    except SystemExit as e:  # sys.exit(n) cannot pose as a sandbox reason: 0 or 1 only
        status = 0 if e.code in (None, 0) else 1
        if e.code is not None and not isinstance(e.code, int):
            _report(str(e.code))
    except BaseException as e:  # the code's own error: its traceback without this file's frame
        if isinstance(e, OSError) and e.errno in (27, 28):  # EFBIG, ENOSPC: past a size limit
            return EXIT_OUTPUT
        _report(e)
        status = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:
        return EXIT_OUTPUT
    except BaseException:  # the code replaced the streams with something that cannot flush
        pass
    return status


def _report(error: BaseException | str) -> None:
    """The code's error on its stderr, best effort."""
    try:
        if isinstance(error, str):
            print(error, file=sys.stderr)
            return
        try:  # imported here: a call that raises nothing does not pay for it
            import traceback
        except ImportError:  # no mount namespace, and the stdlib is out of the uid's reach
            print(f"{type(error).__name__}: {error}", file=sys.stderr)
        else:
            tb = error.__traceback__
            traceback.print_exception(type(error), error, tb.tb_next if tb else None)
    except BaseException:
        pass


def _init(cfg: dict, code: str, layers: list[str], libc, layers_fd: int) -> None:
    """The fork: pid 1 of the call's pid namespace where one holds (never returns)."""
    note = ""
    try:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if "mountns" in layers:
            try:
                _build_root(libc, cfg["root"], cfg["uid"], cfg["disk_kb"])
            except (SetupError, OSError) as e:
                layers.remove("mountns")
                note = f" ({e})"
        pid = os.fork()
        if pid == 0:
            _code_process(cfg, code, layers, note, libc, layers_fd)
        os._exit(_wait_for(pid))
    except BaseException as e:  # never the runner's traceback as a tool's output
        _fail(layers_fd, f"the sandbox failed to start: {type(e).__name__}: {e}")


def main() -> None:
    cfg = json.loads(sys.argv[1])
    try:
        layers_fd = os.open(cfg["layers_file"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError as e:  # no layers file: the parent knows this exit 8 is ours
        print(f"the sandbox failed to start: {e}", file=sys.stderr)
        os._exit(EXIT_SANDBOX)
    try:
        with open(cfg["code_file"]) as f:
            code = f.read()
        layers: list[str] = []
        libc = _libc()
        if os.geteuid() == 0:
            procs = cfg["cgroup_procs"]
            for path in procs:
                with open(path, "w") as f:
                    f.write("0")
            if procs:
                layers.append("cgroup")
            layers += [name for name, flag in NAMESPACES if libc.unshare(flag) == 0]
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        pid = os.fork()
    except BaseException as e:
        _fail(layers_fd, f"the sandbox failed to start: {type(e).__name__}: {e}")
    if pid == 0:
        _init(cfg, code, layers, libc, layers_fd)
    os._exit(_wait_for(pid))


if __name__ == "__main__":
    main()
