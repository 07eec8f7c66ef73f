"""Benchmarks for monarch_kernel: workloads W1-W8 plus hardware floors on the same machine.

``python -m benchmarks`` runs them all and prints one JSON object on stdout;
``python -m benchmarks W2 W5`` runs a selection.  Each workload runs in its own fresh
controller process (``benchmarks._run``); progress goes to stderr.
"""
