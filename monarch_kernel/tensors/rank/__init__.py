"""The ranks' half of distributed tensors: what runs on every rank of an activated mesh.
It never imports the controller's half."""
