# Two commands matter: `make lab` (set up, then JupyterLab with the monarch kernel) and
# `make test` (set up, then the whole suite).  `make demo` is the headless variant of the
# first: it runs the quickstart notebook and prints its outputs.  All create .venv first
# (VENV=DIR makes it elsewhere: tests/system/test_notebooks.py sets up a fresh copy so).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml setup.py | cksum | cut -d' ' -f1)
# System packages, in two sets, each printed as it is installed (as root, with apt-get):
# - for the kernel and the panel (`make setup`, `make lab`): OpenSSL's headers, so pip
#   builds the wire's native hot path (native/wire.c; without them messages take the
#   pure-Python path).  Nothing else: no daemon, no browser.
# - for the tests only (`make test`, which CI runs): rdma-core and libibverbs' headers (the
#   ibverbs extension) and Debian's pyverbs, iproute2 (network namespaces as simulated
#   hosts), chromium (tests/system/test_jupyterlab.py drives JupyterLab in it with Playwright), and
#   an sshd per simulated host and a small Slurm cluster (openssh-server/-client, slurmctld,
#   slurmd, slurm-client, munge).  The tests start their own daemons with their own
#   configuration; on a machine with systemd, installing these also enables (and may start)
#   the system's sshd, munge and Slurm services, which is why `make lab` never installs them.
# Node.js (20.19 or newer, for the Mesh panel's build) is not among them: Debian 12's nodejs
# is too old, so it comes from NodeSource or nvm; the panel's build says so when node is missing.
SYSDEPS := libssl-dev
TEST_SYSDEPS := iproute2 libibverbs-dev rdma-core python3-pyverbs chromium \
	openssh-server openssh-client slurmctld slurmd slurm-client munge
SYSSTAMP := $(VENV)/.sysdeps-$(shell echo $(SYSDEPS) | cksum | cut -d' ' -f1)
TEST_SYSSTAMP := $(VENV)/.test-sysdeps-$(shell echo $(TEST_SYSDEPS) | cksum | cut -d' ' -f1)
TEST_STAMP := $(VENV)/.test-installed-$(shell cat pyproject.toml setup.py | cksum | cut -d' ' -f1)
# Installs only the packages of $(1) that dpkg does not list as installed, with --no-upgrade:
# an installed package is never upgraded (apt-get install of an installed libssl-dev once
# upgraded libssl3 and openssl).  One line per step; apt's own output shows only on failure.
APT = missing=$$(for p in $(1); do dpkg-query -W -f='$${db:Status-Status}\n' $$p 2>/dev/null | grep -qx installed || echo $$p; done); \
	if [ -z "$$missing" ]; then echo "system packages: already installed: $(1)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "apt-get install --no-upgrade" $$missing; log=$$(mktemp); \
	  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-upgrade $$missing; } >$$log 2>&1; \
	  then cat $$log >&2; rm -f $$log; echo "error: apt-get install $$missing failed (its output is above)" >&2; exit 1; fi; \
	  rm -f $$log; \
	else echo "note: not installing" $$missing "(that needs root and apt-get): $(2)"; fi

# workspace: a recipe, not the folder (which exists after the first `make lab`)
.PHONY: setup lab workspace demo lint test docs bench bench-scale gpu-check clean

