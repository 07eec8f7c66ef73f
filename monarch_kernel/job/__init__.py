"""Jobs: hosts from the engines users already run, with Monarch's ``monarch.job`` names.

Runs in the controller.  A job starts one agent per host (``monarch_kernel.agent``) through
its launcher (``ssh``; ``srun`` inside an ``sbatch`` allocation) and hands out ``HostMesh``
objects, one per named mesh, whose ``spawn_procs`` forks ranks on those hosts::

    job = SSHJob(python_exe="python3", ssh_args=("-i", key))
    job.add_mesh("workers", ["h1", "h2"])
    procs = job.state().workers.spawn_procs(per_host={"gpus": 2})
    job.kill()

``attach_to_workers`` (``AttachJob``) attaches to workers that any scheduler started.
"""

from .attach import AttachJob, attach_to_workers
from .job import JobState, JobTrait, LocalJob, job_from_spec, job_load, running_jobs
from .slurm import SlurmJob
from .ssh import SSHJob, UnreachableControllerWarning

__all__ = ["AttachJob", "JobState", "JobTrait", "LocalJob", "SSHJob", "SlurmJob", "UnreachableControllerWarning",
           "attach_to_workers", "job_from_spec",
           "job_load", "running_jobs"]
