"""Memory: what the device has, and the checks that refuse what cannot fit before anything is allocated. The one
probe of the memory available (a container's cgroup limit included) that training, building a model, loading a run
and the analyses all use; what a model needs, from its config, is estimated by :mod:`cemtool.models.sizing`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from cemtool.errors import CemtoolError

GIB = 1 << 30


def available_memory(device: str | torch.device) -> int | None:
    """Free bytes on the device (CUDA: free memory; MPS: the recommended limit less what is allocated; CPU: the
    kernel's MemAvailable, or less under a container's cgroup limit), or None if unknown."""
    dev = torch.device(device)
    try:
        if dev.type == "cuda":
            return int(torch.cuda.mem_get_info(dev)[0])
        if dev.type == "mps":
            return int(torch.mps.recommended_max_memory() - torch.mps.current_allocated_memory())
        free = None
        if os.path.exists("/proc/meminfo"):
            with open("/proc/meminfo") as f:
                free = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None)
        if free is None:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return min(free, _cgroup_free() or free)
    except (OSError, ValueError, AttributeError, RuntimeError):
        return None


def _cgroup_free() -> int | None:
    """What a cgroup-v2 memory limit (a container's) still allows, if there is one."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(0, int(limit) - used)


def check_weights_memory(params: int, what: str, device: str | torch.device = "cpu") -> None:
    """Refuse a model of ``params`` parameters whose float32 weights (4 bytes each, as :func:`memory_estimate`
    counts them) cannot fit in the memory :func:`available_memory` reports, before it is built: for models whose
    config is not cemtool's (cemtool.subject.hf counts their parameters). CEMTOOL_NO_MEMORY_CHECK=1 skips it."""
    avail = available_memory(device)
    if avail is None or os.environ.get("CEMTOOL_NO_MEMORY_CHECK", "") not in ("", "0"):
        return
    need = 4 * params
    if need > avail:
        raise CemtoolError(f"{what} has {params:,} parameters: its float32 weights need about {need / GIB:.2f} GiB "
                           f"but {avail / GIB:.2f} GiB are available on {torch.device(device)}",
                           hint="pick a smaller model (set CEMTOOL_NO_MEMORY_CHECK=1 to try anyway)")


def curvature_memory_estimate(n_model: int, n_subset: int, dtype: torch.dtype, vectors: int) -> int:
    """Bytes for a curvature run, activations aside: a converted copy of the model, its gradient (with graph)
    and one HVP (3 x params x itemsize) plus ``vectors`` float64 basis vectors of the subset."""
    item = torch.empty((), dtype=dtype).element_size()
    return 3 * n_model * item + (vectors + 4) * n_subset * 8


def check_curvature_memory(model: nn.Module, n_subset: int, dtype: torch.dtype, device: torch.device,
                           vectors: int) -> None:
    """Refuse a curvature run (cemtool.analysis.curvature.risk) whose copy of the model and Lanczos vectors cannot fit
    in 80% of the memory :func:`available_memory` reports (a container's cgroup limit included)."""
    n_model = sum(p.numel() for p in model.parameters())
    need = curvature_memory_estimate(n_model, n_subset, dtype, vectors)
    have = available_memory(device)
    if have is not None and need > 0.8 * have:
        name = "fp64" if dtype == torch.float64 else "fp32"
        raise CemtoolError(f"model too large for {device.type} memory at {name}: about {need / GIB:.2f} GiB "
                           f"needed for {n_model:,} parameters and {vectors} Lanczos vectors, "
                           f"{have / GIB:.2f} GiB available",
                           hint="use --dtype fp32, restrict --params (e.g. layer:0), or lower --lanczos-steps")
