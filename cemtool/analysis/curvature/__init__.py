"""Curvature operators (METHODS §6): :mod:`.risk` (the empirical risk every operator is the curvature of:
evaluation batches, ranks, parameter subset, dtype, L and ∇L), :mod:`.protocol` (what an estimator asks of an
operator; a dense matrix as one), :mod:`.operators` (the Hessian, GGN, empirical and Monte-Carlo Fisher of a
language model, and their registry), :mod:`.preconditioned` (Adam's preconditioned operator), :mod:`.blocks`
(block-diagonal restrictions) and :mod:`.stationarity` (where the model stands). The estimators that take any
operator are cemtool.analysis.lanczos, .trace and .density.

This module imports nothing heavy: it holds each operator's card (what the CLI, the reports, ``compare`` and the
plots need to know about an operator without loading torch). An operator is its class in :mod:`.operators` and its
card here, registered together by :func:`cemtool.analysis.curvature.operators.register_operator`; no analysis or
command asks an operator's name anything else (docs/architecture.md, "Adding a curvature operator")."""

from __future__ import annotations

from dataclasses import dataclass, field

from cemtool.errors import CemtoolError


@dataclass(frozen=True)
class OperatorCard:
    """What is known about an operator by name.

    ``title``: what it is (console, report.md); ``symbol``: its letter in tables (tr(H), tr(G), ...); ``psd``:
    positive semi-definite by construction (its spectrum cannot tell a minimum from a saddle); ``options``: the
    operator's own semantic options and their defaults (another operator given a non-default value is refused:
    the user asked for something it does not compute); ``report``: the report's base name (reports of different
    operators never overwrite each other); ``pyhessian``: PyHessian computes the same products (the cross-check
    backend)."""

    name: str
    title: str
    symbol: str
    psd: bool
    options: dict = field(default_factory=dict)
    report: str = ""
    pyhessian: bool = False

    def __post_init__(self):
        if not self.report:
            object.__setattr__(self, "report", f"sharpness-{self.name}")


DEFAULT_OPERATOR = "hessian"  # what `sharpness` measures unless told, and what a report without the option measured

# the semantic options some operator takes, and what each means to the user when given to another one
SEMANTIC_OPTIONS = {"hvp": ("--hvp", "a Hessian product method"),
                    "mc_samples": ("--mc-samples", "the Monte-Carlo Fisher's label draws per token")}

CARDS: dict[str, OperatorCard] = {c.name: c for c in (
    OperatorCard("hessian", "the Hessian ∇²L", "H", psd=False, options={"hvp": "exact"}, report="sharpness",
                 pyhessian=True),
    OperatorCard("ggn", "the generalised Gauss-Newton (PSD)", "G", psd=True),
    OperatorCard("ef", "the empirical Fisher, per token (PSD)", "F_emp", psd=True),
    OperatorCard("fisher", "the Monte-Carlo Fisher (PSD)", "F", psd=True, options={"mc_samples": 1}),
)}


def card(name: str) -> OperatorCard:
    """The card of operator ``name`` (an unknown name: one clear error listing the known ones)."""
    if name not in CARDS:
        raise CemtoolError(f"unknown curvature operator {name!r}", hint=f"use {', '.join(CARDS)}")
    return CARDS[name]


def check_operator_options(name: str, **given) -> None:
    """Refuse a semantic option (``hvp``, ``mc_samples``) set away from its default for an operator that does not
    take it: the user asked for something this operator does not compute."""
    c = card(name)
    for key, value in given.items():
        if key in c.options:
            continue
        owners = [o for o in CARDS.values() if key in o.options]
        if owners and value != owners[0].options[key]:
            flag, what = SEMANTIC_OPTIONS.get(key, (key, key))
            raise CemtoolError(f"{flag} {value} sets {what}; the {name} operator does not take it",
                               hint=f"drop {flag}, or use --operator {' or '.join(o.name for o in owners)}")


def title(name: str) -> str:
    return CARDS[name].title if name in CARDS else name


def symbol(name: str) -> str:
    return CARDS[name].symbol if name in CARDS else "A"  # a report of an operator this install does not know
