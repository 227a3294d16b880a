"""Adding a curvature operator touches its class and one registration (docs/architecture.md, "Adding a curvature
operator"): a toy operator registered here, in a test, runs through measure_sharpness, the per-block table and
`cemtool sharpness --operator`, and its numbers equal its dense matrix built independently."""

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cemtool.analysis.curvature import CARDS, OperatorCard
from cemtool.analysis.curvature.operators import OPERATORS, JacobianOperator, make_operator, register_operator
from cemtool.analysis.lanczos import lanczos
from cemtool.analysis.sharpness import SharpnessOptions, measure_per_layer, measure_sharpness
from cemtool.cli.main import app
from cemtool.errors import CemtoolError

from kit import dense_jacobian, tiny_model, tiny_tokens, train_tiny

V, T = 8, 4


class LogitGaussNewton(JacobianOperator):
    """The toy: (1/N) Σ_t J_tᵀ J_t, the Gauss-Newton of ½‖logits‖² (the GGN with an identity middle)."""

    card = OperatorCard("logit-gn", "the Gauss-Newton of the squared logits (PSD)", "G_sq", psd=True)

    def outputs(self, b, logits):
        return logits  # (B, T, V)

    def middle(self, b, f, jv):
        return jv / self.tokens  # (B, T, V)


@pytest.fixture
def toy():
    register_operator(LogitGaussNewton)
    yield "logit-gn"
    OPERATORS.pop("logit-gn"), CARDS.pop("logit-gn")


def problem():
    model = tiny_model("baseline", d_model=8, n_layer=2, n_head=2, mlp_hidden=8, vocab=V, seq_len=T)
    x, y = tiny_tokens(2, T, V, seed=3)
    _, J = dense_jacobian(model, x, lambda z: z)  # (B, T, V, n)
    J = J.reshape(-1, J.shape[-1])  # (B*T*V, n)
    return model, x, y, J.T @ J / y.numel()  # (n, n)


def test_a_registered_operator_runs_through_sharpness_and_blocks_against_its_dense_matrix(toy):
    model, x, y, A = problem()
    ev = torch.linalg.eigvalsh(A)  # ascending
    o = SharpnessOptions(operator=toy, dtype="fp64", top_k=2, bottom_k=0, lanczos_steps=120, tol=1e-12,
                         trace_methods=("hutchinson",), trace_hvps=60, density_runs=0, landscape="none")
    rep = measure_sharpness(model, x, y, o)
    assert rep.eigen.top == pytest.approx([float(ev[-1]), float(ev[-2])], rel=1e-8)
    tr = rep.traces[0]
    assert abs(tr.trace - float(torch.trace(A))) <= 4 * tr.se + 1e-9 * float(torch.trace(A))
    assert rep.standing.verdict is not None and rep.payload()["options"]["operator"] == toy
    # the dense matrix is not the GGN: the check can fail (the GGN's top eigenvalue differs)
    with make_operator("ggn", model, x, y, dtype="fp64") as ggn:
        g = lanczos(ggn, 1, 0, max_steps=60, tol=1e-10, seed=0)
    assert g.top_converged[0] and abs(g.top[0] - float(ev[-1])) > 1e-3 * float(ev[-1])

    names = [n for n, _ in model.named_parameters()]
    rows = measure_per_layer(model, x, y, o, blocks="layer")
    assert len(rows) >= 2
    for row in rows:
        with make_operator(toy, model, x, y, dtype="fp64", params=row.params) as op:
            idx = [i for i, n in enumerate(names) if n in set(op.names)]
        sizes = [p.numel() for p in model.parameters()]
        start = [sum(sizes[:i]) for i in range(len(sizes))]
        sel = torch.tensor([k for i in idx for k in range(start[i], start[i] + sizes[i])])
        block = A[sel][:, sel]  # the dense block A_SS
        assert row.lambda_max == pytest.approx(float(torch.linalg.eigvalsh(block)[-1]), rel=1e-8)


def test_a_registered_operator_is_a_cli_choice_with_its_own_report(toy, tmp_path):
    run = train_tiny(tmp_path / "run")
    args = ["sharpness", run, "--operator", toy, "--dtype", "fp64", "--tokens", "64", "--top-k", "1",
            "--bottom-k", "0", "--lanczos-steps", "10", "--trace-hvps", "4", "--density-runs", "0",
            "--landscape", "none", "--quiet"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    rep = json.loads((Path(run) / "reports" / "sharpness-logit-gn.json").read_text())
    assert rep["options"]["operator"] == toy and rep["eigen"]["top"][0] > 0
    assert not (Path(run) / "reports" / "sharpness.json").exists()  # never the Hessian's report
    # its options are its own: another operator's semantic option is refused, in one line
    res = CliRunner().invoke(app, args + ["--mc-samples", "3"])
    assert res.exit_code != 0 and "--mc-samples 3 sets the Monte-Carlo Fisher's" in res.output
    assert "Traceback" not in res.output


def test_registering_needs_an_operator_with_a_card():
    with pytest.raises(CemtoolError, match="not an Operator subclass with a card"):
        register_operator(dict)
    with pytest.raises(CemtoolError, match="unknown curvature operator 'logit-gn'"):
        SharpnessOptions(operator="logit-gn")  # unregistered: not known
