# `make demo` runs the main job, `make test` runs the tests. Both set themselves up.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
# The CPU build of torch (a plain `torch` requirement would pull a multi-GB CUDA build).
TORCH_SPEC ?= torch==2.13.0

.PHONY: lint test test-slow docs test-torch-range test-torch-oldest test-torch-newest demo bench soak soak-exit peer peer-run peer-hf clean

$(VENV)/.torch:
	python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install $(TORCH_SPEC)
	touch $@

# pip only when the venv lacks what the extra asks for (tests/extra_installed.py: a fraction of a second,
# where pip takes ~45 s to re-check every installed package after any edit of pyproject.toml)
$(VENV)/.test: $(VENV)/.torch pyproject.toml
	$(PY) tests/extra_installed.py test || $(PIP) install -e '.[test]'
	touch $@

$(VENV)/.demo: $(VENV)/.torch pyproject.toml
	$(PIP) install -e '.[demo]'
	touch $@

# ruff: the linter's settings are in pyproject.toml (`ruff format` writes the layout it checks).
lint: $(VENV)/.test
	$(VENV)/bin/ruff check src tests bench examples docs/pictures
	$(VENV)/bin/ruff format --check src tests bench examples docs/pictures

test: lint
	$(PY) -m pytest -q

# The tests marked slow (inductor compiles and other long runs), left out of `make test`.
# Ray Train for tests/test_ray.py's slow runs (a few hundred MB; not in `make test`)
$(VENV)/.ray: $(VENV)/.test
	$(PIP) install -e '.[ray]'
	touch $@

test-slow: $(VENV)/.test $(VENV)/.ray
	$(PY) -m pytest -q -m slow

# The torch range hasten is tested on: the oldest release it supports (FSDP needs 2.11, see
# hasten/strategies/fsdp.py's MIN_TORCH; pyproject.toml's lower bound) and the newest. Each gets a
# venv of its own, .venv-torch-VERSION, with the test extra and PyPI's build of that torch (a CUDA
# build, several GB with its nvidia-* wheels, which runs on the CPU here); PIP_CONSTRAINT=/dev/null
# lifts a machine-wide cap on torch, if pip has one. The fast subset below covers FSDP2, DCP checkpoints
# (sync and async), pipelining, TP/CP and the parallelize pipeline, sequence and expert parallelism,
# fp8 (torchao), torch.compile, the launcher, grad scalers and the errors page; TORCH_RANGE_TESTS=tests
# runs the whole suite.
TORCH_OLDEST ?= 2.11.0
TORCH_NEWEST ?= 2.15.0
TORCH_RANGE_TESTS ?= tests/test_import.py tests/test_fsdp.py tests/test_fsdp_plugin.py tests/test_fsdp_fits.py \
	tests/test_checkpoint.py tests/test_checkpoint_async.py tests/test_accelerate_checkpoint.py \
	tests/test_pipeline.py tests/test_pipeline_split.py tests/test_launch_pipeline.py \
	tests/test_parallelism.py tests/test_parallelize.py tests/test_fp8.py tests/test_fp8_handlers.py \
	tests/test_fp8_distributed.py tests/test_compile.py tests/test_cli.py tests/test_elastic.py \
	tests/test_utils_round4_models.py tests/test_bad_input.py tests/test_sequence_parallel.py \
	tests/test_expert_parallel.py tests/test_tp_replicated.py
TORCH_RANGE_PYTEST ?= -q

.venv-torch-%/.test: pyproject.toml
	test -x .venv-torch-$*/bin/python || python3 -m venv .venv-torch-$*
	PIP_CONSTRAINT=/dev/null .venv-torch-$*/bin/python -m pip --disable-pip-version-check -q install -e '.[test]' 'torch==$*'
	.venv-torch-$*/bin/python -c "import torch, torchao, transformers; print('torch', torch.__version__, '| torchao', torchao.__version__, '| transformers', transformers.__version__)"
	touch $@

# (kept: make would delete a pattern rule's stamp it made on the way, and reinstall each time)
.PRECIOUS: .venv-torch-%/.test

test-torch-%: .venv-torch-%/.test
	.venv-torch-$*/bin/python -m pytest $(TORCH_RANGE_PYTEST) $(TORCH_RANGE_TESTS)

test-torch-oldest: test-torch-$(TORCH_OLDEST)
test-torch-newest: test-torch-$(TORCH_NEWEST)

# Both ends, the second run even when the first fails (make -k), make's status failing if either did.
test-torch-range:
	$(MAKE) --no-print-directory -k test-torch-$(TORCH_OLDEST) test-torch-$(TORCH_NEWEST)

# The docs site (MkDocs + Material + mkdocstrings) in strict mode: a broken link, anchor or reference
# fails. The API and CLI reference pages are generated first (tests/gen_docs_reference.py).
$(VENV)/.docs: $(VENV)/.torch pyproject.toml
	$(PY) tests/extra_installed.py docs || $(PIP) install -e '.[docs]'
	touch $@

docs: $(VENV)/.docs
	$(PY) docs/pictures/make_pictures.py
	$(PY) tests/gen_docs_reference.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
	@echo "the site is in build/site/ (browse it live: $(VENV)/bin/mkdocs serve)"

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

# hasten under transformers' own Trainer tests (tests/trainer/ at the installed transformers' tag, cloned
# from GitHub into a temporary folder; PEER_HF_TESTS=/path/to/transformers/tests/trainer takes a local copy
# instead), through hasten.install_as_accelerate(), beside the same tests on the real Accelerate: writes
# its section of bench/PEER.md (10-20 minutes on 2 busy cores; not part of `make test`). The test venv has
# transformers, trl, peft and the pinned Accelerate.
PEER_HF_TESTS ?=
peer-hf: $(VENV)/.test
	$(PY) bench/peer_hf.py $(if $(PEER_HF_TESTS),--tests $(PEER_HF_TESTS)) $(if $(PEER_HF_NOTE),--tests-note "$(PEER_HF_NOTE)")

# Clean exits: the smallest two-process job run 200 times (forked, 3 at once) and 20 times through
# `hasten launch`, none may abort (SIGABRT at exit), fail or hang; `make test` runs 10 forked.
soak-exit: $(VENV)/.test
	$(PY) -m pytest -q -m slow tests/test_exit.py

clean:
	rm -rf $(VENV) $(PEER_VENV) .venv-torch-*/ build src/*.egg-info .pytest_cache
