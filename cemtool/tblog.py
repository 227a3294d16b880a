"""TensorBoard logging (``train.log_to=tensorboard``): the rows of metrics.jsonl as TensorBoard scalars.

metrics.jsonl is the one source. Every row training writes there is also written, through :func:`row_scalars`
(one row -> {tag: value} at the row's step), to ``RUN/tensorboard/events.out.tfevents.cemtool``. When training
starts (or resumes, after metrics.jsonl has been cut back to the checkpoint's step) that event file is rewritten
from metrics.jsonl as it stands, so it always holds exactly the rows metrics.jsonl holds. The event file is
written with the tensorboard package's own record format and protobufs (the optional extra
``cemtool[tensorboard]``); without it, training with ``train.log_to=tensorboard`` is refused before it starts.
"""

from __future__ import annotations

import errno
import math
import os
import time
from collections.abc import Callable, Iterable

from cemtool.errors import CemtoolError
from cemtool.runs import Run
from cemtool.writes import atomic_write_bytes, os_error, to_json_value

TB_DIR = "tensorboard"
EVENT_FILE = "events.out.tfevents.cemtool"  # TensorBoard reads every file whose name holds "tfevents"
NOT_SCALARS = ("step",)  # the x axis of every scalar


def row_group(row: dict) -> str:
    """Which kind of row: its ``kind`` (curvature), else eval (it has val_loss), else train."""
    kind = row.get("kind")
    return kind if isinstance(kind, str) and kind else ("eval" if "val_loss" in row else "train")


def row_scalars(row: dict) -> dict[str, float]:
    """The scalars of one metrics.jsonl row: every finite number in it (bools and the step aside), tagged
    ``<group>/<key>`` with the key as metrics.jsonl names it (``train/train_loss``, ``eval/val_loss``,
    ``curvature/lambda_max``): a train row and an eval row of one step both hold ``tokens``, and a tag has one
    value per step."""
    group, out = row_group(row), {}
    for key, v in row.items():
        if key in NOT_SCALARS or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(v):
            out[f"{group}/{key}"] = float(v)
    return out


def _tensorboard():
    """The tensorboard package's event protobufs and record writer, or one line naming the extra."""
    try:  # optional dependency: tensorboard (the extra cemtool[tensorboard])
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary  # optional dependency: tensorboard
        from tensorboard.summary.writer.record_writer import RecordWriter  # optional dependency: tensorboard
    except ImportError:
        raise CemtoolError("train.log_to=tensorboard needs the tensorboard package, which is not installed",
                           hint="pip install 'cemtool[tensorboard]' (or set train.log_to=none)") from None
    return Event, Summary, RecordWriter


def check_log_to(log_to: str) -> None:
    """Refuse, before anything starts, a ``train.log_to`` whose package is missing."""
    if log_to == "tensorboard":
        _tensorboard()


class _Buffer:
    """The file-like sink RecordWriter writes to."""

    def __init__(self):
        self.parts: list[bytes] = []

    def write(self, b: bytes) -> None:
        self.parts.append(b)

    def flush(self) -> None:
        pass


def encode_rows(rows: Iterable[dict], *, header: bool = False) -> bytes:
    """TensorBoard records (the file-version event first if ``header``), one event per row with a step."""
    Event, Summary, RecordWriter = _tensorboard()
    buf = _Buffer()
    rec = RecordWriter(buf)
    if header:
        rec.write(Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString())
    for row in rows:
        if not isinstance(row.get("step"), int) or isinstance(row.get("step"), bool):
            continue
        values = [Summary.Value(tag=k, simple_value=v) for k, v in row_scalars(row).items()]
        if values:
            ev = Event(wall_time=time.time(), step=row["step"], summary=Summary(value=values))
            rec.write(ev.SerializeToString())
    return b"".join(buf.parts)


class TensorBoardLog:
    """RUN/tensorboard/: rewritten from metrics.jsonl when opened, then one event appended per row."""

    def __init__(self, run: Run):
        _tensorboard()
        folder = run._subdir(TB_DIR)  # refuses a link
        folder.mkdir(exist_ok=True)
        self.path = folder / EVENT_FILE
        atomic_write_bytes(self.path, encode_rows(run.metrics(), header=True))

    def append(self, row: dict) -> None:
        data = encode_rows([to_json_value(row)])  # the row as metrics.jsonl holds it (NaN -> null)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CemtoolError(f"{self.path} is a symbolic link: cemtool does not follow links inside a run "
                                   "directory", hint="remove the link") from None
            raise os_error(e, self.path) from None
        try:
            os.write(fd, data)
        except OSError as e:
            raise os_error(e, self.path) from None
        finally:
            os.close(fd)


def metrics_writer(run: Run | None, log_to: str) -> Callable[[dict], None]:
    """What training calls with each metrics row: append it to metrics.jsonl, and with ``log_to`` tensorboard to
    the event file too (opened now, from the rows metrics.jsonl already holds)."""
    if run is None:
        return lambda row: None
    if log_to != "tensorboard":
        return run.append_metrics
    tb = TensorBoardLog(run)

    def write(row: dict) -> None:
        run.append_metrics(row)
        tb.append(row)
    return write
