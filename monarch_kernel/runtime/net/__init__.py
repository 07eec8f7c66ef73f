"""How messages move: the IO thread that owns every socket, inboxes, the receiver, the
transport and its dialers, datagrams, unfinished sends, the network's listening addresses,
hosts and ports.  It builds on ``wire/``; it never imports ``calls/`` or ``spawn/``."""
