# `make run` and `make test` each set up everything they need on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# These CPU machines serve torch 2.13.0 (CPU build) from local disk; install it before the project so the
# open range in pyproject.toml is already satisfied. On a GPU box, override: make TORCH_SPEC=torch test
TORCH_SPEC ?= torch==2.13.0
PORT ?= 8501
# `make serve` binds HOST: localhost unless the operator names an address (HOST=0.0.0.0 for every interface).
HOST ?= 127.0.0.1

.PHONY: run serve test lint bench chromium graphviz screenshot docs-images

# torch with pip from this machine's disk (pip's configuration names the folder; uv does not look there), asking no
# package index where TORCH_SPEC pins a release (==): 3-9 s, most of it writing torch's files; from the index where it
# is not on disk or not pinned (a GPU box: TORCH_SPEC=torch, the registry's CUDA build). Then the rest with uv, torch's
# own requirements among them: the same releases as pip resolves, in 3 s from an empty cache where pip took 11 s asking
# the index for each package in turn; pip does it where uv fails. No `pip install --upgrade pip` (1.4 s): the venv's
# own pip installs wheels and editable projects.
# --no-compile: pip would compile every module of every package to bytecode, torch's thousands included, most never
# imported (torch's install here: 16.7 s with, 4.6 s without). Python compiles the modules imported, once, on first
# import (about half a second more for the first import of torch, transformers and streamlit together).
# The interpreter .venv is made from: Debian's own Python 3.11 where it is installed with venv (as on the machines the
# suite is timed on), else the first python3 on PATH; BASE_PYTHON=... chooses. Debian's is linked statically, where
# pyenv's 3.11.7 (first on PATH there) calls its core through libpython3.11.so, and it runs this project's Python
# faster: the planner, parallel-matrix and capture tests took 65.7 s against 74.0 s (one run each, quiet machine).
BASE_PYTHON ?= $(shell /usr/bin/python3.11 -c "import ensurepip, venv" >/dev/null 2>&1 && echo /usr/bin/python3.11 || echo python3)

$(STAMP): pyproject.toml
	$(BASE_PYTHON) -m venv $(VENV)
	$(if $(findstring ==,$(TORCH_SPEC)),$(PY) -m pip install -q --no-compile --no-deps --no-index "$(TORCH_SPEC)" \
		2>/dev/null || )$(PY) -m pip install -q --no-compile "$(TORCH_SPEC)"
	$(PY) -m pip install -q --no-compile uv
	$(VENV)/bin/uv pip install -q --python $(PY) -e ".[test]" || $(PY) -m pip install -q --no-compile -e ".[test]"
	touch $(STAMP)

# Debian's Chromium for the browser tests (Playwright cannot download browsers here) and Graphviz for SVG.
chromium:
	@command -v chromium >/dev/null 2>&1 || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium; }

graphviz:
	@command -v dot >/dev/null 2>&1 || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q graphviz; }

SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# vis-network's script, served once to browsers from static/ (graphviz_core/ui/vis_script.py), copied here at set-up
# so a server started by make never writes it; again whenever pyvis's copy is newer. vis_asset imports neither pyvis nor
# Streamlit nor torch: 0.1 s, where importing them took 4 s of the set-up.
VIS_STATIC := static/vis-network.min.js
$(VIS_STATIC): $(STAMP)
	$(PY) -m graphviz_core.export.vis_asset

run: $(STAMP) $(VIS_STATIC)
	$(PY) -m graphviz_core.ui.serve --server.address 127.0.0.1 --server.port $(PORT)

# For a team: .streamlit/config.toml's safe settings (headless, no usage stats, no error details in the
# browser, XSRF on, cross-origin refused, uploads off), the address chosen here, and the capture limits
# from the environment (docs/team-server.md, "Limits, from the environment").
serve: $(STAMP) $(VIS_STATIC)
	$(PY) -m graphviz_core.ui.serve --server.address $(HOST) --server.port $(PORT) --server.headless true \
		--browser.gatherUsageStats false --client.showErrorDetails none --server.enableXsrfProtection true \
		--server.enableCORS true --server.maxUploadSize 1

# Three pytest-xdist workers on this 2-core machine, each taking one test file at a time (the docs' commands share files
# under /tmp; a file's tests share its fixtures), handed out longest first by a recorded run's times
# (tests/durations.py) so that they end together. Two workers left the cores idle 10% of the run (a browser test waiting
# on its page, a server starting); a third fills that time with about the same CPU work in all (fresh clones here: 3
# workers, make test 562 s, cores 97% busy, 1,079 CPU s; 2 workers, 599 and 600 s, 89-90% busy, 1,060-1,071 CPU s).
# TEST_WORKERS=2 (or 0: everything in one process) chooses. One torch thread per process (workers, the servers and CLI
# runs they start): the workers already fill the cores, and torch's threads then wait on each other (1,000 recorded
# steps of a tiny GPT-2 with two other busy processes: 44.3 s with torch's default threads, 20.5 s with one; 11.7 s on a
# quiet machine).
# PYTHONDONTWRITEBYTECODE emptied for the run, where the environment sets it (this machine's shell does): the set-up
# compiles no bytecode (--no-compile above), and the suite starts over a hundred Python processes (CLI runs, servers,
# fork servers), each of which would otherwise compile every module it imports from source, torch's and streamlit's
# among them (importing torch, transformers and streamlit: 2.1 s from bytecode, 4.3 s from source). The first process
# to import a module writes its bytecode into .venv and the checkout; every later one reads it.
TEST_WORKERS ?= 3
TEST_THREADS ?= 1
test: $(STAMP) $(VIS_STATIC) chromium graphviz
	$(VENV)/bin/ruff check graphviz_core pages app.py tests benchmarks
	PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=$(TEST_THREADS) MKL_NUM_THREADS=$(TEST_THREADS) \
		$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

lint: $(STAMP)
	$(VENV)/bin/ruff check graphviz_core pages app.py tests benchmarks
	$(VENV)/bin/ruff format --check graphviz_core pages app.py tests benchmarks

bench: $(STAMP) chromium graphviz
	$(PY) benchmarks/update_readme.py

screenshot: $(STAMP) chromium
	$(PY) -m graphviz_core.ui.screenshot assets/graph-explorer.png

# The docs gallery, assets/gallery/: each preset's graph (PNG, 2x), the toy stepper at three steps, the memory and
# FLOP panels, and index.md. Minutes of CPU (every preset is captured), so not part of `make test`.
docs-images: $(STAMP) chromium
	GRAPHVIZ_CORE_DEVICE=cpu $(PY) -m graphviz_core.ui.screenshot --gallery assets/gallery
