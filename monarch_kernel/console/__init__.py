"""What runs on a rank for the notebook: the console actor (one persistent namespace per
rank, in which ``%%mesh`` cells run), the rank's IPython shell around it, cell compilation,
display capture, ``%pip`` once per host, and the completer that answers Tab from the rank.

Every module here runs in rank processes; the kernel only spawns ``Console`` (and
``Completer``) and calls them.
"""
