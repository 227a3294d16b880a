"""torch.distributed plumbing shared by training and the analyses (DESIGN "Distributed").

Under ``torchrun`` every process joins one process group (gloo on CPU, nccl on CUDA). An analysis shards its
evaluation sequences contiguously by rank, sums token-weighted float64 partial results with :func:`all_reduce_sum`
and lets rank 0 alone write. One process is the special case world = 1: every function here is then a no-op.
A collective that fails (a rank died, or did not answer within ``CEMTOOL_DIST_TIMEOUT`` seconds) raises a
one-line :class:`CemtoolError` instead of hanging.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import sys
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
    """Destroy the process group while the interpreter is still whole (at exit, for code that calls cemtool's
    functions under torchrun; the CLI leaves through :func:`exit_process`, which calls this first)."""
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # exiting anyway: a peer that died already has its own error line
        pass


def exit_code(code: object) -> int:
    """The status ``sys.exit(code)`` gives: None is 0, an int itself, anything else 1 (its text printed)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def exit_process(code: object) -> None:
    """End a command run under torchrun without the interpreter's teardown; return (do nothing) otherwise.

    ``destroy_process_group`` does not stop gloo's threads in torch 2.13: two ``pt_gloo_runloop`` threads and
    ``gloo_tcp_loop`` still run after it (measured with /proc/self/task), and they are torn down with the C++
    runtime at exit. That teardown once in a while aborted a rank whose work was finished and written
    ('terminate called without an active exception', status 134 instead of 0), which torchrun reports as a failed
    job. Once the process group is destroyed and the output flushed, nothing is left to do, so the process leaves
    with ``os._exit`` and the command's own status.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    status = exit_code(code)
    _leave()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said there
            pass
    try:  # C's stdio buffers too (a library's own log lines on a piped stdout)
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass
    os._exit(status)


def current() -> Dist:
    """The process group this process is in (Dist() when there is none)."""
    if dist.is_available() and dist.is_initialized():
        return Dist(dist.get_rank(), dist.get_world_size())
    return Dist()


def _failed(what: str, e: BaseException, job: str = "analysis",
            hint: str = "see the first error of the other ranks; no report was written") -> CemtoolError:
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    first = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", first)  # gloo's source location
    return CemtoolError(f"rank {current().rank}: {what} failed: another process of the {job} died or timed out "
                        f"({first[:160]})", hint=hint)


_PEER_WORDS = ("gloo", "nccl", "connection reset", "connection closed", "broken pipe", "timed out", "timeout",
               "socket", "peer")


def peer_failure(e: BaseException) -> bool:
    """Whether ``e``, raised inside a collective (DDP's gradient all-reduce included), is what torch raises when
    another rank died or did not answer in time: a DistError, or gloo's and NCCL's RuntimeErrors ('Connection
    reset by peer', 'Connection closed by peer', a timeout)."""
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    return isinstance(e, RuntimeError) and any(w in str(e).lower() for w in _PEER_WORDS)


def training_failed(e: BaseException, step: int, resume_hint: str) -> CemtoolError:
    """The one line a rank prints when a collective of the training fails because another rank died."""
    return _failed(f"training step {step + 1}", e, job="training",
                   hint=f"see the first error of the other ranks; {resume_hint}")


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
