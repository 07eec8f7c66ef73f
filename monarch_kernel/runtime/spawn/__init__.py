"""How processes come to be and go: the launcher and its config, the template's client and
channel (and the forked child's first moments), host agents' messages and channel, workers,
the process tree, rank output and logging, stack sampling and proc stats.  It builds on
``wire/``; it never imports ``net/`` or ``calls/``."""
