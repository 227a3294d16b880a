"""'K processes give the numbers of 1', simulated in one process: K = 1, 2, 3 ranks as threads, each with its own
rank, whose all_reduce_sum is a real sum over the K threads. The shards of n items cover [0, n) disjointly and in
rank order, and the evaluation loss and gradient of the curvature engine
(cemtool.analysis.curvature.risk.EmpiricalRisk) summed over the ranks' shards are the whole set's. The real
2-process runs are tests/e2e/test_distributed.py (analyses) and
tests/e2e/test_train.py::test_ddp_two_processes_match_one (training)."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cemtool import distributed
from cemtool.analysis.curvature import operators, risk
from cemtool.analysis.curvature.operators import Hessian
from cemtool.distributed import Dist

from kit import tiny_model, tiny_tokens

V, T = 16, 8


class Ranks:
    """K ranks of one process: ``run(fn)`` calls ``fn`` in K threads; inside them distributed.current() is the
    thread's Dist(rank, K) and all_reduce_sum adds the K threads' tensors (in rank order) into each of them."""

    def __init__(self, k: int):
        self.k, self.local, self.barrier = k, threading.local(), threading.Barrier(k, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * k

    def current(self) -> Dist:
        return Dist(self.local.rank, self.k)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        self.slots[self.local.rank] = t.clone()
        self.barrier.wait()
        total = sum(self.slots[1:], self.slots[0].clone())
        self.barrier.wait()  # every rank has read the slots before any writes the next collective's
        return t.copy_(total)

    def run(self, fn) -> list:
        out: list = [None] * self.k
        errors: list[BaseException] = []

        def rank(r: int) -> None:
            self.local.rank = r
            try:
                out[r] = fn()
            except BaseException as e:  # re-raised in the caller's thread
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(self.k)]
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(distributed, "current", self.current)
            for module in (risk, operators):  # the risk's sums and the operators' products
                mp.setattr(module, "all_reduce_sum", self.all_reduce_sum)
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if errors:
            raise errors[0]
        return out


@settings(max_examples=60, deadline=None)
@given(k=st.integers(1, 3), extra=st.integers(0, 40))
def test_shards_cover_every_item_once_in_rank_order(k, extra):
    n = k + extra  # every n >= K
    shards = Ranks(k).run(lambda: distributed.shard(n))
    assert [i for s in shards for i in s] == list(range(n))
    assert all(len(s) >= 1 for s in shards) and max(map(len, shards)) - min(map(len, shards)) <= 1


def test_fewer_items_than_ranks_is_refused():
    with pytest.raises(Exception, match="3 processes but only 2 evaluation sequences"):
        Ranks(3).run(lambda: distributed.shard(2))


@settings(max_examples=10, deadline=None)
@given(k=st.integers(1, 3), n=st.integers(3, 7), batch=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_loss_and_gradient_over_k_ranks_are_the_whole_sets(k, n, batch, seed):
    """Hessian's mean token loss and its gradient, each rank on its shard of the n sequences (in batches of
    ``batch``), summed over the ranks: the one-process numbers to float64 rounding."""
    model = tiny_model("baseline", n_layer=1, mlp_hidden=16, vocab=V, seq_len=T)
    x, y = tiny_tokens(n, T, V, seed)

    def measure():
        obj = Hessian(model, x, y, dtype="fp64", batch_size=batch)
        loss, grad = obj.gradient()
        return obj.loss(), loss, grad

    [(whole, whole_again, whole_grad)] = Ranks(1).run(measure)
    assert whole == pytest.approx(whole_again, rel=1e-14)
    for loss, loss_g, grad in Ranks(k).run(measure):  # every rank holds the sums
        assert loss == pytest.approx(whole, rel=1e-12) and loss_g == pytest.approx(whole, rel=1e-12)
        assert torch.allclose(grad, whole_grad, rtol=1e-10, atol=1e-13)
