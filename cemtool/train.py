"""The training loop: a function that takes configs and a run and reports progress through a callback.

AdamW or Muon + AdamW (cemtool/optim.py) with named groups (decay / no_decay / any group a family declares, each its own
learning-rate multiplier), warmup then cosine / constant / warmup-stable-decay, gradient clipping and
accumulation, evaluation on fixed validation windows beside the corpus's entropy floor, safetensors checkpoints
that resume bit-exactly on the CPU, and DistributedDataParallel under ``torchrun`` (rank 0 alone writes).
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from cemtool.analysis import tracking
from cemtool.checkpoints import check_fits, restore_training, resume_checkpoint, save_checkpoint, step_checkpoints
from cemtool.config import RunConfig, TrainConfig
from cemtool.data.corpus import Corpus, batch_starts, bits_per_byte, perplexity, windows
from cemtool.distributed import Dist, init_distributed, peer_failure, training_failed  # noqa: F401 (Dist: re-exported)
from cemtool.errors import CemtoolError, UsageError
from cemtool.memory import available_memory  # noqa: F401
from cemtool.models.lm import lm_loss
from cemtool.models.registry import build_model
from cemtool.models.sizing import check_memory, count_params, memory_estimate, rough_params  # noqa: F401
from cemtool.optim import make_optimizer, param_groups  # noqa: F401 (param_groups: re-exported)
from cemtool.provenance import now
from cemtool.runs import Run
from cemtool.tblog import check_log_to, metrics_writer

Callback = Callable[[dict], None]


# --------------------------------------------------------------------------------------------------------------
# devices and distribution


def pick_device(device: str | None = None) -> torch.device:
    """'auto' (or None): cuda > mps > cpu."""
    if device in (None, "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"unknown device {device!r}", hint="use auto, cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CemtoolError(f"device {device!r} requested but CUDA is not available")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise CemtoolError(f"device {device!r} requested but MPS is not available")
    return dev


def to_device(x: torch.Tensor, y: torch.Tensor, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch onto the device: through pinned memory and without waiting on CUDA, as is on the CPU."""
    if dev.type == "cuda":
        x, y = x.pin_memory(), y.pin_memory()
    return x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)


def host_sync(tc: TrainConfig, dev: torch.device) -> str:
    """train.host_sync resolved: 'step' (read the loss every step; exact, free on the CPU) or 'log'."""
    return tc.host_sync if tc.host_sync != "auto" else ("log" if dev.type == "cuda" else "step")


def wants_compile(tc: TrainConfig, dev: torch.device) -> bool:
    return tc.compile == "true" or (tc.compile == "auto" and dev.type == "cuda")


def compiled(model: torch.nn.Module, tc: TrainConfig, dev: torch.device, callback: Callback | None = None):
    """The module the loop calls: torch.compile'd when train.compile asks (auto: on CUDA), else the model itself.
    Compilation happens at the first call; :class:`Compiled` falls back to the eager model, and says why, when it
    fails there."""
    if not wants_compile(tc, dev):
        return model
    return Compiled(model, callback, required=tc.compile == "true")


