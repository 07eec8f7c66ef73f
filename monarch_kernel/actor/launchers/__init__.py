"""Where ranks are started.  Local ranks are forked by the runtime's template process
(``runtime/template_server.py``); SSH and SLURM launchers arrive with the kernel issues."""
