"""torch.distributed plumbing shared by training and the analyses (DESIGN "Distributed").

Under ``torchrun`` every process joins one process group (gloo on CPU, nccl on CUDA). An analysis shards its
evaluation sequences contiguously by rank, sums token-weighted float64 partial results with :func:`all_reduce_sum`
and lets rank 0 alone write. One process is the special case world = 1: every function here is then a no-op.
A collective that fails (a rank died, or did not answer within ``CEMTOOL_DIST_TIMEOUT`` seconds) raises a
one-line :class:`CemtoolError` instead of hanging.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from cemtool.errors import CemtoolError

DEFAULT_TIMEOUT_S = 1800  # how long a collective waits for the other ranks (CEMTOOL_DIST_TIMEOUT overrides)


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def _timeout() -> timedelta:
    raw = os.environ.get("CEMTOOL_DIST_TIMEOUT", "")
    try:
        return timedelta(seconds=float(raw)) if raw else timedelta(seconds=DEFAULT_TIMEOUT_S)
    except ValueError:
        raise CemtoolError(f"CEMTOOL_DIST_TIMEOUT={raw!r} is not a number of seconds") from None


def init_distributed(device: torch.device) -> Dist:
    """Join the torchrun process group if WORLD_SIZE > 1 (gloo on CPU, nccl on CUDA)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    if not dist.is_initialized():
        if device.type == "cuda":  # nccl talks to the current device: one GPU per rank
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=_timeout())
        atexit.register(_leave)
    return Dist(dist.get_rank(), dist.get_world_size())


def _leave() -> None:
    """Destroy the process group before the interpreter tears down: otherwise a gloo worker thread may still be
    joinable when its object is destroyed, and the process dies with 'terminate called without an active
    exception' (seen once in a 2-rank analysis whose results were already written)."""
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # exiting anyway: a peer that died already has its own error line
        pass


def current() -> Dist:
    """The process group this process is in (Dist() when there is none)."""
    if dist.is_available() and dist.is_initialized():
        return Dist(dist.get_rank(), dist.get_world_size())
    return Dist()


def _failed(what: str, e: BaseException) -> CemtoolError:
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    return CemtoolError(f"rank {current().rank}: {what} failed: another process of the analysis died or timed out "
                        f"({first})", hint="see the first error of the other ranks; no report was written")


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over all ranks in place (and return it); a no-op with one process."""
    if current().world == 1:
        return t
    try:
        if dist.get_backend() == "nccl" and t.device.type != "cuda":  # nccl reduces GPU tensors only
            on_gpu = t.to(torch.device("cuda", torch.cuda.current_device()))
            dist.all_reduce(on_gpu, op=dist.ReduceOp.SUM)
            t.copy_(on_gpu)
        else:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
    except (RuntimeError, ValueError) as e:  # DistBackendError is a RuntimeError
        raise _failed("all_reduce", e) from None
    return t


def all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order; [obj] with one process."""
    d = current()
    if d.world == 1:
        return [obj]
    out: list[Any] = [None] * d.world
    try:
        dist.all_gather_object(out, obj)
    except (RuntimeError, ValueError) as e:
        raise _failed("all_gather", e) from None
    return out


def shard(n: int, what: str = "evaluation sequences") -> range:
    """This rank's contiguous share of ``n`` items (rank r: items [r n / K, (r + 1) n / K))."""
    d = current()
    if n < d.world:
        raise CemtoolError(f"{d.world} processes but only {n} {what}: every rank needs at least one",
                           hint=f"run fewer processes (--nproc_per_node {max(n, 1)}) or evaluate more tokens")
    return range(d.rank * n // d.world, (d.rank + 1) * n // d.world)


def check_same_device(device: torch.device | str) -> None:
    """All ranks must measure on the same kind of device (the reductions assume one backend)."""
    kinds = all_gather(torch.device(device).type)
    if len(set(kinds)) > 1:
        listing = ", ".join(f"rank {r}: {k}" for r, k in enumerate(kinds))
        raise CemtoolError(f"the processes use different devices ({listing})",
                           hint="give every rank the same --device (cuda or cpu)")
