"""The kinds of message the runtime sends, and the modes and statuses they carry: plain
integer enums, shared by the envelope, the payloads and every handler."""

from __future__ import annotations

import enum


class Kind(enum.IntEnum):
    CALL = 2  # caller -> ranks (through the tree): run an endpoint
    REPLY = 3  # ranks -> caller: one part per rank
    SPAWN = 4  # owner -> ranks: construct an actor
    REDIRECT = 5  # caller -> rank: your parent died, reply to me instead
    NOT_RECEIVED = 6  # rank -> caller: a REDIRECT for a call I never saw
    STOP = 7  # owner -> rank: exit now
    DEATH = 8  # owner -> ranks: a rank of a mesh you may call has died
    FAILURE = 9  # rank -> mesh owner: an unobserved failure (supervision)
    PRUNE = 10  # caller -> rank: stop waiting for a child subtree whose root died
    WAKE = 11  # any -> a thread's inbox: an answer arrived another way; look again
    PORT = 12  # any -> the process that opened a port: one value for it
    INTERRUPT = 13  # caller -> rank: raise KeyboardInterrupt in an actor's running endpoint
    REVIVE = 14  # owner -> ranks: a dead rank was restarted in place
    STACKS = 15  # caller -> rank: dump your threads' stacks yourself (when py-spy cannot)
    HOST = 16  # controller <-> the agent of one of its hosts: one agent_channel message (msgpack)
    MOVED = 17  # owner -> ranks: a dead rank was restarted on another host, at a new address


class Mode(enum.IntEnum):
    GATHER = 0  # replies are merged on the way up the tree
    DIRECT = 1  # every rank replies straight to the origin (streams)
    TELL = 2  # sent straight to each rank, never answered: a failure goes to supervision (``Caller.tell``)


class Status(enum.IntEnum):
    OK = 0
    RAISED = 1  # the endpoint raised; payload is a pickled RemoteFailure
    DIED = 2  # the rank is gone (filled in by the caller, never sent)
    STOPPED = 3  # the mesh was stopped
    UNSENT = 4  # the call could not be sent to the rank (filled in by the caller: SendFailed)
