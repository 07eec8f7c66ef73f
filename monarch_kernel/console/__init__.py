"""What runs on a rank for the notebook: the console actor (one persistent namespace per
rank, in which ``%%mesh`` cells run), cell compilation, and display capture.

Every module here runs in rank processes; the kernel only spawns ``Console`` and calls it.
"""
