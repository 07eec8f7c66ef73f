"""The ranks' half of distributed tensors: the executor that runs recorded batches in
order.  Never imports the controller's half."""
