"""The optimizer of a training run (``train.optimizer``).

- ``adamw``: AdamW with named parameter groups: ``decay`` (the matrices of Linear layers and any other >= 2-D
  non-embedding tensor, with ``train.weight_decay``), ``no_decay`` (norms, biases, scalars, embeddings, a tied head)
  and any group a family declares by tagging a parameter with ``p.opt_group = "name"`` and ``p.lr_mult = x``
  (LIMe's routers).
- ``muon``: the Momentum Streams paper's protocol: torch.optim.Muon (momentum ``train.muon_momentum``, Nesterov,
  5 Newton-Schulz steps, torch's default shape scaling sqrt(max(1, rows/cols))) at peak rate ``train.muon_lr`` for
  the hidden matrices, which are the weights of the Linear layers inside the blocks (attention and MLP
  projections); AdamW, exactly as above at ``train.lr``, for everything else: the embeddings (token, position,
  stream tables), the LM head, norms, scalars and 1-D parameters, tagged groups (LIMe's routers) and the other
  >= 2-D tensors that are not Linear weights (CEM's DPLR diagonals delta_h and preconditioner factors U).

Every group carries ``lr_mult``: the training loop sets each group's rate to ``lr_mult`` x the schedule's rate
for ``train.lr``; Muon's group has ``lr_mult = muon_lr / lr``, so both rates follow the same warmup and decay.
The two optimizers travel together as one :class:`Combined` whose state dict is ``{"adamw": ..., "muon": ...}``;
checkpoints store it like any optimizer's (nested tensors flattened into the safetensors file).
"""

from __future__ import annotations

import torch

from cemtool.config import TrainConfig
from cemtool.errors import ConfigError

OPTIMIZERS = ("adamw", "muon")


