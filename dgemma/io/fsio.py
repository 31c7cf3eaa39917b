"""Safe file I/O, the one home of dgemma's rules for touching files (stdlib only, so every module may use it).

Reading follows symlinks the way `cat` does (the user could read the target anyway, and the Hugging Face cache
keeps every checkpoint file as a symlink into `blobs/`), but only a regular file is read: a FIFO, a device or a
directory is refused with an error naming it, and nothing ever blocks opening one (`open_read`). A file named by
another file (an index's shard, a data directory's shard) must be a plain name inside its directory
(`plain_name_problem`).

Writing never goes through a symlink and never leaves a half-written file: `atomic_write` writes a fresh temporary
file beside the destination (O_CREAT | O_EXCL | O_NOFOLLOW, a unique name), fsyncs it, renames it over the
destination (a symlink there is replaced, its target untouched) and fsyncs the directory; on any failure the temporary
file is removed and the destination is as it was. A file that must be opened in place (a lock) is opened with
O_NOFOLLOW (`open_in_place`). A full disk is one error, `NoSpaceError`, naming the file and the space it needed,
whatever library did the writing (`no_space`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NO_SPACE_TEXT = ("no space left", "os error 28", "disk quota exceeded", "os error 122")


class UnsafeFileError(ValueError):
    """A file dgemma refuses to read or write as asked (not a regular file, a symlink to write through, a name
    outside its directory, larger than a reader allows); the message names the path and what would be accepted,
    `why` says what is wrong without the path (for callers that phrase their own message)."""

    def __init__(self, message: str, why: str | None = None):
        super().__init__(message)
        self.why = why or message


def reason(e: OSError | UnsafeFileError) -> str:
    """What is wrong with a file, without its path: an OSError's strerror, an UnsafeFileError's `why`."""
    return (e.strerror or str(e)) if isinstance(e, OSError) else e.why


class NoSpaceError(OSError):
    """The filesystem (or the quota) is full; the message names the file being written and the space it needed."""

    def __init__(self, message: str, path: str | os.PathLike[str], needed: int | None):
        super().__init__(message)
        self.errno, self.path, self.needed = errno.ENOSPC, Path(path), needed  # (filename would reformat str)


# --- names and reading -------------------------------------------------------------------------------------------

def plain_name_problem(name: object) -> str | None:
    """Why `name` (a file name another file lists, like an index's shard) is not a plain relative file name inside
    its directory, or None when it is: a non-empty string, not absolute, no `..` part, no NUL byte."""
    if not isinstance(name, str) or not name:
        return f"{name!r} is not a file name"
    if "\x00" in name:
        return f"{name!r} holds a NUL byte"
    parts = Path(name).parts
    if Path(name).is_absolute() or name.startswith("/"):
        return f"{name!r} is an absolute path"
    if ".." in parts:
        return f"{name!r} climbs out of the directory (..)"
    return None


def file_kind(mode: int) -> str:
    """What a file that is not a regular file is (from its stat mode), for an error message."""
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a regular file"


def check_regular(path: str | os.PathLike[str]) -> os.stat_result:
    """The stat of `path` (symlinks followed) when it is a regular file; UnsafeFileError naming what it is otherwise.
    FileNotFoundError (and other OSErrors) pass through."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(path, st.st_mode)
    return st


def _not_regular(path: str | os.PathLike[str], mode: int) -> UnsafeFileError:
    why = f"{file_kind(mode)}, not a regular file"
    return UnsafeFileError(f"{path}: {why}; only regular files (or symlinks to them) are read", why)


def open_read(path: str | os.PathLike[str], mode: str = "rb", encoding: str | None = None) -> IO[Any]:
    """Open a regular file for reading (symlinks followed). The open itself never blocks: it is non-blocking until
    fstat has shown a regular file, so a FIFO is refused (UnsafeFileError) instead of hanging the reader."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st.st_mode)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, mode, encoding=encoding)
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str | os.PathLike[str], max_bytes: int | None = None) -> bytes:
    """The bytes of a regular file (`open_read`); with `max_bytes`, a larger file is refused (UnsafeFileError) after
    reading at most max_bytes + 1 bytes, never the whole of a file that grows."""
    with open_read(path) as f:
        data = f.read() if max_bytes is None else f.read(max_bytes + 1)
    if max_bytes is not None and len(data) > max_bytes:
        why = f"larger than the {max_bytes:,} bytes allowed"
        raise UnsafeFileError(f"{path}: {why}", why)
    return data


def read_text(path: str | os.PathLike[str], encoding: str = "utf-8") -> str:
    with open_read(path, "r", encoding=encoding) as f:
        return f.read()


# --- writing -----------------------------------------------------------------------------------------------------

def is_no_space(e: BaseException | None) -> bool:
    """Whether `e`, or an error it was raised from, says the disk or the quota is full (an OSError with ENOSPC or
    EDQUOT, or the wrapped messages of safetensors and torch.save: "No space left on device (os error 28)")."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in NO_SPACE:
            return True
        if any(text in str(e).lower() for text in _NO_SPACE_TEXT):
            return True
        e = e.__cause__ or e.__context__
    return False


def _mb(n: int) -> str:
    return f"{max(n, 0) / 2**20:,.1f} MB" if n < 2**20 * 10 else f"{n / 2**20:,.0f} MB"


def no_space(e: BaseException, path: str | os.PathLike[str], needed: int | None = None) -> NoSpaceError | None:
    """A NoSpaceError naming `path` and the space it needed (`needed` bytes, when known) if `e` says the disk is
    full, else None."""
    if not is_no_space(e):
        return None
    what = f"needed ~{_mb(needed)}" if needed else "needed more"
    try:
        vfs = os.statvfs(Path(path).parent if not Path(path).is_dir() else path)
        what += f", {_mb(vfs.f_bavail * vfs.f_frsize)} free"
    except OSError:
        pass
    return NoSpaceError(f"no space left on device writing {path} ({what}); free some space and run the command again",
                        path, needed)


def temp_name(dest: Path) -> Path:
    """A unique hidden name beside `dest` for its temporary file or directory."""
    return dest.with_name(f".{dest.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def atomic_write(dest: str | os.PathLike[str], write: Callable[[Path, IO[bytes]], None],
                 needed: int | None = None) -> None:
    """Publish a file at `dest` atomically: `write(tmp, f)` fills a fresh temporary file beside it (`f` is open on it
    for binary writing; a library that wants a path may write `tmp` instead), which is fsynced and renamed over
    `dest`. A symlink at `dest` is replaced, never written through. On any failure the temporary file is removed and
    `dest` is untouched; a full disk raises NoSpaceError (`needed`: the bytes it takes, for the message). The file
    gets the usual permissions (0o666 less the umask)."""
    dest = Path(dest)
    tmp = temp_name(dest)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
    try:
        mode = os.fstat(fd).st_mode & 0o777  # 0o666 less the umask
        with os.fdopen(fd, "wb") as f:
            write(tmp, f)
            f.flush()
        os.chmod(tmp, mode)  # safetensors' save_file recreates the file owner-only (0o600)
        fsync_file(tmp)
        os.replace(tmp, dest)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        full = no_space(e, dest, needed)
        if full is not None:
            raise full from None
        raise
    fsync_dir(dest.parent)


def write_bytes(dest: str | os.PathLike[str], data: bytes) -> None:
    atomic_write(dest, lambda _tmp, f: f.write(data), needed=len(data))


def write_text(dest: str | os.PathLike[str], text: str) -> None:
    write_bytes(dest, text.encode("utf-8"))


def copy_file(src: str | os.PathLike[str], dest: str | os.PathLike[str]) -> None:
    """Copy the regular file `src` (symlinks followed, see `open_read`) to `dest` atomically (see `atomic_write`)."""
    with open_read(src) as source:
        size = os.fstat(source.fileno()).st_size
        atomic_write(dest, lambda _tmp, f: _copy(source, f), needed=size)


def _copy(source: IO[bytes], f: IO[bytes]) -> None:
    while chunk := source.read(1 << 20):
        f.write(chunk)


def open_in_place(path: str | os.PathLike[str]) -> int:
    """A read-write descriptor on the regular file `path` (created if missing, 0o644), for a file updated in place
    (a lock): a symlink there is refused (O_NOFOLLOW), as is anything but a regular file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0),
                     0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeFileError(f"{path}: a symbolic link; dgemma never writes through one (remove it and run the "
                                  "command again)") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafeFileError(f"{path}: {file_kind(st.st_mode)}, not a regular file; remove it and run the command "
                              "again")
    return fd


def fsync_file(path: str | os.PathLike[str]) -> None:
    """fsync a file (or a directory, where the platform allows) by path, without following a symlink."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    except OSError:  # directories cannot be fsynced everywhere
        pass
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the renames in a directory durable (POSIX); a no-op where directories cannot be opened (Windows)."""
    with contextlib.suppress(OSError):
        fsync_file(path)
