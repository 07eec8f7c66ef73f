"""``SlurmJob``: placeholder module (filled in next)."""

from __future__ import annotations

from .job import JobTrait


class SlurmJob(JobTrait):  # noqa: B024
    kind = "slurm"
