"""What ``setup_torch_distributed(procs)`` picks on this machine for ranks of one host, by
the rule the library itself follows (``runtime.gpus``), so that tests hold on a machine with
GPUs as on one without.
"""

from __future__ import annotations

from monarch_kernel.runtime import gpus


def devices_here() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_backend(ranks_on_this_host: int) -> str:
    """``"nccl"`` only where this host has a GPU for each of the ranks, else ``"gloo"``."""
    return gpus.backend_for_counts([ranks_on_this_host], [devices_here()])


def needs_cuda(reason: str = "a CUDA GPU"):
    """Skip unless this machine has a CUDA GPU, saying what the test needs."""
    import pytest

    return pytest.mark.skipif(devices_here() == 0, reason=f"needs {reason}; there is none here")
