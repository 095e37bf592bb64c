#!/usr/bin/env bash
# The allreduce sweep on an emulated cluster (root): one network namespace per rank, links shaped
# to RATE, MPICH over TCP. Checks that the traffic crossed the links: the hosts' NICs must have
# sent at least what the dense baseline alone sends in the timed repetitions.
#
#   sudo tools/bench_emulated.sh RATE P OUT.json [sparcml_jax.bench allreduce options...]
#   e.g. sudo tools/bench_emulated.sh 1gbit 4 benchmarks/emulated_1gbit_P4.json --sizes 4194304 --densities 0.001 0.01
set -euo pipefail
RATE=${1:?usage: bench_emulated.sh RATE P OUT.json [bench options]}; P=${2:?P}; OUT=${3:?OUT.json}; shift 3
HERE=$(cd "$(dirname "$0")" && pwd); ROOT=$(dirname "$HERE"); VENV="$ROOT/.venv"
export PATH="$VENV/bin:$PATH"
"$HERE/nscluster.sh" up "$P" "$RATE" >/dev/null
before=$("$HERE/nscluster.sh" bytes)
# KEEP_HEAP, OVERSUBSCRIBED and SHORT_SLICE of the Makefile (why: there; the "hosts" share this
# machine's cores).
"$HERE/nscluster.sh" run -n "$P" -genv JAX_PLATFORMS cpu -genv MALLOC_MMAP_MAX_ 0 \
  -genv MALLOC_TRIM_THRESHOLD_ 4294967296 -genv MALLOC_TOP_PAD_ 67108864 \
  -genv MPIR_CVAR_POLLS_BEFORE_YIELD 1 -genv MPIR_CVAR_CH4_PROGRESS_THROTTLE 1 \
  -genv MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT 1 \
  -- "$VENV/bin/python" "$HERE/short_slice.py" 100 "$VENV/bin/python" -m sparcml_jax.bench allreduce \
  --network "$RATE" --json "$OUT" "$@"
sent=$(( $("$HERE/nscluster.sh" bytes) - before ))
"$VENV/bin/python" - "$OUT" "$sent" "$P" <<'PY'
import json, sys
rows, sent, nprocs = json.load(open(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3])
# One dense MPI_Allreduce of N floats: reduce-scatter + allgather, 2 (P - 1) / P * 4N bytes per rank.
dense = sum(2 * (nprocs - 1) * 4 * r["N"] for r in rows if r["algorithm"] == "dense mpi4jax")
print(f"link bytes: {sent / 1e6:.1f} MB sent by the hosts' NICs; the dense baseline's payload alone: "
      f"{dense / 1e6:.1f} MB per repetition")
if sent < dense:
    sys.exit("the traffic did not cross the emulated links (shared memory between namespaces?)")
PY
