"""``monarch_kernel.spmd``: torch.distributed on a mesh, with Monarch's ``monarch.spmd`` names.

``setup_torch_elastic_env(procs)`` gives every rank torchrun's variables; ``SPMDActor``
runs torchrun scripts (``main(master_addr, master_port, script_args)``); on ranks,
``current_device_mesh()`` is the mesh ``procs.device_mesh(("dp", "tp"))`` built, and
``PeerCheckpoint`` keeps training state in memory for a replaced rank to pull from a
survivor.  ``LossPlot`` draws ranks' losses live in the notebook.  This module only
re-exports; importing it imports no torch and starts nothing.
"""

from .actor import SPMDActor as SPMDActor
from .checkpoint import PeerCheckpoint as PeerCheckpoint
from .distributed import DeviceMeshHandle as DeviceMeshHandle
from .distributed import device_mesh as device_mesh
from .distributed import setup_torch_distributed as setup_torch_distributed
from .env import setup_torch_elastic_env as setup_torch_elastic_env
from .env import setup_torch_elastic_env_async as setup_torch_elastic_env_async
from .group import current_device_mesh as current_device_mesh
from .layout import RankEnv as RankEnv
from .plot import LossPlot as LossPlot
from .script import ScriptExit as ScriptExit
from .script import run_script as run_script

__all__ = ["DeviceMeshHandle", "LossPlot", "PeerCheckpoint", "RankEnv", "SPMDActor", "ScriptExit",
           "current_device_mesh", "device_mesh", "run_script", "setup_torch_distributed", "setup_torch_elastic_env",
           "setup_torch_elastic_env_async"]
