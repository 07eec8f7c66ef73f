"""Distributed tensors: torch code recorded on the controller inside ``procs.activate()``
and run by an executor on every rank.  ``controller/`` records and fetches; ``rank/``
executes and reduces (``collectives.py``); ``messages.py`` is what travels between them,
``errors.py`` what either raises to a user.  Below ``actor/``: it reaches the ranks only
through a small ``Backend`` the actor layer implements.  Importing it imports nothing else
(torch loads once a tensor exists)."""
