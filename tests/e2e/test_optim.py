"""train.optimizer=muon: which parameters Muon trains, its state in checkpoints, bit-exact resume."""

import re

import pytest
import torch

from cemtool.checkpoints import find_checkpoint, read_checkpoint, save_checkpoint
from cemtool.config import TrainConfig, resolve
from cemtool.errors import ConfigError
from cemtool.models import lm_loss
from cemtool.optim import Combined, make_optimizer
from cemtool.runs import Run, create_run, open_run
from cemtool.train import train

from kit import tiny_model, tiny_setup

CPU = torch.device("cpu")
HIDDEN = re.compile(r"blocks\.\d+\.(attn\.(wq|wk|wv|wo)|mlp\.(up|gate|down))\.weight")  # the blocks' projections
MUON = TrainConfig(optimizer="muon", lr=1e-3, muon_lr=0.02, weight_decay=0.1)


def model_of(arch: str, *extra: str):
    return tiny_model(arch, *extra, vocab=24, seq_len=8)


def groups_of(opt) -> dict[str, dict]:
    return {g["name"]: g for g in opt.param_groups}


@pytest.mark.parametrize("arch,extra", [("baseline", ()), ("baseline", ("model.tie_embeddings=false",)),
                                        ("tmm", ()), ("adam", ()), ("lime", ()), ("lime-dynamic", ())])
def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(arch, extra):
    model = model_of(arch, *extra)
    opt = make_optimizer(model, MUON, CPU)
    groups = groups_of(opt)
    names = dict(model.named_parameters())
    muon = groups["muon"]["param_names"]
    assert muon and set(muon) == {n for n in names if HIDDEN.fullmatch(n)}
    assert all(names[n].dim() == 2 for n in muon)
    adamw = [n for name, g in groups.items() if name != "muon" for n in g["param_names"]]
    assert sorted(muon + adamw) == sorted(names)  # every parameter exactly once
    assert "tok_emb.weight" in adamw and "ln_f.weight" in adamw
    if "model.tie_embeddings=false" in extra:
        assert "head.weight" in groups["decay"]["param_names"]  # the output head stays with AdamW
    if arch in ("tmm", "adam"):  # stream tables, learned scalars and stream norms
        assert {n for n in names if n.startswith("stream_emb.")} <= set(groups["no_decay"]["param_names"])
        assert any(".raw." in n for n in adamw) and any(".ln_" in n for n in adamw)
    if arch.startswith("lime"):  # routers keep their own group, 10x the AdamW rate
        routers = groups["router"]
        assert routers["param_names"] and routers["lr"] == pytest.approx(10 * MUON.lr)
    assert groups["muon"]["lr"] == pytest.approx(MUON.muon_lr)
    assert groups["muon"]["lr_mult"] * MUON.lr == pytest.approx(MUON.muon_lr)  # follows lr's schedule
    assert all(g["lr"] == pytest.approx(MUON.lr * g["lr_mult"]) for name, g in groups.items() if name != "muon")


def test_adamw_default_is_one_torch_adamw_and_muon_needs_a_positive_lr():
    model = model_of("baseline")
    assert isinstance(make_optimizer(model, TrainConfig(), CPU), torch.optim.AdamW)
    with pytest.raises(ConfigError, match="train.lr > 0"):
        make_optimizer(model, TrainConfig(optimizer="muon", lr=0.0), CPU)


def steps(model, opt, n: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        idx = torch.randint(0, 24, (2, 8), generator=g)
        lm_loss(model(idx[:, :-1]), idx[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_combined_state_round_trips_through_a_checkpoint(tmp_path):
    """Both optimizers' state (AdamW moments, Muon momentum buffers) is in the safetensors file, loads back
    equal, and the loaded optimizer takes the same next step; without it the step differs."""
    model = model_of("tmm")
    opt = make_optimizer(model, MUON, CPU)
    steps(model, opt, 3)
    (tmp_path / "run").mkdir()
    path = save_checkpoint(Run(tmp_path / "run"), "step_000003", model, step=3, optimizer=opt)
    ckpt = read_checkpoint(path)
    n_muon = len(groups_of(opt)["muon"]["params"])
    assert sum(k.endswith(".momentum_buffer") for k in ckpt.tensors) == n_muon
    assert sum(k.endswith(".exp_avg_sq") for k in ckpt.tensors) == len(list(model.parameters())) - n_muon

    def resumed(with_state: bool):
        m = model_of("tmm")
        m.load_state_dict(ckpt.weights)
        o = make_optimizer(m, MUON, CPU)
        if with_state:
            o.load_state_dict(ckpt.optimizer_state())
        return m, o

    m2, o2 = resumed(True)
    a, b = opt.state_dict(), o2.state_dict()
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    assert all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])
    steps(model, opt, 2, seed=1)
    steps(m2, o2, 2, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), m2.parameters(), strict=True))
    m3, o3 = resumed(False)
    steps(m3, o3, 2, seed=1)
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), m3.parameters(), strict=True))


def test_plain_adamw_state_is_refused_by_a_muon_run():
    model = model_of("baseline")
    adamw = make_optimizer(model, TrainConfig(), CPU)
    steps(model, adamw, 1)
    opt = make_optimizer(model, MUON, CPU)
    assert isinstance(opt, Combined)
    with pytest.raises(ValueError, match="this run trains with"):
        opt.load_state_dict(adamw.state_dict())


def test_muon_run_killed_and_resumed_is_bit_exact(tmp_path, text_file):
    """A muon run stopped after step 15 (checkpoint at 10: steps 11-15 are lost, as in a kill) and resumed in a
    fresh model and optimizer ends with the same weights and losses as an uninterrupted run."""
    cfg, corpus = tiny_setup(text_file, "train.optimizer=muon", "train.muon_lr=0.01", "train.ckpt_every=10",
                             "train.eval_every=10", arch="tmm")

    ref = create_run(tmp_path / "ref", cfg, argv=[])
    train(cfg, corpus, ref, device="cpu")
    ref.unlock()
    killed = create_run(tmp_path / "killed", cfg, argv=[])
    assert train(cfg, corpus, killed, device="cpu", stop_after=15).status == "interrupted"
    killed.unlock()
    again = open_run(tmp_path / "killed", lock=True)
    res = train(cfg, corpus, again, device="cpu", resume=True)
    again.unlock()
    assert res.status == "completed" and res.step == 30
    a = read_checkpoint(find_checkpoint(ref, "final")).weights
    b = read_checkpoint(find_checkpoint(again, "final")).weights
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = lambda r: [(m["step"], m.get("train_loss"), m.get("val_loss")) for m in r.metrics()]  # noqa: E731
    assert rows(ref) == rows(again)


def test_fine_tune_of_a_muon_run_uses_the_adamw_recipe():
    """The forgetting recipe is AdamW for every variant, whichever optimizer pretrained the source."""
    from cemtool.forgetting import REFERENCE, finetune_config

    source = resolve(arch="tmm", overrides=["train.optimizer=muon"])
    assert finetune_config(source, "grammar-b", REFERENCE).train.optimizer == "adamw"


def test_muon_with_zero_lr_is_refused_before_a_run_is_created():
    with pytest.raises(ConfigError, match="needs train.lr > 0"):
        resolve(arch="baseline", overrides=["train.optimizer=muon", "train.lr=0"])


def test_muon_on_a_torch_without_it_is_one_config_error(monkeypatch):
    """torch < 2.9 has no torch.optim.Muon: a ConfigError naming the version, not an AttributeError."""
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(ConfigError, match="torch >= 2.9"):
        make_optimizer(model_of("baseline"), MUON, CPU)
