"""Runs on a job's hosts: the host agent (``host_agent.py``, ``python -m monarch_kernel.agent``)
and the worker that any scheduler starts (``worker.py``, ``--listen``), with the worker's wire
and key file (``worker_wire.py``, ``worker_key.py``), which a job's controller speaks too.
Both come into the runtime by its hosting door (``runtime/hosting.py``).

The host agent: started by a job's launcher (the ssh command, or an ``srun`` task), it reads
its one-time credentials on stdin, connects back to the controller, and forks that
controller's ranks on its host from a local template, reporting every exit at once and
forwarding their output.
It dies with its controller: on EOF of its stdin (the ssh or srun stream), and when the
controller has been silent for ``agent_channel.SILENT_S``; its ranks go with it.
"""
