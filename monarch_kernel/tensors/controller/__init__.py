"""The controller's half of distributed tensors: recording torch calls into batches,
handles (``Tensor``), meshes to activate, fetching values back."""
