"""JupyterLab's Mesh panel, the kernel's side: ``feed.py`` (the comm and its buttons),
``view.py`` (what the panel shows, measured), ``messages.py`` (the comm's messages, as the
panel's ``messages.ts`` has them) and ``grid.py`` (several ranks' rich output as one grid).
Runs in the kernel; detached meshes as the server extension lists them are
``detached/listing.py``."""
