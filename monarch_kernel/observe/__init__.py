"""Looking at running ranks from the controller: every thread's stack, grouped
(``stacks.py``, ``stack_report.py``), and CPU, memory and GPU use per rank (``metrics.py``).
Above the runtime, below the actor layer: ``ProcMesh.stacks()``, ``%mesh stacks``,
``%mesh top`` and the Mesh panel use it.  Importing it starts nothing."""
