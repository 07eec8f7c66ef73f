"""The controller's half of SPMD: runs where the mesh is driven from (the kernel or a script).

``distributed`` (``setup_torch_distributed``, ``device_mesh``), ``env``
(``setup_torch_elastic_env``: the layout, the rendezvous, the death watcher) and ``plot``
(``LossPlot``, whose actor lives in the controller).  None of it imports torch.
"""
