# Two commands matter: `make demo` (set up, then run the example) and `make test`
# (set up, then the whole suite).  Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: setup demo test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first, pinned: the local CPU wheel, never a multi-GB CUDA download.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]' --config-settings editable_mode=compat
	$(BIN)/python -m monarch_kernel install --sys-prefix
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/python examples/demo.py

test: setup
	$(BIN)/python -m pytest

bench: setup
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
