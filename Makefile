# `make test` is what CI runs (.ci/run): it creates .venv when missing, installs the project and runs pytest.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
TRITON_VERSION ?= 3.8.0
# One Inductor cache and one TMPDIR for the whole run: the first CPU compile builds a precompiled header under
# $$TMPDIR (about 10 s) and probes the vector ISA once per cache dir (about 9 s).
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/.cache/inductor
export TMPDIR ?= $(CURDIR)/.cache/tmp
export TRITON_CACHE_DIR ?= $(CURDIR)/.cache/triton

.PHONY: test demo install gpu-test wheel clean

$(VENV)/.installed: pyproject.toml Makefile
	@mkdir -p $(TMPDIR)
	@test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	@# A machine that has torch keeps its own; otherwise the CPU build, never a multi-GB CUDA build: the local
	@# CPU wheel where pip's find-links has one, else PyTorch's CPU index.
	@$(PY) -c "import torch" 2>/dev/null \
		|| { $(PY) -m pip download -q --no-index --no-deps -d $(TMPDIR)/torch-probe torch==$(TORCH_VERSION) >/dev/null 2>&1 \
		     && $(PY) -m pip install -q torch==$(TORCH_VERSION); } \
		|| $(PY) -m pip install -q torch==$(TORCH_VERSION) --index-url https://download.pytorch.org/whl/cpu \
		     --extra-index-url https://pypi.org/simple
	@$(PY) -c "import triton" 2>/dev/null || $(PY) -m pip install -q triton==$(TRITON_VERSION)
	$(PY) -m pip install -q -e '.[test,inspect]'
	@touch $@

install: $(VENV)/.installed

test: $(VENV)/.installed
	$(PY) -m pytest -q tests

demo: $(VENV)/.installed
	$(VENV)/bin/syncfree-inspect --example decode --out syncfree-inspect-out

# On a CUDA machine: only the GPU-marked tests.
gpu-test: $(VENV)/.installed
	$(PY) -m pytest -q -m gpu tests

wheel: $(VENV)/.installed
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w dist .

clean:
	rm -rf $(VENV) .cache build dist *.egg-info .pytest_cache .hypothesis
