"""Writing files and folders atomically: a reader sees the old version or the new one, never a part.

    write_text(run_dir / "config.yaml", text)           # a file
    with atomic_folder(run_dir / "model") as tmp:        # a folder: fill tmp, it replaces the target
        policy.export_merged(tmp)

Everything is written into a hidden temporary sibling (`.tmp-NAME-pidPID-…`, same file system, so the
final rename is atomic), flushed to disk, then renamed over the target. A file is replaced in one
`os.replace`. A folder cannot be renamed over a non-empty folder, so an existing target is swapped
with the new one in one atomic `renameat2(RENAME_EXCHANGE)` where Linux offers it, then the old copy
(now under the temporary name) is deleted. Where the swap is unavailable the old target is first
renamed aside to `.old-NAME-pidPID`, the new one renamed in, then the old one deleted; a crash between
the two renames leaves the target missing and the complete old copy aside, and `recover(target)`
(called by every reader in this module and by `atomic_folder` itself) puts it back.

Leftovers of a killed writer (temporary or aside folders whose pid is dead) are removed by
`clean_leftovers(parent)`. Errors of the environment (read-only folder, full disk, a folder where a
file is expected) become one-line `UserError`s naming the path and the cause, also where a native
writer (safetensors, torch.save) reports them in its own exception type.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from sleuth.errors import UserError

TMP_PREFIX = ".tmp-"
ASIDE_PREFIX = ".old-"
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_PID_TAG = re.compile(r"-pid(\d+)(?=-|$)")


def describe_os_error(err: OSError, path: str | Path | None = None) -> str:
    """'PATH: cause' in words (read-only file system, no space left, is a directory, …)."""
    where = err.filename or path
    cause = err.strerror or str(err)
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        cause += " (the disk is full)"
    return f"{where}: {cause}" if where else cause


def environment_error(err: OSError, doing: str, path: str | Path | None = None) -> UserError:
    """A one-line UserError for an OSError met while `doing` something (e.g. "cannot write")."""
    return UserError(f"{doing} {describe_os_error(err, path)}")


def check_writable(folder: str | Path) -> None:
    """Fail early, before expensive work, when `folder` (or its nearest existing parent) cannot take
    new files: a probe file is created and removed."""
    path = Path(folder)
    probe_dir = path
    while not probe_dir.exists() and probe_dir != probe_dir.parent:
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        raise UserError(f"cannot write into {path}: {probe_dir} is a file, not a folder")
    try:
        fd, name = tempfile.mkstemp(prefix=f"{TMP_PREFIX}probe-pid{os.getpid()}-", dir=probe_dir)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise environment_error(e, "cannot write into", probe_dir) from None


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems refuse fsync on folders; the data is still written
        if e.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file (and folder entry) under root to disk before a rename makes it visible."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "w") -> Iterator[IO[Any]]:
    """Yield a file object for a temporary sibling of `path`; when the block ends without an
    exception the file is flushed and replaces `path` in one os.replace (else it is deleted)."""
    target = Path(path)
    if target.is_dir():
        raise UserError(f"cannot write {target}: it is a folder, not a file")
    tmp: str | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{target.name}-pid{os.getpid()}-", dir=target.parent)
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        tmp = None
    except OSError as e:
        raise environment_error(e, "cannot write", target) from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Replace the file at `path` with `data` atomically (temp sibling, fsync, os.replace)."""
    with atomic_file(path, "wb") as f:
        f.write(data)
    return Path(path)


def write_text(path: str | Path, text: str) -> Path:
    return write_bytes(path, text.encode("utf-8"))


