"""Process limits: raise the soft open-files limit to the hard one at start, as servers do.

A typical session's soft limit (1,024) is far below its hard limit; the controller, the
template, agents and ranks each raise theirs, so that running out means the hard limit
(which the errors then name, with how to raise it).
"""

from __future__ import annotations

import errno
import os


def raise_nofile_limit() -> int:
    """Set the soft RLIMIT_NOFILE to the hard limit (capped at 1,048,576); returns it."""
    try:
        import resource
    except ImportError:  # not Unix
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    want = min(want, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft


def open_files_limit() -> int:
    """The soft RLIMIT_NOFILE (65,535 when unlimited or unknown)."""
    try:
        import resource
    except ImportError:
        return 65535
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 65535 if soft == resource.RLIM_INFINITY else soft


RESERVE = 32  # descriptors kept free: what peers answering us connect with (libzmq aborts on EMFILE in accept)


def open_files() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


def check_room(what: str) -> None:
    """Raise before this process makes ``what`` (a socket) with fewer than ``RESERVE``
    descriptors left: past its limit ZeroMQ could no longer take the connections that come
    back, and would abort the process.  The error names the limit, the count and the fix."""
    try:
        import resource
    except ImportError:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    held = open_files()
    if held >= 0 and held + RESERVE >= soft:
        raise OSError(errno.EMFILE, f"out of file descriptors for {what}: this process holds {held} of its limit "
                                    f"of {soft} (hard {hard}, and {RESERVE} are kept free for connections that "
                                    f"come back); raise it with `ulimit -n` before starting (the hard limit: "
                                    f"/etc/security/limits.conf or systemd's LimitNOFILE), or end meshes and "
                                    f"threads that are no longer used")


def limit_error(e: OSError, what: str) -> str:
    """Why the template could not make ``what`` (a rank's pipes, its process), with the
    limit and how to raise it."""
    import resource

    if e.errno in (errno.EMFILE, errno.ENFILE):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        try:
            held = len(os.listdir("/proc/self/fd"))
        except OSError:
            held = -1
        scope = "the system's" if e.errno == errno.ENFILE else "the template's"
        return (f"out of file descriptors for {what}: {scope} limit is reached (open files limit {soft}, hard "
                f"{hard}; the template holds {held}, 3 per rank); raise it with `ulimit -n` (hard: "
                f"/etc/security/limits.conf or systemd's LimitNOFILE), or spawn fewer ranks per host")
    if e.errno == errno.EAGAIN:
        soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
        return (f"cannot fork {what}: the process limit is reached (max user processes {soft}, hard {hard}); "
                f"raise it with `ulimit -u`, or spawn fewer ranks")
    return f"cannot make {what}: {e.strerror}"
