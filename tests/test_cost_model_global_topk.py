"""The cost model prices the global top-k definitions (SparDL, gTop-k, Ok-Topk) by running them on
:class:`Pricing`: the bytes it prices are the bytes the simulated transport counts for the same
definition, the latency and bandwidth terms follow each algorithm's formula in P and k, the
result stays at about k entries whatever P is, and the local selections over the dense input
are priced. SparCML's prices (and so ``auto``) do not depend on the new selection term."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from sparcml_jax import ALGORITHMS, CostModel
from sparcml_jax.collectives._plan import GLOBAL_TOPK_ALGORITHMS, definition
from sparcml_jax.comm.simulated import SimStream, Simulated
from sparcml_jax.comm.topology import selection_budgets

PRICED = GLOBAL_TOPK_ALGORITHMS
SIMULATED = tuple(a for a in GLOBAL_TOPK_ALGORITHMS if a in ("spardl", "gtopk"))  # no run-time thresholds
COMPUTE = dict(pair_cost=1e-9, element_cost=3e-10, select_cost=5e-10)
MODEL = CostModel(alpha=2e-6, beta=1e-10, dense_alpha=5e-6, dense_beta=3e-10, **COMPUTE)


def wire_only(alpha: float = 0.0, beta: float = 0.0) -> CostModel:
    """Messages only: ``latency(P) == alpha`` (no dense term), no local work."""
    return CostModel(alpha=alpha, beta=beta)


def simulated_sent(algorithm: str, p: int, n: int, k: int, wire: str) -> list[float]:
    rng = np.random.default_rng([p, n, k])
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]
    t = Simulated(p, n, wire=wire)
    definition(algorithm)(t, [SimStream(n, n, None, x) for x in xs], k=k)
    return t.sent


@pytest.mark.parametrize("algorithm", SIMULATED)
@pytest.mark.parametrize("transport", ("native", "mpi4jax"))
@pytest.mark.parametrize("p", (2, 3, 4, 5, 8))
def test_priced_bytes_are_the_simulated_bytes(algorithm, transport, p):
    """Rank 0's bytes, for dense random accumulators (every selection full) and N % P != 0."""
    for n, k in ((1000, 10), (4099, 41), (4099, 400)):
        priced = MODEL.pricing(algorithm, size=n, nnz=k, nprocs=p, transport=transport).sent
        assert priced == simulated_sent(algorithm, p, n, k, transport)[0], (n, k)


@pytest.mark.parametrize("p", (2, 3, 4, 5, 8, 16, 33, 64))
def test_spardl_sends_p_minus_1_blocks_of_kb_pairs_twice(p):
    """Spar-Reduce-Scatter: P - 1 blocks of kb = k / P pairs; the allgather of the owned blocks
    sends this rank's kb pairs to the P - 1 others."""
    n = 64 * 1024  # divisible by every P here but 3, 5 and 33
    for k in (640, 6400):
        kb = selection_budgets(k, n, p)
        model = wire_only(beta=1.0)  # seconds are the bytes
        t = model.pricing("spardl", size=n, nnz=k, nprocs=p)
        srs = 8 * sum(kb[q] for q in range(1, p))  # rank 0 sends each of the other ranks' blocks once
        assert t.sent == srs + (p - 1) * 8 * kb[0]
        if n % p == 0:
            assert t.sent == 2 * (p - 1) * 8 * math.ceil(k / p)
        # The wire carries what rank 0 sends in the SRS and receives in the allgather, as a Bruck
        # allgather of the P kb-pair parts prices it ((P - 1) parts).
        assert t.seconds == pytest.approx(srs + 8 * (p - 1) * kb[0])


@pytest.mark.parametrize("p", (2, 3, 4, 8, 16, 64, 1024))
def test_gtopk_takes_2_ceil_log2_p_rounds_of_k_pairs(p):
    n, k, alpha, beta = 1 << 20, 10_000, 1e-5, 1e-9
    rounds = 2 * math.ceil(math.log2(p))
    latency = wire_only(alpha=alpha).pricing("gtopk", size=n, nnz=k, nprocs=p)
    assert latency.messages == rounds
    assert latency.seconds == pytest.approx(rounds * alpha)
    bandwidth = wire_only(beta=beta).pricing("gtopk", size=n, nnz=k, nprocs=p)
    assert bandwidth.seconds == pytest.approx(rounds * 8 * k * beta)  # k pairs per round, either way
    assert bandwidth.sent == rounds // 2 * 8 * k  # rank 0 sends only down the tree


@pytest.mark.parametrize("p", (2, 4, 8, 64, 1024))
def test_spardl_latency_is_one_message_per_block_and_the_allgathers_rounds(p):
    t = wire_only(alpha=1.0).pricing("spardl", size=1 << 20, nnz=10_000, nprocs=p)
    assert t.seconds == pytest.approx(p - 1 + math.log2(p))


