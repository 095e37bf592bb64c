# Two commands on a fresh machine:  `make demo` (set up + main job)  and  `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
VENV_ABS := $(abspath $(VENV))
STAMP := $(VENV)/.deps-installed
NP ?= 4

.PHONY: install build demo test test-environment bench clean

# mpi4jax builds from source. Its CUDA probe trips over the /usr/local/bin/nvcc shim on these
# machines unless CUDA_PATH names the toolkit root, and it must compile with the venv's mpicc.
$(STAMP): requirements/base.txt requirements/dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements/dev.txt
	CUDA_PATH=$${CUDA_PATH:-/usr/local/cuda} MPI4JAX_BUILD_MPICC=$(VENV_ABS)/bin/mpicc PATH=$(VENV_ABS)/bin:$$PATH \
	  $(PY) -m pip install -q mpi4jax==0.9.1.post2
	touch $@

install: $(STAMP)

# Always re-run: an incremental no-op build takes about two seconds.
build: install
	PATH=$(VENV_ABS)/bin:$$PATH $(PY) -m pip install -q --no-build-isolation --no-deps -e .

# MPICH busy-polls; with more ranks than cores these make waiting ranks yield the CPU.
OVERSUBSCRIBED := MPIR_CVAR_POLLS_BEFORE_YIELD=1 MPIR_CVAR_CH4_PROGRESS_THROTTLE=1 \
	MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT=1

# XLA:CPU allocates each run's buffers afresh, and glibc returns them to the kernel on free, so
# every step page-faults its 16 MB buffers back in (measured: half the demo's step time). glibc
# would serve such blocks with mmap (MMAP_MAX), trim the main heap (TRIM_THRESHOLD) and delete a
# worker thread's heap once it is empty (TOP_PAD: 2.36 keeps a heap whose free space is below it).
# These keep freed memory in the heap instead, for both runs alike. A block over 64 MB that an
# XLA worker thread allocates is still mapped afresh every call (a thread's heaps hold 64 MB at
# most); MALLOC_ARENA_MAX=1 would keep it too, but slows the dense baseline (BENCHMARKS.md).
KEEP_HEAP := MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=67108864

# With more ranks than cores, waiting ranks spin in sched_yield while a rank with work waits out
# whole scheduler slices (1.4 ms by default): whole cells of the P = 4 sweep ran 2-4 slices slow.
# The bench's ranks run with a 100 us slice (Linux 6.12+, tools/short_slice.py, BENCHMARKS.md).
SHORT_SLICE := $(PY) tools/short_slice.py 100

# The main job: the URL-like logistic regression, sparse beside dense, on $(NP) ranks.
demo: build
	JAX_PLATFORMS=cpu $(OVERSUBSCRIBED) $(KEEP_HEAP) $(VENV)/bin/mpirun -n $(NP) $(PY) examples/url_logreg.py

bench: build
	JAX_PLATFORMS=cpu $(KEEP_HEAP) $(PY) -m sparcml_jax.bench kernels --json benchmarks/kernels.json
	for p in 2 4; do JAX_PLATFORMS=cpu $(OVERSUBSCRIBED) $(KEEP_HEAP) $(VENV)/bin/mpirun -n $$p $(SHORT_SLICE) $(PY) -m sparcml_jax.bench \
	  allreduce --sweep full --reps 5 --json benchmarks/full_P$$p.json || exit 1; done
	for p in 2 4; do JAX_PLATFORMS=cpu $(OVERSUBSCRIBED) $(KEEP_HEAP) $(VENV)/bin/mpirun -n $$p $(SHORT_SLICE) $(PY) -m sparcml_jax.bench \
	  allreduce --sweep issue --reps 7 --calls-per-sample 10 --json benchmarks/in_program_P$$p.json || exit 1; done
	for p in 2 4; do JAX_PLATFORMS=cpu $(OVERSUBSCRIBED) $(KEEP_HEAP) $(VENV)/bin/mpirun -n $$p $(SHORT_SLICE) $(PY) -m sparcml_jax.bench \
	  latency --json benchmarks/latency_P$$p.json || exit 1; done
	$(PY) -m sparcml_jax.bench report benchmarks/full_P2.json benchmarks/full_P4.json benchmarks/in_program_P2.json \
	  benchmarks/in_program_P4.json $(wildcard benchmarks/emulated_*.json) --out benchmarks

# The slowest tests are listed at the end: CI must stay well under 30 minutes on 2 cores, and
# the rank suites under mpirun are most of it.
test: build
	JAX_PLATFORMS=cpu $(PY) -m pytest -q --durations=12 tests

# Checks of this machine rather than of the code: the kernel's scheduler slices, XLA's byte counts.
test-environment: build
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -m environment tests

clean:
	rm -rf build $(VENV)
