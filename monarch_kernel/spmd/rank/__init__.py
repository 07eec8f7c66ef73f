"""The ranks' half of SPMD: runs in each rank process, never imports the controller's half.

``actor`` (``SPMDActor``: torchrun's variables set in the rank, the group built), ``group``
(the process group and ``DeviceMesh`` of this process), ``script`` (a torchrun script run as
``__main__``) and ``checkpoint`` (``PeerCheckpoint``, in the user's training loop).  torch is
imported only when a group or a tensor is asked for.
"""
