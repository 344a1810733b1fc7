# `make demo` runs the main job, `make test` runs the tests. Both set themselves up.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
# The CPU build of torch (a plain `torch` requirement would pull a multi-GB CUDA build).
TORCH_SPEC ?= torch==2.13.0

.PHONY: lint test test-slow demo bench soak soak-exit peer peer-run clean

$(VENV)/.torch:
	python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install $(TORCH_SPEC)
	touch $@

$(VENV)/.test: $(VENV)/.torch pyproject.toml
	$(PIP) install -e '.[test]'
	touch $@

$(VENV)/.demo: $(VENV)/.torch pyproject.toml
	$(PIP) install -e '.[demo]'
	touch $@

# ruff: the linter's settings are in pyproject.toml (`ruff format` writes the layout it checks).
lint: $(VENV)/.test
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/ruff format --check src tests bench examples

test: lint
	$(PY) -m pytest -q

# The tests marked slow (inductor compiles and other long runs), left out of `make test`.
test-slow: $(VENV)/.test
	$(PY) -m pytest -q -m slow

demo: $(VENV)/.demo
	$(VENV)/bin/hasten demo

# Accelerate and Lightning Fabric for the side-by-side columns; the torch spec is passed along
# so that pip keeps the installed torch (it fails rather than swap it for another build).
$(VENV)/.bench: $(VENV)/.torch pyproject.toml
	$(PIP) install -e '.[bench]' '$(TORCH_SPEC)'
	$(PY) -c "import torch, accelerate, lightning; print('bench: torch', torch.__version__, '| accelerate', accelerate.__version__, '| lightning', lightning.__version__)"
	touch $@

# Writes bench/RESULTS.md: rows 1-11 (7-9 compile with inductor and train a ~50M-parameter model; 10-11
# lose a node and checkpoint the ~50M model) took 15 minutes on 2 quiet cores on 2026-12-03, longer under
# load; `$(PY) bench/run.py --quick` is a smoke run.
bench: $(VENV)/.bench
	$(PY) bench/run.py

# Long-run health: 2,000 steps of the tiny benchmark model through `hasten launch` on 2 processes
# (flat memory, no fd/thread growth, nothing left behind); `make test` runs the same with 600.
soak: $(VENV)/.test
	SOAK_STEPS=2000 $(PY) -m pytest -q tests/test_soak.py

# hasten as a drop-in, measured on Accelerate's own tests: downloads the pinned Accelerate sdist
# into a temporary folder, swaps its imports to hasten, runs its CPU tests and scripts on both
# (Accelerate's own dependencies come with the bench extra) and writes bench/PEER.md
# (10-20 minutes on 2 busy cores; not part of `make test`). It has a venv of its own (PEER_VENV,
# or VENV when given on the command line): the trackers' packages installed there for Accelerate's
# tracker tests (which skip a tracker whose package is absent) pin older protobuf, pillow, filelock
# and python-dateutil than the test venv has.
PEER_VENV ?= $(if $(filter command line,$(origin VENV)),$(VENV),.venv-peer)
peer:
	$(MAKE) --no-print-directory peer-run VENV=$(PEER_VENV)

$(VENV)/.peer: $(VENV)/.bench
	$(PIP) install -e '.[mlflow,comet-ml,clearml,dvclive,swanlab,trackio,aim]' 'pandas' '$(TORCH_SPEC)'
	touch $@

peer-run: $(VENV)/.test $(VENV)/.bench $(VENV)/.peer
	$(PY) bench/peer.py

# Clean exits: the smallest two-process job run 200 times (forked, 3 at once) and 20 times through
# `hasten launch`, none may abort (SIGABRT at exit), fail or hang; `make test` runs 10 forked.
soak-exit: $(VENV)/.test
	$(PY) -m pytest -q -m slow tests/test_exit.py

clean:
	rm -rf $(VENV) $(PEER_VENV) build src/*.egg-info .pytest_cache