def _libc_renameat2() -> object | None:
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name, use_errno=True).renameat2 if name else None
    except (OSError, AttributeError):
        return None
    return fn


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step (Linux renameat2); False where unsupported."""
    fn = _libc_renameat2()
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)  # type: ignore[operator]
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False  # the file system or kernel cannot exchange: use the aside protocol
    raise OSError(err, os.strerror(err), str(b))


def _aside_name(target: Path) -> Path:
    return target.with_name(f"{ASIDE_PREFIX}{target.name}-pid{os.getpid()}")


def _delete_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def recover(target: str | Path) -> None:
    """Finish a folder replacement a crash interrupted: when `target` is missing but a complete old
    copy was moved aside, move it back; when both exist, the aside copy is stale and is deleted."""
    target = Path(target)
    parent = target.parent
    if not parent.is_dir():
        return
    asides = [a for a in sorted(parent.glob(f"{ASIDE_PREFIX}{target.name}-pid*"))
              if _PID_TAG.sub("", a.name) == f"{ASIDE_PREFIX}{target.name}" and not _pid_alive(a)]
    for aside in asides:
        if not target.exists():
            os.replace(aside, target)
        else:
            _delete_tree(aside)


def replace_folder(new: Path, target: Path) -> None:
    """Put the complete folder `new` at `target` (same parent folder), keeping the old target
    readable until the new one is in place; `new` is consumed."""
    if not target.exists():
        os.replace(new, target)
        return
    if not target.is_dir():
        raise UserError(f"cannot replace {target}: it is a file, not a folder")
    if _exchange(new, target):
        _delete_tree(new)  # `new` now holds the old folder
        return
    aside = _aside_name(target)
    _delete_tree(aside)
    os.replace(target, aside)
    os.replace(new, target)
    _delete_tree(aside)


@contextlib.contextmanager
def atomic_folder(target: str | Path) -> Iterator[Path]:
    """Yield an empty temporary folder beside `target`; when the block ends without an exception,
    it is flushed and replaces `target` (see replace_folder). On an exception it is deleted and
    `target` is left as it was."""
    target = Path(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        recover(target)
        for stale in target.parent.glob(f"{TMP_PREFIX}{target.name}-pid*"):  # a killed writer's
            if stale.is_dir() and not _pid_alive(stale):
                _delete_tree(stale)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{target.name}-pid{os.getpid()}-", dir=target.parent))
    except OSError as e:
        raise environment_error(e, "cannot write", target) from None
    try:
        yield tmp
        fsync_tree(tmp)
        replace_folder(tmp, target)
        _fsync_path(target.parent)
    except OSError as e:
        raise environment_error(e, "cannot write", target) from None
    except Exception as e:  # a native writer's own error type (safetensors, torch's archive writer)
        cause = _write_failure_cause(e, target.parent)
        if cause is None:
            raise
        raise environment_error(cause, "cannot write", target) from None
    finally:
        _delete_tree(tmp)


_OS_ERROR_TAG = re.compile(r"\(os error (\d+)\)")
_PROBE_BYTES = 1 << 20


def _write_failure_cause(err: Exception, folder: Path) -> OSError | None:
    """The OSError behind a native writer's failure, or None when the environment is not at fault.
    safetensors' Rust errors end in "(os error N)"; torch's archive writer says only "unexpected
    pos", so a 1 MiB probe written on the same disk shows whether the disk
    is full (or a file-size limit reached). The probe goes into the target's parent folder, which
    is there whatever the writer did to its own temporary folder."""
    found = _OS_ERROR_TAG.search(str(err))
    if found:
        code = int(found.group(1))
        return OSError(code, os.strerror(code))
    try:
        with tempfile.TemporaryFile(dir=folder) as f:
            f.write(bytes(_PROBE_BYTES))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return OSError(e.errno, e.strerror)  # without the probe's own name
    return None


def _pid_alive(path: Path) -> bool:
    """Whether the process named in a leftover's name ("-pidNNN") still runs. A name without one, and
    this process's own leftovers, count as dead (nobody is still writing them)."""
    found = _PID_TAG.findall(path.name)
    if not found:
        return False
    pid = int(found[-1])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


def delete_folder(path: str | Path) -> None:
    """Delete a folder so that an interruption never leaves a partial folder under a valid name:
    it is first renamed to a temporary name (which clean_leftovers removes if this process dies)."""
    path = Path(path)
    if not path.exists():
        return
    doomed = path.with_name(f"{TMP_PREFIX}{path.name}-pid{os.getpid()}-deleting")
    _delete_tree(doomed)
    os.replace(path, doomed)
    _delete_tree(doomed)


def clean_leftovers(parent: str | Path) -> None:
    """Remove temporary and aside folders/files in `parent` left by writers that died, after
    recovering any target whose replacement a crash interrupted."""
    parent = Path(parent)
    if not parent.is_dir():
        return
    for child in parent.iterdir():
        if child.name.startswith(ASIDE_PREFIX) and not _pid_alive(child):
            recover(parent / _PID_TAG.sub("", child.name)[len(ASIDE_PREFIX):])
    for child in parent.iterdir():
        if child.name.startswith(TMP_PREFIX) and not _pid_alive(child):
            if child.is_dir() and not child.is_symlink():
                _delete_tree(child)
            else:
                with contextlib.suppress(OSError):
                    child.unlink()


LOCK_FILE = ".lock"


class FolderLock:
    """An exclusive lock on a folder for as long as this process holds it (a run directory).

    `flock` on FOLDER/.lock: the kernel releases it when the process exits, however it exits (even
    SIGKILL), so a lock left by a dead process is never in the way; the file keeps the holder's pid
    for the message a second process gets.
    """

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> FolderLock:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise environment_error(e, "cannot lock", self.path) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UserError(f"{self.path.parent} is in use by another sleuth process (pid {holder}); "
                            "wait for it to finish or stop it") from None
        previous = os.read(fd, 64).decode(errors="replace").strip()
        if previous.isdigit() and int(previous) != os.getpid():
            # The lock was free, so its last holder has exited (crashed or killed).
            print(f"sleuth: note: {self.path.parent} was last locked by pid {previous}, which has exited",
                  file=sys.stderr)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
