# The images, built with podman; included by the Makefile (it defines setup, PIP, SMOLLM2):
#
#   make image          the cpu image pdserve:<appVersion>-cpu (what the chart runs), from nothing
#   make image-cuda     the cuda image pdserve:<appVersion>-cuda; its base (CUDA_BASE) must be
#                       pulled first, which no registry here allows
#
# No registry is needed for the cpu image: its base is made from the Debian mirror
# (deploy/base-image.sh: mmdebstrap, then podman import) and its wheels are fetched into a
# wheelhouse (.image-wheels/, git-ignored) by the base's own Python, so that its markers
# decide (bookworm's Python is 3.11.2, and redis needs async-timeout before 3.11.3). The
# build bind-mounts the wheelhouse for the install only (RUN --mount) and installs with
# PIP_NO_INDEX=1, so no wheel lands in a layer and the build needs no network.
#
# torch: the CPU build. The wheelhouse gets it from pip's find-links on this machine
# (FIND_LINKS, default $PIP_FIND_LINKS) where one has it, else from TORCH_INDEX_URL.
#
# As root podman needs runc and cgroupfs on this kind of host (crun fails on hybrid
# cgroups); running a container needs the ulimits of PODMAN_RUN too.
PODMAN ?= podman --runtime /usr/sbin/runc --cgroup-manager cgroupfs
PODMAN_RUN ?= $(PODMAN) run --rm --ulimit nofile=4096:4096 --ulimit nproc=4096:4096
IMAGE_VERSION := $(shell sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$$/\1/p' deploy/helm/pdserve/Chart.yaml)
CPU_IMAGE := pdserve:$(IMAGE_VERSION)-cpu
CUDA_IMAGE := pdserve:$(IMAGE_VERSION)-cuda
CPU_BASE ?= localhost/pdserve-base:bookworm
CUDA_BASE ?= nvidia/cuda:12.8.1-runtime-ubuntu24.04
WHEELS := .image-wheels
FIND_LINKS ?= $(PIP_FIND_LINKS)
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
PIP_CACHE ?= $(HOME)/.cache/pip

.PHONY: image image-cuda image-tools image-base

image-tools:
	@command -v podman >/dev/null && command -v mmdebstrap >/dev/null && test -x /usr/sbin/runc \
	  || (apt-get update && apt-get install -y podman mmdebstrap runc uidmap)

image-base: image-tools
	PODMAN="$(PODMAN)" deploy/base-image.sh $(CPU_BASE)

# Every wheel the image installs: torch's CPU build, the package's dependencies at
# constraints.txt's pins, setuptools to build it, and the embedded model. Resolved in the
# base (a copy of the sources, pip's cache shared with this machine; PIP_CERT, a CA bundle
# for a TLS-intercepting proxy, mounted where set). Made again when the pins change.
$(WHEELS)/.complete: pyproject.toml constraints.txt | image-base
	mkdir -p $(WHEELS) $(PIP_CACHE)
	$(PODMAN_RUN) --network host -v $(CURDIR):/src:ro -v $(CURDIR)/$(WHEELS):/wheels \
	  -v $(PIP_CACHE):/root/.cache/pip -e PIP_DISABLE_PIP_VERSION_CHECK=1 \
	  $(foreach d,$(FIND_LINKS),-v $(d):$(d):ro) -e PIP_FIND_LINKS="/wheels $(FIND_LINKS)" \
	  $(if $(PIP_CERT),-v $(PIP_CERT):/etc/pdserve-pip-ca.crt:ro -e PIP_CERT=/etc/pdserve-pip-ca.crt) \
	  $(CPU_BASE) sh -ec '\
	    python3 -m venv /tmp/venv; pip=/tmp/venv/bin/pip; mkdir /tmp/src; cd /src; \
	    tar -cf - pyproject.toml setup.py constraints.txt README.md deploy/helm/pdserve/values.yaml \
	      $$(ls -d pdserve engine* kernels* services* proto* cli* sim* profiler* autoscale*) \
	      | tar -C /tmp/src -xf -; \
	    $$pip download --quiet --no-deps -d /wheels $(if $(FIND_LINKS),--no-index,--index-url $(TORCH_INDEX_URL)) \
	      "torch==$$(sed -n "s/^torch==//p" constraints.txt)"; \
	    $$pip download --quiet -c constraints.txt -d /wheels "/tmp/src[mooncake-cpu]" setuptools; \
	    $$pip download --quiet --no-deps -d /wheels $(SMOLLM2); \
	    rm -f /wheels/pdserve-*'
	touch $@

# The image a rebuild replaces is removed, not left dangling: each is 3.5 GB, and only
# its layers that the new one shares (torch's, triton's) stay. podman refuses while a
# container still uses it, and the build goes on.
image: image-base $(WHEELS)/.complete
	@old=$$($(PODMAN) image inspect --format '{{.Id}}' $(CPU_IMAGE) 2>/dev/null || true); \
	$(PODMAN) build --network host --ignorefile deploy/Dockerfile.cpu.dockerignore \
	  --build-arg PIP_FIND_LINKS=/context/$(WHEELS) --build-arg PIP_NO_INDEX=1 --build-arg BASE_IMAGE=$(CPU_BASE) \
	  -f deploy/Dockerfile.cpu -t $(CPU_IMAGE) . || exit 1; \
	new=$$($(PODMAN) image inspect --format '{{.Id}}' $(CPU_IMAGE)); \
	if [ -n "$$old" ] && [ "$$old" != "$$new" ]; then $(PODMAN) rmi "$$old" >/dev/null || true; fi
	@echo "$(CPU_IMAGE): $$($(PODMAN) image inspect --format '{{.Size}}' $(CPU_IMAGE)) bytes"

# The same build for GPU nodes, every wheel from PyPI (the CUDA torch: several GB).
image-cuda: image-tools
	@$(PODMAN) image exists $(CUDA_BASE) || { echo "image-cuda: the base image $(CUDA_BASE) is not here;" \
	  "pull it first (podman pull $(CUDA_BASE)), or set CUDA_BASE" >&2; exit 1; }
	$(PODMAN) build --network host --ignorefile deploy/Dockerfile.dockerignore \
	  --build-arg BASE_IMAGE=$(CUDA_BASE) -f deploy/Dockerfile -t $(CUDA_IMAGE) .
	@echo "$(CUDA_IMAGE): $$($(PODMAN) image inspect --format '{{.Size}}' $(CUDA_IMAGE)) bytes"
