"""Distributed tensors (issue 20): the controller's recording of torch ops (``controller/``)
and what runs on every rank (``rank/``: the executor, the collectives).  Below the actor
layer: it imports only the runtime.  Importing it imports nothing of torch."""
