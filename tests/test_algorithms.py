"""Every algorithm's one definition, run for P = 1..8 ranks at once on the simulated transport
(one process, numpy) and priced by the cost model: exact sums, identical results on every rank,
SparCML's dense switch, and the wire volumes of its closed forms. The real transports run the
same definitions under mpirun (tests/mpi)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from sparcml_jax import ALGORITHMS, CostModel
from sparcml_jax.collectives._plan import Plan, Quantization, definition
from sparcml_jax.collectives.auto import best, choice_table
from sparcml_jax.comm.simulated import SimStream, Simulated
from sparcml_jax.comm.topology import part_bounds
from sparcml_jax.stream import dense_threshold

SIZES = (1, 3, 64, 1001)


def inputs(p: int, n: int, density: float, kind: str, seed: int) -> list[SimStream]:
    """Integer-valued streams (exact in float32 in any order), of capacity n."""
    k = min(n, max(0, math.ceil(density * n)))
    out = []
    for r in range(p):
        rng = np.random.default_rng([seed, r])
        if kind == "identical":
            idx = np.random.default_rng([seed, 99]).choice(n, k, replace=False)
        elif kind == "unequal":
            idx = rng.choice(n, k * r // max(p - 1, 1), replace=False)
        else:
            idx = rng.choice(n, k, replace=False)
        idx = np.sort(idx)
        val = (rng.integers(1, 10, idx.size) * rng.choice([-1, 1], idx.size)).astype(np.float32)
        s = SimStream.pairs(n, n, idx, val)
        out.append(SimStream(n, n, None, s.to_dense()) if idx.size == n else s)
    return out


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("p", range(1, 9))
def test_every_definition_sums_exactly_on_every_rank(algorithm, p):
    fn = definition(algorithm)
    for n in SIZES:
        for density in (0.0, 0.01, 0.1, 0.5, 1.0):
            for kind in ("random", "identical", "unequal"):
                ranks = inputs(p, n, density, kind, seed=n + p)
                want = np.sum([s.to_dense() for s in ranks], axis=0, dtype=np.float32)
                t = Simulated(p, n)
                out = fn(t, ranks)
                label = f"{algorithm} P={p} N={n} d={density} {kind}"
                assert len(out) == p, label
                for r, s in enumerate(out):
                    np.testing.assert_array_equal(s.to_dense(), want, err_msg=f"{label} rank {r}")
                    assert s.count <= s.capacity or s.dense, label
                    if s.dense:
                        assert s.capacity >= n, label
                    else:
                        assert np.all(np.diff(s.idx) > 0), label
                assert all(o.dense == out[0].dense and o.count == out[0].count for o in out), label
                if p == 1:
                    assert t.sent == [0.0], label


def test_the_dense_switch_follows_the_actual_count():
    """Disjoint supports whose union crosses the threshold only when summed: dense after the sum."""
    n, p = 64, 4
    per_rank = dense_threshold(n) // p + 1
    ranks = [SimStream.pairs(n, n, np.arange(r * per_rank, (r + 1) * per_rank), np.ones(per_rank)) for r in range(p)]
    for algorithm in ("ssar_recursive_doubling", "ssar_split_allgather", "sparse_ring"):
        out = definition(algorithm)(Simulated(p, n), ranks)
        assert out[0].dense, algorithm
        few = [SimStream.pairs(n, n, [r], [1.0]) for r in range(p)]
        assert not definition(algorithm)(Simulated(p, n), few)[0].dense, algorithm


@pytest.mark.parametrize("p", (2, 4, 8))
def test_recursive_doubling_volumes_are_the_closed_forms(p):
    """SparCML §5.2: identical supports cost 8 k log2 P bytes per rank, disjoint ones 8 k (P - 1)."""
    n, k = 4096, 16
    fn = definition("ssar_recursive_doubling")
    same = [SimStream.pairs(n, k, np.arange(k) * 7, np.ones(k)) for _ in range(p)]
    t = Simulated(p, n)
    fn(t, same)
    assert t.sent == [8.0 * k * math.log2(p)] * p
    disjoint = [SimStream.pairs(n, k, np.arange(k) * p + r, np.ones(k)) for r in range(p)]
    t = Simulated(p, n)
    fn(t, disjoint)
    assert t.sent == [8.0 * k * (p - 1)] * p


@pytest.mark.parametrize("p", (2, 3, 4, 8))
def test_ring_and_dsar_send_a_dense_ring_volume_on_dense_inputs(p):
    """On dense inputs the ring sends 2 (P - 1) segments of N / P values per rank, like a dense
    ring allreduce, and DSAR (P - 1)/P (N + N) values: both 2 (P - 1) / P * 4 N bytes."""
    n = 1024 * p
    dense = [SimStream(n, n, None, np.ones(n, np.float32)) for _ in range(p)]
    for algorithm in ("sparse_ring", "dsar_split_allgather"):
        t = Simulated(p, n)
        definition(algorithm)(t, dense)
        assert t.sent == [2 * (p - 1) / p * 4 * n] * p, algorithm


@pytest.mark.parametrize("p", (2, 3, 4, 7))
@pytest.mark.parametrize("bits", (2, 4, 8))
def test_quantized_dsar_sends_codes_in_both_phases(p, bits):
    """Dense data: every split-phase segment and every allgathered slice travels as b-bit codes
    plus one float32 scale per bucket, about b/32 of float32 DSAR (which sends what a dense
    allreduce does)."""
    n, bucket = 1001, 100
    t = Simulated(p, n)
    definition("dsar_split_allgather")(t, inputs(p, n, 1.0, "random", 0), quantize=Quantization(bits, bucket))
    lengths = [part_bounds(n, p, r)[1] - part_bounds(n, p, r)[0] for r in range(p)]
    codes = lambda m: math.ceil(m * bits / 8) + 4 * math.ceil(m / bucket)  # noqa: E731
    for r in range(p):  # native: each segment at its range's length, each slice padded to the longest
        assert t.sent[r] == sum(codes(lengths[o]) for o in range(p) if o != r) + (p - 1) * codes(max(lengths))
    plain = Simulated(p, n)
    definition("dsar_split_allgather")(plain, inputs(p, n, 1.0, "random", 0))
    assert all(q < f * (bits / 32 + 4 / bucket / 4 + 0.01) for q, f in zip(t.sent, plain.sent))


def test_quantized_dsar_keeps_sparse_segments_exact():
    """1 % density: the split phase's segments stay pairs (their bytes are the float32 run's);
    only the dense allgather phase is coded."""
    n, p, bucket = 1000, 4, 100
    coded, plain = Simulated(p, n), Simulated(p, n)
    definition("dsar_split_allgather")(coded, inputs(p, n, 0.01, "random", 0), quantize=Quantization(4, bucket))
    definition("dsar_split_allgather")(plain, inputs(p, n, 0.01, "random", 0))
    slice_bytes = (p - 1) * (4 * 250 - math.ceil(250 * 4 / 8) - 4 * math.ceil(250 / bucket))
    assert [f - q for q, f in zip(coded.sent, plain.sent)] == [slice_bytes] * p


MODEL = CostModel(alpha=2e-6, beta=1e-10, dense_alpha=4e-6, dense_beta=3e-10, pair_cost=1e-9, element_cost=3e-10)


@pytest.mark.parametrize("transport", ("native", "mpi4jax"))
def test_the_model_prices_every_definition(transport):
    """Positive, finite, growing with the data; nothing for one process."""
    n = 1 << 22
    for algorithm in ALGORITHMS:
        for p in (2, 3, 4, 8):
            costs = [MODEL.predict(algorithm, size=n, nnz=d * n, nprocs=p, transport=transport,
                                   capacity=max(1, int(d * n))) for d in (1e-4, 1e-2, 0.5)]
            assert all(math.isfinite(c) and c > 0 for c in costs), (algorithm, p, costs)
            if algorithm != "dense":
                assert costs[0] < costs[2], (algorithm, p, costs)
        assert MODEL.predict(algorithm, size=n, nnz=100, nprocs=1, transport=transport) == 0.0


def test_the_model_matches_the_paper_on_a_network():
    """Latency-bound small streams prefer recursive doubling, large dense ones the dense
    allreduce or DSAR, whose bandwidth is never worse than dense (SparCML §5.3.3)."""
    n, p = 1 << 22, 8
    small = {a: MODEL.predict(a, size=n, nnz=64, nprocs=p, capacity=64) for a in ALGORITHMS}
    assert min(small, key=small.get) == "ssar_recursive_doubling"
    # 1 Gbit, where only the wire counts: a ring allreduce sends 2 (P - 1) / P bytes per byte of the vector.
    wire = CostModel(alpha=5e-5, beta=8e-9, dense_alpha=2e-4, dense_beta=2 * (p - 1) / p * 8e-9)
    dense = {a: wire.predict(a, size=n, nnz=n, nprocs=p) for a in ("dense", "dsar_split_allgather", "sparse_ring")}
    assert dense["dsar_split_allgather"] <= 1.1 * dense["dense"]
    assert dense["sparse_ring"] <= 1.1 * dense["dense"]


def test_quantized_auto_never_takes_the_float32_dense_allreduce():
    """A caller who asks for b bits gets them wherever the data goes dense: with quantize_bits,
    auto takes quantized DSAR, not MPI_Allreduce or the ring (float32 once they fill), even where
    the model finds those cheaper."""
    model = CostModel(alpha=1e-3, beta=1e-12, dense_alpha=1e-9, dense_beta=1e-15)  # a dense allreduce for free
    n = 1 << 16
    plain = Plan(None, "native", 1.0, axis_name="data", axis_size=4)  # four ranks, priced as the native engine
    coded = dataclasses.replace(plain, quantize=Quantization(4))
    failures = []
    if best(model, plain, n, n, n) != "dense":
        failures.append(f"without QSGD the model should take the dense allreduce, took {best(model, plain, n, n, n)}")
    for nnz in (n // 1000, n // 10, n):
        if best(model, coded, n, n, nnz) in ("dense", "sparse_ring"):
            failures.append(f"auto with quantize_bits took {best(model, coded, n, n, nnz)} at nnz={nnz}")
    rows = choice_table(model, coded, n, n)
    if any(name in ("dense", "sparse_ring") for _, name in rows):
        failures.append(f"auto with quantize_bits has the dense allreduce among its run-time choices: {rows}")
    assert not failures, failures


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_model_prices_bfloat16_values(algorithm):
    """value_bits=16: 6 bytes per pair and 2 per dense entry, as the simulated wire counts them;
    the dense allreduce as DSAR's two phases."""
    n, p, k = 1 << 16, 4, 600
    bf16, f32 = (MODEL.pricing(algorithm, size=n, nnz=k, nprocs=p, capacity=n, value_bits=b) for b in (16, 32))
    if algorithm == "dense":
        assert bf16.sent == pytest.approx(MODEL.pricing("dsar_split_allgather", size=n, nnz=k, nprocs=p, capacity=n,
                                                        value_bits=16).sent)
    else:
        assert 0.5 * f32.sent <= bf16.sent <= 0.75 * f32.sent + 1e-6, (bf16.sent, f32.sent)
