# `make test` is what CI runs (.ci/run): it creates the venv when missing, installs the project and runs pytest.
#
#   make test                      torch 2.13.0 in .venv (this machine's local CPU wheel)
#   make test TORCH=2.14.1         another torch build, in its own venv (.venv-torch2.14.1)
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu   PyTorch's CPU build, where that index is reachable
#
# torch is installed with one pip command against the configured indexes. On PyPI, Linux torch wheels are the
# CUDA builds (about 2.6 GB with their libraries; they run the CPU tests fine): say TORCH_INDEX to choose the
# CPU build instead. Nothing is retried against an index that cannot be reached.
PYTHON ?= python3
TORCH ?= 2.13.0
TORCH_INDEX ?=
# The local CPU build of torch 2.13.0 pairs with triton 3.8.0 (PyPI's torch builds bring their own triton).
TRITON_VERSION ?= 3.8.0
VENV ?= $(if $(filter command line environment,$(origin TORCH)),.venv-torch$(TORCH),.venv)
PY := $(VENV)/bin/python
PIP_QUIET := --quiet --disable-pip-version-check
# One Inductor cache and one TMPDIR for the whole run: the first CPU compile builds a precompiled header under
# $$TMPDIR (about 10 s) and probes the vector ISA once per cache dir (about 9 s).
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/.cache/inductor
export TMPDIR ?= $(CURDIR)/.cache/tmp
export TRITON_CACHE_DIR ?= $(CURDIR)/.cache/triton

.PHONY: test test-fast demo install sglang-deps gpu-test wheel clean

$(VENV)/.installed: pyproject.toml Makefile
	@mkdir -p $(TMPDIR)
	@test -x $(PY) || { echo "==> creating $(VENV) ($(PYTHON))"; $(PYTHON) -m venv $(VENV); }
	@$(PY) -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$(TORCH)')" 2>/dev/null \
		|| { echo "==> installing torch==$(TORCH) from $(if $(TORCH_INDEX),$(TORCH_INDEX),the configured indexes)"; \
		     $(PY) -m pip install $(PIP_QUIET) --retries 0 --timeout 30 torch==$(TORCH) \
		       $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX) --extra-index-url https://pypi.org/simple); }
	@$(PY) -c "import triton" 2>/dev/null \
		|| { echo "==> installing triton==$(TRITON_VERSION) (the CPU build of torch does not bring it)"; \
		     $(PY) -m pip install $(PIP_QUIET) triton==$(TRITON_VERSION); }
	@echo "==> installing torch-syncfree (editable) with its test and inspect extras"
	@$(PY) -m pip install $(PIP_QUIET) -e '.[test,inspect]'
	@$(PY) -c "import torch, triton, sys; print('==> ready: torch', torch.__version__, '| triton', triton.__version__, '| Python', sys.version.split()[0])"
	@touch $@

install: $(VENV)/.installed

# tests/sglang runs SGLang's own attention backends on CPU: SGLang 0.5.23 and the small packages it imports, each
# pinned, all --no-deps (nothing pulls torch or CUDA builds); the native kernels are CPU stand-ins in the tests.
SGLANG_REQUIREMENTS := tests/sglang/requirements.txt
$(VENV)/.sglang-installed: $(VENV)/.installed $(SGLANG_REQUIREMENTS)
	@echo "==> installing SGLang 0.5.23 and what its attention backends import, --no-deps ($(SGLANG_REQUIREMENTS))"
	@$(PY) -m pip install $(PIP_QUIET) --no-deps --no-compile -r $(SGLANG_REQUIREMENTS)
	@touch $@

sglang-deps: $(VENV)/.sglang-installed

