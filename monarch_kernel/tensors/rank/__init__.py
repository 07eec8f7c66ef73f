"""The ranks' half of distributed tensors: the executor that runs recorded batches in
order, and the collectives it reduces and moves tensors with.  Never imports the
controller's half."""
