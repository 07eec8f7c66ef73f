"""Runs in the template process, the pre-started interpreter that forks a controller's (or a
host agent's) ranks: its loop (``server``), a rank's fork and first moments (``fork``), the
stack sampler that runs py-spy on its ranks, and the process tree it reaps.  It stands on
``spawn/``'s formats (``host_messages``, ``template_channel``, ``launch_config``); nothing in
``spawn/`` imports it: the controller starts it by a command line.  See docs/how-it-works.md."""
