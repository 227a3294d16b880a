"""The architectures: name -> family, builder and preset.

A preset is a partial config dict applied before the user's config file and --set overrides, e.g.
``{"model": {"cem": {"steps": 2}}}`` for ``cem-rec2``. Family modules register themselves on import;
:data:`FAMILY_MODULES` lists them so the catalogue is complete whenever it is consulted. This module imports no
model code (it loads the family modules by name when first consulted), so that :func:`cemtool.config.resolve`
can read presets from it; :func:`cemtool.models.registry.build_model` builds a model.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

from cemtool.errors import CemtoolError, known_hint

FAMILY_MODULES = ["cemtool.models.baseline", "cemtool.models.cem", "cemtool.models.momentum",
                  "cemtool.models.lime", "cemtool.models.allocation"]


@dataclass(frozen=True)
class ArchSpec:
    name: str
    family: str
    build: Callable  # ModelConfig -> LM
    preset: dict = field(default_factory=dict)
    description: str = ""


_ARCHS: dict[str, ArchSpec] = {}
_loaded = False


def register(name: str, family: str, build: Callable, preset: dict | None = None, description: str = "") -> None:
    if name in _ARCHS and _ARCHS[name].build is not build:
        raise ValueError(f"architecture {name!r} registered twice")
    _ARCHS[name] = ArchSpec(name, family, build, preset or {}, description)


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for mod in FAMILY_MODULES:
            importlib.import_module(mod)


def archs() -> dict[str, ArchSpec]:
    _load()
    return dict(_ARCHS)


def get_arch(name: str) -> ArchSpec:
    _load()
    if name not in _ARCHS:
        raise CemtoolError(f"unknown architecture {name!r}", hint=known_hint(name, _ARCHS))
    return _ARCHS[name]


def arch_list(only: list[str] | None = None) -> list[dict]:
    """Name, family and description of every architecture (or of ``only``), by family then name; builds nothing."""
    specs = [get_arch(n) for n in only] if only else sorted(archs().values(), key=lambda a: (a.family, a.name))
    return [{"arch": a.name, "family": a.family, "description": a.description} for a in specs]
