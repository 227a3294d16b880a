"""The one activation-capture mechanism: named hook points in the forward pass (TransformerLens style).

Every family places :class:`HookPoint` modules where an analysis may want to look. Their names are their module
paths, e.g. ``blocks.3.attn.pattern``, ``blocks.3.attn.v``, ``blocks.3.resid_post``, ``blocks.3.lime.weights``.
A hook point is the identity unless a :func:`capture` context is active on it::

    with capture(model, "blocks.*.attn.v") as cache:
        model(idx)
    v0 = cache["blocks.0.attn.v"]          # (B, H, T, d_h), detached, on the CPU

Names are selected by glob patterns (``fnmatch``), a list of them, or a predicate. A point that fires several
times in one forward pass (recursive CEM steps) keeps every value: ``cache.all(name)``; ``cache[name]`` is the last.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from cemtool.errors import CemtoolError


class HookPoint(nn.Module):
    """Identity module that hands its input to a capture callback when one is attached."""

    def __init__(self) -> None:
        super().__init__()
        self.callback: Callable[[torch.Tensor], None] | None = None

    @property
    def active(self) -> bool:
        return self.callback is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.callback is not None:
            self.callback(x)
        return x


class Cache:
    """Captured values by hook-point name (a list per name, in firing order)."""

    def __init__(self) -> None:
        self._values: dict[str, list[torch.Tensor]] = {}

    def add(self, name: str, value: torch.Tensor) -> None:
        self._values.setdefault(name, []).append(value)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._values:
            raise KeyError(f"nothing captured at {name!r}; captured: {', '.join(self._values) or 'nothing'}")
        return self._values[name][-1]

    def __contains__(self, name: str) -> bool:
        return name in self._values

    def all(self, name: str) -> list[torch.Tensor]:
        return self._values.get(name, [])

    def names(self) -> list[str]:
        return list(self._values)

    def clear(self) -> None:
        self._values.clear()


def hook_points(model: nn.Module) -> dict[str, HookPoint]:
    """Every hook point of a model by name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, HookPoint)}


def _selector(names: str | Iterable[str] | Callable[[str], bool] | None) -> Callable[[str], bool]:
    if names is None:
        return lambda n: True
    if callable(names):
        return names
    patterns = [names] if isinstance(names, str) else list(names)
    return lambda n: any(fnmatch.fnmatchcase(n, p) for p in patterns)


@contextmanager
def capture(model: nn.Module, names: str | Iterable[str] | Callable[[str], bool] | None = None, *,
            detach: bool = True, device: str | torch.device | None = "cpu",
            transform: Callable[[str, torch.Tensor], torch.Tensor | None] | None = None) -> Iterator[Cache]:
    """Record the values at the selected hook points while the context is open.

    detach/device: captured tensors are detached and copied to ``device`` (None = leave where they are).
    transform: optional ``f(name, x) -> y`` applied before storing (e.g. to reduce a pattern to statistics
    on the fly, so memory does not grow with the evaluation set); returning None stores nothing.
    """
    select = _selector(names)
    points = {n: p for n, p in hook_points(model).items() if select(n)}
    if not points:
        raise CemtoolError(f"no hook point matches {names!r}",
                           hint="list them with cemtool.models.capture.hook_points(model)")
    cache = Cache()

    def make(name: str) -> Callable[[torch.Tensor], None]:
        def store(x: torch.Tensor) -> None:
            y = x.detach() if detach else x
            if transform is not None:
                y = transform(name, y)
                if y is None:
                    return
            if device is not None:
                y = y.to(device)
            cache.add(name, y)
        return store

    previous = {n: p.callback for n, p in points.items()}
    try:
        for n, p in points.items():
            p.callback = make(n)
        yield cache
    finally:
        for n, p in points.items():
            p.callback = previous[n]
