"""What a message means when it arrives: the calls waiting for answers (``outstanding``), the
caller, the outbox (every message this process sends), the server and the actors it hosts
(``actor_slots``), the multicast tree and the calls gathering answers through this rank
(``gathering``), supervision, finalizing a stopping rank and the main thread's queue.  It
builds on ``net/``, ``spawn/`` and ``wire/``; none of them imports it."""
