"""Whether a folder on this host is the user's, before a rank imports from it or runs in it.

The controller sends its ``sys.path`` and its working folder; on another host a folder at the
same path may be anyone's (another user can make ``/tmp/project`` first, with a ``model.py``
the rank would import and run as the user).  A folder is used only if it and every folder
above it, both as named and as resolved, belong to this user or root and no one else may
change them: a folder others may write is allowed only above, and only when it is sticky
(``/tmp``) and what is in it is the user's, since there nobody else may rename or remove it.
"""

from __future__ import annotations

import os
import stat


def why_not_ours(path: str) -> str | None:
    """None if ``path`` is the user's to use (see the module), else the reason, in words."""
    path = os.path.abspath(path)
    for chain in (_chain(path), _chain(os.path.realpath(path))):
        why = _check(chain)
        if why is not None:
            return why
    return None


def _chain(path: str) -> list[str]:
    """``path`` and each folder above it, ``path`` first."""
    out = [path]
    while True:
        up = os.path.dirname(out[-1])
        if up == out[-1]:
            return out
        out.append(up)


def _check(chain: list[str]) -> str | None:
    uid = os.getuid()
    below = None  # the entry just under the folder being looked at (its lstat)
    for where in chain:
        try:
            st = os.lstat(where)
        except OSError as e:
            return f"{where}: {e.strerror}"
        if st.st_uid not in (uid, 0):
            return f"{where} belongs to another user (uid {st.st_uid})"
        if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o022:
            sticky_above = below is not None and st.st_mode & stat.S_ISVTX and below.st_uid in (uid, 0)
            if not sticky_above:
                return f"{where} may be changed by other users (mode {stat.filemode(st.st_mode)})"
        below = st
    return None
