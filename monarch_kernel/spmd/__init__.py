"""``monarch_kernel.spmd``: torch.distributed on a mesh, with Monarch's ``monarch.spmd`` names.

Free functions of the mesh, as Monarch's: ``setup_torch_elastic_env(procs)`` gives every
rank torchrun's variables, ``setup_torch_distributed(procs)`` also makes the default process
group, and ``device_mesh(procs, ("dp", "tp"))`` a ``DeviceMesh`` over it (on ranks,
``current_device_mesh()`` is that mesh).  ``SPMDActor`` runs torchrun scripts
(``main(master_addr, master_port, script_args)``), ``PeerCheckpoint`` keeps training state in
memory for a replaced rank to pull from a survivor, and ``LossPlot`` draws ranks' losses live
in the notebook, and ``watchdog(procs, 60, then="abort")`` turns a hang into ``HangError``;
``elastic_run(procs, train, ...)`` keeps a training function going through ranks' deaths
(replaced, or the job shrunk and grown back), its loop written with ``elastic_steps``.
``controller/`` runs where the mesh is driven from, ``rank/`` on ranks;
only this package sets torchrun's variables.  This module only re-exports; importing it
imports no torch and starts nothing.
"""

from .controller.collectives import CollectivesReport as CollectivesReport
from .controller.collectives import collectives as collectives
from .controller.distributed import DeviceMeshHandle as DeviceMeshHandle
from .controller.distributed import device_mesh as device_mesh
from .controller.distributed import setup_torch_distributed as setup_torch_distributed
from .controller.elastic import ElasticRun as ElasticRun
from .controller.elastic import Resized as Resized
from .controller.elastic import elastic_run as elastic_run
from .controller.env import setup_torch_elastic_env as setup_torch_elastic_env
from .controller.env import setup_torch_elastic_env_async as setup_torch_elastic_env_async
from .controller.hang_report import HangReport as HangReport
from .controller.hang_watch import HangWatch as HangWatch
from .controller.hang_watch import watchdog as watchdog
from .controller.plot import LossPlot as LossPlot
from .controller.profile import profile as profile
from .controller.profile_report import ProfileReport as ProfileReport
from .layout import RankEnv as RankEnv
from .rank.actor import SPMDActor as SPMDActor
from .rank.checkpoint import PeerCheckpoint as PeerCheckpoint
from .rank.elastic import Resize as Resize
from .rank.elastic import elastic_steps as elastic_steps
from .rank.group import current_device_mesh as current_device_mesh
from .rank.script import ScriptExit as ScriptExit
from .rank.script import run_script as run_script

__all__ = ["CollectivesReport", "DeviceMeshHandle", "ElasticRun", "HangReport", "HangWatch", "LossPlot",
           "PeerCheckpoint", "ProfileReport", "RankEnv", "Resize", "Resized", "SPMDActor", "ScriptExit",
           "collectives", "current_device_mesh", "device_mesh", "elastic_run", "elastic_steps", "profile",
           "run_script", "setup_torch_distributed", "setup_torch_elastic_env", "setup_torch_elastic_env_async",
           "watchdog"]