# Two workers (CI has 2 cores), one file per worker at a time: a file's tests share module state (compiled paths,
# registered facts), and most of the time is single-threaded compiling.
PYTEST_WORKERS ?= 2
test: $(VENV)/.installed $(VENV)/.sglang-installed
	$(PY) -m pytest -q $(if $(filter-out 0 1,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile) tests

# The edit-test loop (not what CI runs): `make test` without its slow suites: every generated and soundness suite
# (tests/suites), SGLang's own backends (no sglang-deps needed), the realistic-bound relation suites (branch
# outcomes and their review: about 3 CPU-minutes of compiles at bounds up to 131072), the entry-point, outlining,
# hook-version and benchmark-helper tests (whole compiles through compile_pass.compile), full Inductor compiles
# (marker `inductor`), the CLI and tensor-parallel suites (a subprocess per test) and the Triton-interpreter
# reruns in subprocesses. What stays: the rules, the other relations, the tracing hooks, the pipeline, the kernels,
# the reports and options. Its time is in the README ("Quick start").
FAST_SKIP := --ignore=tests/suites --ignore=tests/sglang --ignore=tests/relations/test_branch_outcomes.py \
	--ignore=tests/relations/test_trace_time_breaks.py --ignore=tests/relations/test_trace_time_frames.py \
	--ignore=tests/relations/test_trace_signature_holes.py --ignore=tests/test_entry_points.py \
	--ignore=tests/test_outline_repeats.py --ignore=tests/test_hook_versions.py \
	--ignore=tests/test_benchmark_helpers.py --ignore=tests/test_cli.py --ignore=tests/test_tp.py \
	--ignore=tests/kernels/test_triton_interpreter.py -m "not inductor" -k "not under_the_interpreter"
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q $(if $(filter-out 0 1,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile) $(FAST_SKIP) tests

# Not what CI runs (CI: `make test` on torch 2.13, which holds these suites; this target downloads PyPI's CUDA builds
# of torch, about 3 GB a version): the trace-time hooks patch Dynamo's private classes, so their suites, SGLang's
# backends and the kernels under the Triton interpreter run on the lowest and highest supported torch as well, each
# in its own venv (`make install sglang-deps TORCH=X` when missing). README, "Supported versions", gives its time.
# Where pip's configuration caps torch (a constraints file), run it with PIP_CONFIG_FILE=/dev/null.
TEST_VERSIONS ?= 2.11.0 2.15.0
VERSION_SUITES := tests/test_hook_versions.py tests/test_compat.py tests/test_tracing.py tests/relations \
	tests/suites/test_trace_time_programs.py tests/suites/test_trace_time_constructs.py tests/sglang \
	tests/kernels/test_triton_interpreter.py
.PHONY: test-versions
test-versions:
	@for v in $(TEST_VERSIONS); do \
	  $(MAKE) --no-print-directory sglang-deps TORCH=$$v || exit 1; \
	  echo "==> torch $$v: hooks, trace-time suites, SGLang's backends, kernels under the interpreter"; \
	  .venv-torch$$v/bin/python -m pytest -q $(if $(filter-out 0 1,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile) \
	    $(VERSION_SUITES) || exit 1; \
	done

demo: $(VENV)/.installed
	$(VENV)/bin/syncfree-inspect --example decode --out syncfree-inspect-out

# On a CUDA machine: only the GPU-marked tests.
gpu-test: $(VENV)/.installed
	$(PY) -m pytest -q -m gpu tests

# dist/ travels to the GPU machine (benchmarks/run_h200.sh); dist/COMMIT names the commit the wheel holds.
wheel: $(VENV)/.installed
	rm -f dist/*.whl
	$(PY) -m pip wheel $(PIP_QUIET) --no-deps --no-build-isolation -w dist .
	git rev-parse --short HEAD > dist/COMMIT
	@git diff --quiet HEAD -- compile_pass kernels examples benchmarks || echo "$$(cat dist/COMMIT)+dirty" > dist/COMMIT

clean:
	rm -rf .venv .venv-torch* .cache build dist *.egg-info .pytest_cache .hypothesis
