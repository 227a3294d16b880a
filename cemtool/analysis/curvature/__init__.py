"""Curvature operators (METHODS §6): :mod:`.risk` (the empirical risk every operator is the curvature of:
evaluation batches, ranks, parameter subset, dtype, L and ∇L), :mod:`.protocol` (what an estimator asks of an
operator; a dense matrix as one), :mod:`.operators` (the Hessian, GGN, empirical and Monte-Carlo Fisher of a
language model, and their registry), :mod:`.preconditioned` (Adam's preconditioned operator), :mod:`.blocks`
(block-diagonal restrictions) and :mod:`.stationarity` (where the model stands). The estimators that take any
operator are cemtool.analysis.lanczos, .trace and .density. This module imports nothing (the CLI reads the names
below without loading torch)."""

# the operators by name: what each is (docs, console) and its symbol in tables (tr(H), tr(G), ...)
OPERATOR_NAMES = {"hessian": "the Hessian ∇²L", "ggn": "the generalised Gauss-Newton (PSD)",
                  "ef": "the empirical Fisher, per token (PSD)", "fisher": "the Monte-Carlo Fisher (PSD)"}
SYMBOLS = {"hessian": "H", "ggn": "G", "ef": "F_emp", "fisher": "F"}
