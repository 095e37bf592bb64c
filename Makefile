# Two commands on a fresh machine:  `make demo` (set up + main job)  and  `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
VENV_ABS := $(abspath $(VENV))
STAMP := $(VENV)/.deps-installed
NP ?= 4

.PHONY: install build demo test bench clean

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

# The main job: the URL-like logistic regression, sparse beside dense, on $(NP) ranks.
demo: build
	$(VENV)/bin/mpirun -n $(NP) $(PY) examples/url_logreg.py

test: build
	JAX_PLATFORMS=cpu $(PY) -m pytest -q tests

clean:
	rm -rf build $(VENV)