class Compiled(torch.nn.Module):
    """torch.compile(model), with a fallback: if the compiled call raises (no C compiler, an unsupported op, a
    backend error), the eager model serves instead, the reason goes to the callback as a note and to
    ``self.fallback``; with ``required`` (train.compile=true) the error stops the run instead, as one line. The
    weights are the model's own (no copy): checkpoints and analyses see the same tensors."""

    def __init__(self, model: torch.nn.Module, callback: Callback | None, required: bool):
        super().__init__()
        self.model = model
        self._compiled = torch.compile(model)
        self._callback, self._required = callback, required
        self.fallback: str | None = None

    def forward(self, *args, **kwargs):
        if self.fallback is not None:
            return self.model(*args, **kwargs)
        try:
            return self._compiled(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 (any backend failure: the eager model is the same function)
            reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
            if self._required:
                raise CemtoolError(f"torch.compile failed: {reason}",
                                   hint="train.compile=auto falls back to eager; false skips compilation") from None
            self.fallback = reason
            _emit(self._callback, kind="note", message=f"torch.compile failed, training eagerly: {reason}")
            return self.model(*args, **kwargs)


def autocast_for(device: torch.device, precision: str):
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


# --------------------------------------------------------------------------------------------------------------
# optimizer and schedule


def lr_at(step: int, total: int, tc: TrainConfig) -> float:
    """Learning rate at optimizer step ``step`` (0-based) of ``total``."""
    if tc.warmup_steps and step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    lo = tc.lr * tc.min_lr_ratio
    if tc.schedule == "constant":
        return tc.lr
    if tc.schedule == "cosine":
        span = max(1, total - tc.warmup_steps)
        t = min(1.0, (step - tc.warmup_steps) / span)
        return lo + 0.5 * (tc.lr - lo) * (1 + math.cos(math.pi * t))
    decay_start = int(total * (1 - tc.decay_fraction))  # wsd
    if step < decay_start:
        return tc.lr
    t = (step - decay_start) / max(1, total - decay_start)
    return tc.lr + (lo - tc.lr) * t


def total_steps(cfg: RunConfig) -> int:
    tc = cfg.train
    if tc.max_tokens:
        per_step = tc.batch_size * tc.grad_accum * cfg.data.seq_len
        return max(1, math.ceil(tc.max_tokens / per_step))
    return tc.max_steps


# --------------------------------------------------------------------------------------------------------------
# evaluation


@torch.no_grad()
def evaluate(model: torch.nn.Module, corpus: Corpus, starts: np.ndarray, seq_len: int, device: torch.device,
             batch_size: int = 32, precision: str = "auto") -> float:
    """Mean token loss (nats) over fixed validation windows."""
    was = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(starts), batch_size):
        x, y = windows(corpus.val, starts[i:i + batch_size], seq_len)
        x, y = x.to(device), y.to(device)
        with autocast_for(device, precision):
            logits = model(x)
        # summed in float64 (on the CPU: MPS has none): the same total however the windows are batched or sharded
        total += float(lm_loss(logits, y, reduction="none").cpu().double().sum())
        count += y.numel()
    model.train(was)
    return total / count


# --------------------------------------------------------------------------------------------------------------
# the loop


@dataclass
class TrainResult:
    status: str
    step: int
    tokens: int
    val_loss: float | None
    val_floor: float | None
    seconds: float
    val_bpb: float | None = None
    signal: str | None = None  # SIGINT or SIGTERM, when one interrupted the run
    resume_step: int | None = None  # the step of the newest step checkpoint: where --resume continues


class NonFiniteLoss(CemtoolError):
    pass