@pytest.mark.skipif("oktopk" not in GLOBAL_TOPK_ALGORITHMS, reason="no Ok-Topk")
@pytest.mark.parametrize("p", (2, 4, 8, 64, 1024))
def test_oktopk_hands_over_p_minus_1_regions_and_gathers_its_own(p):
    """A step between re-evaluations: the carried thresholds select about k in all, k / P in
    each region, by scans (no radix selection)."""
    n, k = 1 << 20, 10_240
    model = wire_only(alpha=1.0, beta=1.0)
    t = model.pricing("oktopk", size=n, nnz=k, nprocs=p)
    assert t.sent == pytest.approx(2 * (p - 1) * 8 * k / p)
    assert t.messages == p - 1 + math.log2(p)
    assert t.result_entries == pytest.approx(k)
    slower = dataclasses.replace(MODEL, select_cost=10 * MODEL.select_cost)
    assert slower.predict("oktopk", size=n, nnz=k, nprocs=p) == MODEL.predict("oktopk", size=n, nnz=k, nprocs=p)


def test_prices_grow_in_p_and_k_as_the_formulas_say():
    """Bandwidth: gTop-k 16 k log2 P bytes, SparDL 16 (P - 1) k / P, so gTop-k's grows with
    log P and SparDL's stays below 16 k; both double with k."""
    n, beta = 1 << 24, 1e-9
    model = wire_only(beta=beta)
    for k in (1 << 14, 1 << 16):
        gtopk = [model.predict("gtopk", size=n, nnz=k, nprocs=1 << j) for j in range(1, 11)]
        spardl = [model.predict("spardl", size=n, nnz=k, nprocs=1 << j) for j in range(1, 11)]
        assert gtopk == pytest.approx([16 * k * j * beta for j in range(1, 11)])
        assert spardl == pytest.approx([16 * ((1 << j) - 1) * math.ceil(k / (1 << j)) * beta for j in range(1, 11)])
        assert all(a < b for a, b in zip(spardl, spardl[1:]))
        assert spardl[-1] < 16 * (k + 1024) * beta
    for algorithm in PRICED:
        small, large = (model.predict(algorithm, size=n, nnz=k, nprocs=64) for k in (1 << 14, 1 << 16))
        assert large == pytest.approx(4 * small, rel=0.01)


@pytest.mark.parametrize("algorithm", PRICED)
def test_the_result_stays_at_about_k_entries_whatever_p(algorithm):
    """Not the union bound, which turns dense: 1 % of N from 1024 ranks covers 99.997 % of N."""
    n, k = 1 << 24, (1 << 24) // 100
    for p in (2, 16, 1024):
        entries = MODEL.pricing(algorithm, size=n, nnz=k, nprocs=p).result_entries
        assert k <= entries <= k + p, (p, entries)
    union = MODEL.pricing("ssar_split_allgather", size=n, nnz=k, nprocs=1024).result_entries
    assert union > 0.99 * n


@pytest.mark.parametrize("algorithm", PRICED)
def test_the_local_selection_over_the_dense_input_is_priced(algorithm):
    """At P = 1 there is no message, but the selection over N and the passes over the dense
    input and residual remain; they grow with N and with the selection's price per value."""
    k_of = lambda n: n // 100  # noqa: E731
    costs = [MODEL.predict(algorithm, size=n, nnz=k_of(n), nprocs=1) for n in (1 << 20, 1 << 22)]
    assert 0 < costs[0] and costs[1] == pytest.approx(4 * costs[0], rel=0.01)
    if algorithm == "oktopk":
        return  # its carried thresholds select by scans (see its own test)
    slower = dataclasses.replace(MODEL, select_cost=2 * MODEL.select_cost)
    for p in (1, 4):
        n = 1 << 22
        extra = slower.predict(algorithm, size=n, nnz=k_of(n), nprocs=p) - MODEL.predict(
            algorithm, size=n, nnz=k_of(n), nprocs=p)
        assert extra >= n * MODEL.select_cost * 0.99, (p, extra)  # every value is read at least once


def test_sparcml_prices_do_not_depend_on_the_selection_term():
    """auto chooses among SparCML's algorithms, which take streams already selected."""
    other = dataclasses.replace(MODEL, select_cost=1.0)
    for algorithm in ALGORITHMS:
        for p in (2, 4, 8):
            for transport in ("native", "mpi4jax"):
                args = dict(size=1 << 20, nnz=10_000, nprocs=p, transport=transport, capacity=10_000)
                assert other.predict(algorithm, **args) == MODEL.predict(algorithm, **args), (algorithm, p)


def test_the_selection_term_is_saved_and_an_older_file_loads(tmp_path):
    path = tmp_path / "model.json"
    MODEL.save(str(path))
    assert CostModel.load(str(path)) == MODEL
    fields = dataclasses.asdict(MODEL)
    del fields["select_cost"]
    path.write_text(json.dumps(fields))
    assert CostModel.load(str(path)).select_cost == 0.0
