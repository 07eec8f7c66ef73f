"""Process limits: raise the soft open-files limit to the hard one at start, as servers do.

A typical session's soft limit (1,024) is far below its hard limit; the controller, the
template, agents and ranks each raise theirs, so that running out means the hard limit
(which the errors then name, with how to raise it).
"""

from __future__ import annotations


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