class StopSignals:
    """SIGINT and SIGTERM while training: the handler only records the signal; the loop asks :meth:`requested` at
    the end of every step, then checkpoints and stops (all ranks at the same step). A second signal stops at once
    (KeyboardInterrupt: the newest checkpoint is kept). A signal this process ignores (a background job's SIGINT)
    stays ignored; outside the main thread (where Python cannot install handlers) nothing is installed."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self._old: dict = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            old = signal.getsignal(sig)
            if old is not signal.SIG_IGN and old is not None:
                self._old[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}

    def _handle(self, signum: int, frame) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name

    def requested(self, dd: Dist, device: torch.device) -> bool:
        """Whether a rank was signalled; under torchrun the signal numbers are all-reduced (max: SIGTERM over
        SIGINT), so that every rank stops after the same step and knows why."""
        if dd.world > 1:
            num = torch.tensor(float(signal.Signals[self.signal].value if self.signal else 0), device=device)
            dist.all_reduce(num, op=dist.ReduceOp.MAX)
            self.signal = signal.Signals(int(num.item())).name if num.item() else None
        return self.signal is not None


def _emit(cb: Callback | None, **event) -> None:
    if cb is not None:
        cb(event)


def train(cfg: RunConfig, corpus: Corpus, run: Run | None, *, device: str | torch.device | None = None,
          resume: bool = False, callback: Callback | None = None, stop_after: int | None = None,
          init_weights: dict[str, torch.Tensor] | None = None, allow_data_change: bool = False) -> TrainResult:
    """Train ``cfg`` on ``corpus``, writing into ``run`` (rank 0 only; None writes nothing).

    resume: continue from the run's newest step checkpoint. stop_after: stop (as if killed) after that many
    optimizer steps of this call; used by tests. init_weights: start from these weights (a state dict, e.g. a
    checkpoint's, for fine-tuning) instead of a fresh initialisation; a resumed step checkpoint overrides them.
    allow_data_change: resume even though the corpus hash differs from the one the run started with.
    Events passed to ``callback``: start, step, eval, checkpoint, end (and note).

    Evaluations (step 0, every ``eval_every`` steps and the last) write val_loss (nats/token), val_bpb (bits per
    byte, with the run's ``bytes_per_token`` in meta.json) and val_ppl; every row has ``epochs`` (training tokens
    consumed / tokens in the training split). A checkpoint is written only for weights (and optimizer state) that
    are finite and give a finite loss on the next batch, so that a resume never starts from broken weights.
    """
    tc, T = cfg.train, cfg.data.seq_len
    check_log_to(tc.log_to)  # train.log_to=tensorboard without its package: refused before anything starts
    dev = device if isinstance(device, torch.device) else pick_device(device)
    dd = init_distributed(dev)
    if tc.threads:
        torch.set_num_threads(tc.threads)
    if tc.batch_size % dd.world:
        raise CemtoolError(f"train.batch_size={tc.batch_size} is not divisible by the {dd.world} processes")
    writer = run if dd.main else None
    if resume and run is not None:
        check_data_unchanged(run.meta(), corpus, allow_data_change)
    check_memory(cfg.model, dev, batch_size=tc.batch_size // dd.world, seq_len=T, training=True)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model).to(dev)
    if init_weights is not None:
        model.load_state_dict(init_weights, strict=True)
    opt = make_optimizer(model, tc, dev)
    tracker = tracking.tracker_for(cfg, corpus, model) if tc.curvature_every else None  # subset checked now
    steps_total = total_steps(cfg)
    step, tokens_seen = 0, 0
    if resume and run is not None:
        step, tokens_seen = _restore(run, model, opt, callback, tracker, main=dd.main)
        if writer is not None:
            writer.truncate_metrics(step)
            writer.mark_resumed(str(dev))  # only now: a resume that fails leaves meta.json as it was
    log_row = metrics_writer(writer, tc.log_to)  # metrics.jsonl (and TensorBoard, rewritten from it)
    fwd = fwd_plain = compiled(model, tc, dev, callback)
    if dd.world > 1:
        fwd = DDP(fwd, device_ids=[dev.index] if dev.type == "cuda" else None)
    read_every = 1 if host_sync(tc, dev) == "step" else tc.log_every  # when the host reads the loss
    eval_starts = corpus.eval_windows(T, tc.eval_tokens)
    floor = corpus.floor(eval_starts, T)
    bytes_per_token = corpus.bytes_per_token(eval_starts, T)
    epoch_tokens = len(corpus.train)
    if writer is not None:
        writer.update_meta(bytes_per_token=bytes_per_token, epoch_tokens=epoch_tokens)
    params = model.num_params()
    per_rank = tc.batch_size // dd.world
    tokens_per_step = tc.batch_size * tc.grad_accum * T
    _emit(callback, kind="start", step=step, total=steps_total, params=params, device=str(dev),
          world=dd.world, floor=floor, entropy_rate=corpus.entropy_rate, eval_tokens=len(eval_starts) * T,
          bytes_per_token=bytes_per_token)

    def eval_row(step: int, tokens: int) -> float:
        val = evaluate(model, corpus, eval_starts, T, dev, precision=tc.precision)
        if not math.isfinite(val):
            raise NonFiniteLoss(f"validation loss became {val} at step {step}",
                                hint="lower train.lr or raise train.warmup_steps; the last good checkpoint is kept")
        row = {"step": step, "tokens": tokens, "epochs": tokens / epoch_tokens, "val_loss": val,
               "val_bpb": bits_per_byte(val, bytes_per_token), "val_ppl": perplexity(val), "val_floor": floor,
               "val_gap": None if floor is None else val - floor, "elapsed_s": time.perf_counter() - t0}
        if writer is not None:
            log_row(row)
        _emit(callback, kind="eval", **row)
        return val

    t0 = time.perf_counter()
    t_log, tok_log = t0, 0
    started, first_step = _now(), step  # this process's session of the run (meta.json "sessions")
    saved = step if resume and step else None  # the newest step checkpoint: where a resume would continue

    def session() -> dict:
        return {"started": started, "from_step": first_step, "to_step": step,
                "seconds": time.perf_counter() - t0, "device": str(dev),
                "compiled": isinstance(fwd_plain, Compiled) and fwd_plain.fallback is None,
                "compile_fallback": fwd_plain.fallback if isinstance(fwd_plain, Compiled) else None,
                "host_sync": host_sync(tc, dev)}

    def checkpoint_here() -> None:  # weights checked on every rank first: all stop alike
        x, y = windows(corpus.train, batch_starts(corpus, T, tc.batch_size, cfg.seed, step, 0), T)
        check_weights(model, opt, x.to(dev), y.to(dev), step, tc.precision)
        if writer is not None:
            _checkpoint(writer, model, opt, step, tokens_seen, tc.keep_checkpoints, session(),
                        extra=tracker.state() if tracker is not None else None)
            _emit(callback, kind="checkpoint", step=step)

    val_loss: float | None = None
    loss_value: float | None = None  # the last training loss the host read
    nonfinite = torch.zeros((), dtype=torch.bool, device=dev)  # any non-finite loss since the last read
    status = "completed"
    done_here = 0
    model.train()
    stop = StopSignals()
    stop.install()
    try:
        # the untrained model, where every curve starts; unless the run has it already (a resume before the first
        # checkpoint, or a caller that measured it, as forgetting does)
        if step == 0 and not (writer is not None and any(r.get("step") == 0 and "val_loss" in r
                                                         for r in writer.metrics())):
            val_loss = eval_row(0, 0)
        while step < steps_total:
            lr = lr_at(step, steps_total, tc)
            for g in opt.param_groups:
                g["lr"] = lr * g["lr_mult"]
            loss_sum = torch.zeros((), device=dev)
            for micro in range(tc.grad_accum):
                starts = batch_starts(corpus, T, tc.batch_size, cfg.seed, step, micro)
                starts = starts[dd.rank * per_rank:(dd.rank + 1) * per_rank]
                x, y = to_device(*windows(corpus.train, starts, T), dev)  # (B/world, T) each
                sync = (micro == tc.grad_accum - 1) or dd.world == 1
                ctx = nullcontext() if sync else fwd.no_sync()
                with ctx:
                    with autocast_for(dev, tc.precision):
                        loss = lm_loss(fwd(x), y)
                    (loss / tc.grad_accum).backward()
                loss_sum += loss.detach()
            train_loss = loss_sum / tc.grad_accum
            if dd.world > 1:
                dist.all_reduce(train_loss, op=dist.ReduceOp.AVG)
            nonfinite |= ~torch.isfinite(train_loss)  # on the device: no sync
            read = (step + 1) % read_every == 0 or (step + 1) % tc.log_every == 0 or step + 1 == steps_total
            if read:
                loss_value = float(train_loss)  # the only per-step host read, at this cadence
                if bool(nonfinite):
                    where = (f"{loss_value} at step {step + 1}" if read_every == 1 else
                             f"non-finite at one of steps {max(1, step + 2 - read_every)}..{step + 1} (train.host_sync"
                             f"=log reads it every {read_every} steps)")
                    raise NonFiniteLoss(f"training loss became {where}",
                                        hint="lower train.lr or raise train.warmup_steps; the last good checkpoint "
                                             "is kept")
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip if tc.grad_clip > 0
                                                   else float("inf"))
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            done_here += 1
            tokens_seen += tokens_per_step
            tok_log += tokens_per_step
            now = time.perf_counter()
            if step % tc.log_every == 0 or step == steps_total:
                row = {"step": step, "tokens": tokens_seen, "epochs": tokens_seen / epoch_tokens,
                       "train_loss": loss_value, "lr": lr,
                       "grad_norm": float(gnorm), "tokens_per_s": tok_log / max(now - t_log, 1e-9),
                       "elapsed_s": now - t0}
                t_log, tok_log = now, 0
                if writer is not None:
                    log_row(row)
            _emit(callback, kind="step", step=step, total=steps_total, loss=loss_value, lr=lr,
                  tokens=tokens_seen)  # loss: the last one read (train.host_sync)
            if tracker is not None and step % tc.curvature_every == 0:  # every rank (data-parallel HVPs)
                row = {**tracker.measure(model, opt, step=step, lr=lr_at(step, steps_total, tc), beta1=tc.beta1,
                                         optimizer_name=tc.optimizer),
                       "tokens": tokens_seen}
                if writer is not None:
                    log_row(row)
                _emit(callback, **row)
            if step % tc.eval_every == 0 or step == steps_total:
                val_loss = eval_row(step, tokens_seen)
            ckpt_every = tc.ckpt_every or tc.eval_every
            if step % ckpt_every == 0 and step < steps_total:
                checkpoint_here()
                saved = step
            # SIGINT/SIGTERM: checkpoint here, then stop. Under torchrun the ranks agree on a signal with a
            # collective: at the loss-read cadence, not every step
            if (dd.world == 1 or read) and stop.requested(dd, dev) and step < steps_total:
                status = "interrupted"
                if saved != step:
                    try:
                        checkpoint_here()
                        saved = step
                    except NonFiniteLoss as e:  # never a checkpoint of broken weights: the older one stays
                        _emit(callback, kind="note", message=f"no checkpoint at step {step}: {e.message}")
                break
            if stop_after is not None and done_here >= stop_after and step < steps_total:
                status = "interrupted"
                break
    except KeyboardInterrupt:
        status = "interrupted"
    except NonFiniteLoss:
        if writer is not None:
            writer.end_session(session(), "failed", best_effort=True, step=step, error="non-finite loss")
        raise
    except torch.OutOfMemoryError:
        if writer is not None:
            writer.end_session(session(), "failed", best_effort=True, step=step, error="out of memory")
        raise CemtoolError(f"out of memory on {dev} (batch_size={tc.batch_size}, seq_len={T}, "
                           f"d_model={cfg.model.d_model})",
                           hint="shrink train.batch_size (use train.grad_accum to keep the batch), data.seq_len "
                                "or the model") from None
    except RuntimeError as e:  # under torchrun: another rank died or timed out in a collective
        if dd.world == 1 or not peer_failure(e):
            raise
        if writer is not None:
            writer.end_session(session(), "failed", best_effort=True, step=step,
                               error="another rank died or timed out")
        where = f"from step {saved}" if saved is not None else "from step 0 (no step checkpoint yet)"
        raise training_failed(e, step, f"the run is marked failed; cemtool train --resume continues it {where}"
                              ) from None
    except (CemtoolError, OSError) as e:  # e.g. disk full: the run must not stay "running"
        if writer is not None:
            writer.end_session(session(), "failed", best_effort=True, step=step, error=str(e)[:300])
        raise
    finally:
        stop.restore()
    seconds = time.perf_counter() - t0
    if writer is not None:
        if status == "completed":
            if not _finite(model.parameters()):
                writer.end_session(session(), "failed", step=step, error="non-finite weights")
                raise NonFiniteLoss(f"the weights became non-finite at step {step}; no final checkpoint written")
            save_checkpoint(writer, "final", model, step=step, optimizer=None,
                            state={"tokens": tokens_seen, "val_loss": val_loss})
        writer.end_session({**session(), "seconds": seconds}, status, step=step, tokens=tokens_seen,
                           val_loss=val_loss, val_bpb=bits_per_byte(val_loss, bytes_per_token),
                           val_ppl=perplexity(val_loss), epochs=tokens_seen / epoch_tokens, val_floor=floor,
                           entropy_rate=corpus.entropy_rate, params=params, world_size=dd.world,
                           resume_step=saved if status == "interrupted" else None)
    _emit(callback, kind="end", status=status, step=step, val_loss=val_loss, floor=floor, seconds=seconds)
    if status == "completed" and stop.signal is not None:  # it came during the last step or the final save:
        signal.raise_signal(signal.Signals[stop.signal])  # the run is complete; now the process's own handler acts
    return TrainResult(status, step, tokens_seen, val_loss, floor, seconds, bits_per_byte(val_loss, bytes_per_token),
                       signal=stop.signal if status == "interrupted" else None, resume_step=saved)


def _finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


@torch.no_grad()
def check_weights(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, step: int,
                  precision: str = "auto") -> None:
    """Refuse (NonFiniteLoss) to checkpoint weights or optimizer state holding nan/inf, or weights whose loss on
    the next batch (x, y) is not finite: the first thing a resume would compute. Checked before every step
    checkpoint: an optimizer step can break the weights after the loss that preceded it was fine."""
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    if not _finite(model.parameters()) or not _finite(state):
        raise NonFiniteLoss(f"the weights became non-finite at step {step}",
                            hint="lower train.lr or raise train.warmup_steps; the last good checkpoint is kept")
    was = model.training
    model.eval()
    with autocast_for(x.device, precision):
        loss = float(lm_loss(model(x), y))
    model.train(was)
    if not math.isfinite(loss):
        raise NonFiniteLoss(f"the weights of step {step} give a {loss} loss",
                            hint="lower train.lr or raise train.warmup_steps; the last good checkpoint is kept")


def check_data_unchanged(meta: dict, corpus: Corpus, allow: bool = False) -> None:
    """Refuse to resume a run whose data files changed since it started (their hash is in meta.json)."""
    then = (meta.get("corpus") or {}).get("sha256")
    now = corpus.info.get("sha256")
    if then and now and then != now and not allow:
        raise CemtoolError(f"the data of this run changed since it started ({corpus.info.get('source')}: corpus "
                           f"hash {now[:12]}, was {then[:12]})",
                           hint="restore the files, or pass --allow-data-change to resume on the new data")


def _now() -> str:

    return now()


def _checkpoint(run: Run, model, opt, step: int, tokens: int, keep: int, session: dict,
                extra: dict | None = None) -> None:
    """A step checkpoint (the newest ``keep`` are kept), after the session's progress up to it in meta.json, which
    a process killed with -9 leaves for the next one to count (Run.record_progress; first, so that no kill between
    the two loses the steps up to a saved checkpoint)."""
    run.record_progress(session)
    save_checkpoint(run, f"step_{step:06d}", model, step=step, optimizer=opt, state={"tokens": tokens}, extra=extra)
    old = step_checkpoints(run)[:-keep]
    for p in old:
        p.unlink(missing_ok=True)
    run.update_meta(step=step, last_checkpoint=f"step_{step:06d}")


def _restore(run: Run, model: torch.nn.Module, opt: torch.optim.Optimizer, callback: Callback | None,
             tracker: tracking.CurvatureTracker | None = None, main: bool = True) -> tuple[int, int]:
    """Weights, optimizer and RNG state (and the curvature tracker's warm start) of the newest step checkpoint that
    verifies; a newer one that does not is set aside (by the main process only), with a 'note' event saying so."""
    ckpt, notes = resume_checkpoint(run, set_aside=main, fits=lambda c: check_fits(c, model, opt))
    for note in notes:
        _emit(callback, kind="note", message=note)
    if ckpt is None:
        _emit(callback, kind="resume", step=0, checkpoint=None)
        return 0, 0
    _emit(callback, kind="resume", step=ckpt.step, checkpoint=ckpt.path.name)
    restore_training(ckpt, model, opt)
    if tracker is not None:
        tracker.load_state(ckpt.tensors)
    return ckpt.step, ckpt.tokens


def finalize_model_config(cfg: RunConfig, corpus: Corpus) -> RunConfig:
    """Fill the fields that depend on the data: vocabulary size and maximum sequence length."""
    m = cfg.model
    vocab = corpus.tokenizer.vocab_size
    if m.vocab_size and m.vocab_size < vocab:
        raise CemtoolError(f"model.vocab_size={m.vocab_size} is smaller than the tokenizer's {vocab}")
    m = replace(m, vocab_size=m.vocab_size or vocab, max_seq_len=m.max_seq_len or cfg.data.seq_len)
    cfg = replace(cfg, model=m)
    tracking.check_run_config(cfg)  # train.curvature_params must match the model's parameters
    return cfg
