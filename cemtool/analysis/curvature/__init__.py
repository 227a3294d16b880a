"""Curvature operators (METHODS §6): :mod:`.protocol` (what an estimator asks of an operator; a dense matrix as
one), :mod:`.operators` (the Hessian, GGN, empirical and Monte-Carlo Fisher of a language model, and their
registry) and :mod:`.stationarity` (where the model stands). This module imports nothing (cemtool.analysis.hessian
imports the protocol, and the CLI reads the names below without loading torch)."""

# the operators by name: what each is (docs, console) and its symbol in tables (tr(H), tr(G), ...)
OPERATOR_NAMES = {"hessian": "the Hessian ∇²L", "ggn": "the generalised Gauss-Newton (PSD)",
                  "ef": "the empirical Fisher, per token (PSD)", "fisher": "the Monte-Carlo Fisher (PSD)"}
SYMBOLS = {"hessian": "H", "ggn": "G", "ef": "F_emp", "fisher": "F"}