$(SYSSTAMP):
	@$(call APT,$(SYSDEPS),messages will take the pure-Python path unless OpenSSL's headers are there)
	@mkdir -p $(VENV) && rm -f $(VENV)/.sysdeps* && touch $@

$(TEST_SYSSTAMP): $(SYSSTAMP)
	@$(call APT,$(TEST_SYSDEPS),the tests of ibverbs and network namespaces and ssh and Slurm and the browser will skip)
	@rm -f $(VENV)/.test-sysdeps* && touch $@

# torch first, pinned: the local CPU wheel, never a multi-GB CUDA download (named again below
# so that pip keeps it).  Then the project with its notebooks extra (what notebooks/ imports
# besides the kernel: numpy, which torch itself wants, and matplotlib), and JupyterLab: what
# the panel is built with (jlpm) and shown in.
$(STAMP): pyproject.toml setup.py $(SYSSTAMP)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[notebooks]' 'jupyterlab>=4.2' torch==2.13.0 --config-settings editable_mode=compat
	$(BIN)/python -m monarch_kernel install --sys-prefix
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

# The Mesh panel: the JupyterLab extension built with jlpm (JupyterLab's yarn, in .venv) from
# labextension/, then linked into .venv with the server extension, as the wheel installs them
# (an editable install carries neither; a wheel builds the labextension itself, setup.py's
# build_labextension, and tests/system/test_packaging.py checks that wheel).
LABEXT := labextension/prebuilt/package.json
LABSRC := $(wildcard labextension/src/*.ts labextension/style/* labextension/schema/*) \
	labextension/package.json labextension/yarn.lock labextension/tsconfig.json
PANEL := $(VENV)/.panel-installed

$(LABEXT): $(LABSRC) | $(STAMP)
	@command -v node >/dev/null || { echo "error: the Mesh panel (labextension/) is built with Node.js 20.19 or newer," \
	  "and there is no node on PATH: install it (NodeSource's packages or nvm; Debian 12's nodejs 18 is too old)," \
	  "then make again" >&2; exit 1; }
	cd labextension && PATH=$(abspath $(BIN)):$$PATH jlpm install --immutable >/dev/null \
	  && PATH=$(abspath $(BIN)):$$PATH jlpm build >/dev/null
	touch $@

$(PANEL): $(LABEXT) $(STAMP)
	echo "$(CURDIR)/extension" > "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/monarch_kernel_server_dev.pth"
	mkdir -p $(VENV)/etc/jupyter/jupyter_server_config.d $(VENV)/share/jupyter/labextensions
	cp extension/jupyter_server_config.d/monarch_kernel_server.json $(VENV)/etc/jupyter/jupyter_server_config.d/
	rm -rf $(VENV)/share/jupyter/labextensions/monarch-kernel-panel
	ln -s $(CURDIR)/labextension/prebuilt $(VENV)/share/jupyter/labextensions/monarch-kernel-panel
	touch $@

setup: $(STAMP) $(PANEL)

# What only the tests need: their system packages (above), then the test extras; the project
# is installed again so that its ibverbs extension is built against the headers just installed
# (torch pinned again, as above).
$(TEST_STAMP): $(STAMP) $(TEST_SYSSTAMP)
	$(BIN)/pip install -q -e '.[test,docs]' torch==2.13.0 --config-settings editable_mode=compat
	rm -f $(VENV)/.test-installed-*
	touch $@

# JupyterLab serves workspace/ (git-ignored), where each notebook of notebooks/ is copied unless
# a copy is there already: Run All and saving write there, never into the tracked notebooks/, and
# a user's edited copy is kept (delete it to get the shipped one again).
WORKSPACE ?= workspace

workspace:
	@mkdir -p $(WORKSPACE) && for f in notebooks/*.ipynb; do \
	  [ -e "$(WORKSPACE)/$${f##*/}" ] || cp "$$f" "$(WORKSPACE)/"; done
	@echo "notebooks: $(WORKSPACE)/ (copies of notebooks/; an edited copy is kept)"

lab: setup workspace
	@echo "JupyterLab with the 'Python 3 (monarch mesh)' kernel; open the URL it prints below."
	$(BIN)/jupyter lab --no-browser --ip=127.0.0.1 --notebook-dir=$(WORKSPACE) $(if $(filter 0,$(shell id -u)),--allow-root)

demo: setup
	$(BIN)/python examples/run_notebook.py notebooks/quickstart.ipynb
	$(BIN)/python examples/demo.py

lint: setup $(TEST_STAMP)
	$(BIN)/ruff check monarch_kernel benchmarks examples tests
	$(BIN)/mypy monarch_kernel

# The suite on three workers (tests/conftest.py: each module one unit, longest first); TEST_WORKERS=0 runs it
# serially.  Three on two cores: the suite waits on processes (kernels starting, ranks answering, deadlines)
# far more than it computes; two workers kept about a third of two cores busy.
TEST_WORKERS ?= 3
test: setup $(TEST_STAMP) lint
	$(BIN)/python -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder)

# The documentation site (docs/, Sphinx), into docs/_build/html: every notebook and every guide's code
# cells run on the monarch kernel, warnings are errors and every cross-reference is checked.  The
# suite builds it too, once (tests/docs/test_site.py), and opens it in a browser.
DOCS_STAMP := $(VENV)/.docs-installed-$(shell cat pyproject.toml setup.py | cksum | cut -d' ' -f1)
$(DOCS_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[docs]' torch==2.13.0 --config-settings editable_mode=compat
	rm -f $(VENV)/.docs-installed-*
	touch $@

docs: $(DOCS_STAMP)
	$(BIN)/python -m sphinx -W -n --keep-going -q -b html docs docs/_build/html -d docs/_build/doctrees

bench: setup $(TEST_STAMP)
	$(BIN)/python -m benchmarks

# The CUDA tests and GPU benchmarks, one JSON object, under 5 minutes (says so where there is no GPU).
gpu-check: setup $(TEST_STAMP)
	$(BIN)/python -m benchmarks gpu

# W11: 256, 512 and 1,024 ranks on this host (minutes; about 6 GiB of memory at 1,024).
bench-scale: setup $(TEST_STAMP)
	$(BIN)/python -m benchmarks W11

clean:
	rm -rf $(VENV) build *.egg-info labextension/node_modules labextension/lib labextension/prebuilt \
	  labextension/tsconfig.tsbuildinfo
