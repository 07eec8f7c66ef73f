"""Runs on each host of a job, as ``python -m monarch_kernel.agent``: the host agent.

Started by a job's launcher (the ssh command, or an ``srun`` task), it reads its one-time
credentials on stdin, connects back to the controller, and forks that controller's ranks on
its host from a local template, reporting every exit at once and forwarding their output.
It dies with its controller: on EOF of its stdin (the ssh or srun stream), and when the
controller has been silent for ``agent_channel.SILENT_S``; its ranks go with it.
"""