def param_groups(model: torch.nn.Module, tc: TrainConfig) -> list[dict]:
    """Named AdamW groups. Matrices of Linear layers decay; norms, biases, scalars and embeddings do not.
    A family may tag a parameter with ``p.opt_group = "name"`` and ``p.lr_mult = x`` (e.g. LIMe's routers), or
    ``p.lr_abs = x``: an absolute peak rate, on the schedule of train.lr."""
    emb_ids = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    groups: dict[str, dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        default = "decay" if (p.dim() >= 2 and id(p) not in emb_ids) else "no_decay"
        g = getattr(p, "opt_group", default)
        lr_mult = float(getattr(p, "lr_mult", 1.0))
        if hasattr(p, "lr_abs"):  # an absolute rate on train.lr's schedule: the multiplier that gives it at the peak
            if tc.lr <= 0:
                raise ConfigError(f"{name} has an absolute learning rate ({p.lr_abs:g}), which needs train.lr > 0 "
                                  f"to follow its schedule")
            lr_mult = float(p.lr_abs) / tc.lr
        wd = tc.weight_decay if g == "decay" else float(getattr(p, "weight_decay", 0.0))
        entry = groups.setdefault(g, {"name": g, "params": [], "param_names": [], "lr_mult": lr_mult,
                                      "weight_decay": wd})
        entry["params"].append(p)
        entry["param_names"].append(name)
    return list(groups.values())


def hidden_matrices(model: torch.nn.Module) -> set[int]:
    """ids of the parameters Muon trains: weights of the Linear layers inside the blocks (not the LM head, not
    tensors a family tagged for a group of their own)."""
    head = getattr(model, "head", None)
    out = set()
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and m is not head:
            w = m.weight
            if w.dim() == 2 and w.requires_grad and not hasattr(w, "opt_group"):
                out.add(id(w))
    if head is not None:
        out.discard(id(head.weight))  # a tied head is the token embedding
    return out


def split_muon(model: torch.nn.Module, groups: list[dict], tc: TrainConfig) -> tuple[list[dict], dict]:
    """Move the hidden matrices out of the AdamW ``groups`` into one Muon group."""
    if tc.lr <= 0:
        raise ConfigError("train.optimizer=muon needs train.lr > 0: Muon's rate follows the schedule of train.lr")
    hidden = hidden_matrices(model)
    if not hidden:
        raise ConfigError("train.optimizer=muon: this model has no Linear weights besides its head for Muon to train",
                          hint="use train.optimizer=adamw")
    muon = {"name": "muon", "params": [], "param_names": [], "lr_mult": tc.muon_lr / tc.lr,
            "weight_decay": tc.weight_decay}
    kept = []
    for g in groups:
        named = list(zip(g["param_names"], g["params"], strict=True))
        rest = [(n, p) for n, p in named if id(p) not in hidden]
        muon["param_names"] += [n for n, p in named if id(p) in hidden]
        muon["params"] += [p for _, p in named if id(p) in hidden]
        if rest:
            kept.append({**g, "param_names": [n for n, _ in rest], "params": [p for _, p in rest]})
    return kept, muon


class Combined:
    """Several torch optimizers stepped as one. ``param_groups`` lists all their groups; ``state_dict`` has torch's
    shape ({"state", "param_groups"}, parameters numbered on across the optimizers), each group tagged with the
    ``"optimizer"`` it belongs to, so checkpoints store and verify it like any optimizer's."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    @property
    def state(self) -> dict:
        """parameter -> its state (torch's ``Optimizer.state``), over all the optimizers."""
        return {p: st for opt in self.optimizers.values() for p, st in opt.state.items()}

    def step(self) -> None:
        for opt in self.optimizers.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        state, groups, offset = {}, [], 0
        for name, opt in self.optimizers.items():
            sd = opt.state_dict()  # parameters numbered 0..n-1 over its groups
            state.update({i + offset: s for i, s in sd["state"].items()})
            groups += [{**g, "optimizer": name, "params": [i + offset for i in g["params"]]}
                       for g in sd["param_groups"]]
            offset += sum(len(g["params"]) for g in sd["param_groups"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        groups = state_dict["param_groups"]
        tags = [g.get("optimizer") for g in groups]
        if set(tags) != set(self.optimizers):
            raise ValueError(f"the optimizer state is for {sorted(map(str, set(tags)))}, this run trains with "
                             f"{sorted(self.optimizers)}")
        for name, opt in self.optimizers.items():
            mine = [g for g in groups if g["optimizer"] == name]
            local = {i: k for k, i in enumerate(i for g in mine for i in g["params"])}  # its own numbering
            opt.load_state_dict({
                "state": {local[i]: s for i, s in state_dict["state"].items() if i in local},
                "param_groups": [{**{k: v for k, v in g.items() if k != "optimizer"},
                                  "params": [local[i] for i in g["params"]]} for g in mine]})


def kernel(tc: TrainConfig, device: torch.device) -> dict:
    """AdamW's ``fused``/``foreach`` arguments for ``train.optimizer_impl`` (auto: fused on CUDA, the per-parameter
    loop elsewhere). The three compute the same update up to float rounding (tests/e2e/test_fast_paths.py)."""
    impl = tc.optimizer_impl if tc.optimizer_impl != "auto" else ("fused" if device.type == "cuda" else "loop")
    return {"fused": impl == "fused", "foreach": impl == "foreach"}


def make_optimizer(model: torch.nn.Module, tc: TrainConfig, device: torch.device) -> torch.optim.AdamW | Combined:
    """AdamW over :func:`param_groups`, or (``train.optimizer=muon``) Muon for the hidden matrices + AdamW."""
    groups = param_groups(model, tc)
    muon = None
    if tc.optimizer == "muon":
        if not hasattr(torch.optim, "Muon"):  # added in torch 2.9
            raise ConfigError(f"train.optimizer=muon needs torch.optim.Muon (torch >= 2.9); this is torch "
                              f"{torch.__version__}", hint="upgrade torch, or use train.optimizer=adamw")
        groups, muon = split_muon(model, groups, tc)
    for g in groups:
        g["lr"] = tc.lr * g["lr_mult"]
    adamw = torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps, **kernel(tc, device))
    if muon is None:
        return adamw
    muon["lr"] = tc.muon_lr
    hidden = torch.optim.Muon([muon], lr=tc.muon_lr, weight_decay=tc.weight_decay, momentum=tc.muon_momentum,
                              nesterov=True)
    return Combined({"adamw": adamw, "muon": hidden})


__all__ = ["OPTIMIZERS", "Combined", "hidden_matrices", "kernel", "make_optimizer", "param_groups", "split_muon"]
