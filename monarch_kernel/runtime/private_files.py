"""Folders and files only this user can read or change, on a machine shared with other users.

Every private folder the product uses (the run directory, the debugger's cell folder, workspace
copies, ``sync_env``'s cache, Jupyter's runtime directory) goes through ``private_dir``, and
every private file through ``write_file``/``read_file``.  A folder at a predictable path may
have been made by someone else first, and a file name may be a symlink or a FIFO they left:
these functions check before they trust, and never follow a link.  They never loosen a mode.
"""

from __future__ import annotations

import errno
import os
import stat

# What a folder's ancestors may be owned by besides this user: root (/, /tmp, /home).
_TRUSTED_OWNERS = (0,)


class NotPrivate(PermissionError):
    """A folder or file at a private path that this user does not hold alone; the message
    says whose it is and what to do."""


def _mode(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o}"


def _own_group(gid: int) -> bool:
    """Whether ``gid`` is this user's own group (a user private group, as Debian makes one per
    user): no other member, so a folder it may write is still this user's alone."""
    import grp
    import pwd

    if gid != os.getegid():
        return False
    try:
        members = set(grp.getgrgid(gid).gr_mem) - {pwd.getpwuid(os.geteuid()).pw_name}
        others = [p.pw_name for p in pwd.getpwall() if p.pw_gid == gid and p.pw_uid != os.geteuid()]
    except KeyError:
        return False
    return not members and not others


def check_parents(path: str) -> None:
    """Raise NotPrivate unless every folder above ``path`` is this user's or root's, and none
    lets another user rename what is in it (writable by others only with the sticky bit,
    as /tmp is).  Otherwise whoever may write a parent may swap the folder after it is checked."""
    uid = os.geteuid()
    here = os.path.dirname(os.path.abspath(path))
    while True:
        st = os.stat(here)
        if st.st_uid not in (uid, *_TRUSTED_OWNERS):
            raise NotPrivate(f"{here} (above {path}) belongs to uid {st.st_uid}, who could replace what is in it; "
                             f"use a folder under one of yours (e.g. set TMPDIR, or pass another path)")
        if st.st_mode & (0o002 if _own_group(st.st_gid) else 0o022) and not st.st_mode & stat.S_ISVTX:
            raise NotPrivate(f"{here} (above {path}) may be written by others (mode {_mode(st)}) without the sticky "
                             f"bit, so they could replace what is in it; chmod go-w {here}, or use another folder")
        parent = os.path.dirname(here)
        if parent == here:
            return
        here = parent


def private_dir(path: str, parents: bool = True) -> str:
    """``path`` as a folder of this user's alone (mode 0700), made if missing (and its missing
    parents, 0700); ``path``.  A folder already there must be this user's (not a link); if it
    is, and others may use it, it is made 0700.  Anyone else's raises NotPrivate, as does a
    parent others could swap it in (``parents``: check those too)."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), 0o700, exist_ok=True)
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        what = "a link" if stat.S_ISLNK(st.st_mode) else ("a folder" if stat.S_ISDIR(st.st_mode) else "a file")
        raise NotPrivate(f"{path} is {what} of uid {st.st_uid}, not a folder of yours: someone else made it, so it "
                         f"cannot be trusted.  Remove it (or ask its owner to), or use another folder (e.g. set "
                         f"TMPDIR to a folder of yours)")
    if st.st_mode & 0o077:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            if os.fstat(fd).st_ino != st.st_ino:
                raise NotPrivate(f"{path} changed while it was checked; try again")
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
    if parents:
        check_parents(path)
    return path


def _check_file(fd: int, path: str, private: bool) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise NotPrivate(f"{path} is not a regular file (a FIFO, device or folder); remove it, or use another path")
    if st.st_uid != os.geteuid():
        raise NotPrivate(f"{path} belongs to uid {st.st_uid}, not to you; remove it, or use another path")
    if private and st.st_mode & 0o077:
        raise NotPrivate(f"{path} may be read by others (mode {_mode(st)}); run  chmod 600 {path}")
    return st


def _open(path: str, flags: int, mode: int = 0o600) -> int:
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotPrivate(f"{path} is a symbolic link; remove it, or use another path") from None
        raise


def read_file(path: str, private: bool = True, limit: int = 1 << 20) -> bytes:
    """The bytes of ``path``, a regular file of this user's (0600, if ``private``), opened
    without following a link or waiting on a FIFO; at most ``limit`` bytes."""
    fd = _open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        _check_file(fd, path, private)
        os.set_blocking(fd, True)
        data = b""
        while len(data) <= limit:
            chunk = os.read(fd, limit + 1 - len(data))
            if not chunk:
                return data
            data += chunk
        raise ValueError(f"{path} is over {limit} bytes")
    finally:
        os.close(fd)


def write_file(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` as a 0600 file of this user's, never through a link (the
    folder should be a ``private_dir``).  A file of another user's there raises NotPrivate."""
    fd = _open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK)
    try:
        _check_file(fd, path, private=False)
        os.fchmod(fd, 0o600)
        os.set_blocking(fd, True)
        os.ftruncate(fd, 0)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def replace_file(path: str, data: bytes) -> None:
    """Put ``data`` at ``path`` atomically, as a 0600 file of this user's: written under a
    fresh name (created, never opened through a link), then renamed into place."""
    import secrets

    tmp = f"{path}.{secrets.token_hex(6)}.tmp"
    fd = _open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
