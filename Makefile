# v4flash-pd developer entry points. `make demo` and `make test` work on a fresh clone.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: help venv test test-fast demo lint wheel lock image image-ci wheelhouse clean

help:
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | column -t -s $$'\t'

TEST_REQS := tests/requirements.txt tests/requirements-bundle.txt tests/requirements-env.txt tests/requirements-ops.txt

$(BIN)/.stamp: pyproject.toml $(TEST_REQS)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]' $(addprefix -r ,$(TEST_REQS))
	touch $@

venv: $(BIN)/.stamp ## create .venv with the launcher, kernels and test tools

test: venv ## run the whole test suite (what CI runs)
	$(BIN)/python -m pytest -m 'not gpu' $(PYTEST_ARGS)

test-fast: venv ## the suite without slow/image tests
	$(BIN)/python -m pytest -m 'not gpu and not slow and not image' $(PYTEST_ARGS)

demo: venv ## rehearse the trio locally: up, one request through the router, status, clean stop
	$(BIN)/python -m v4flash_pd.demo

wheel: venv ## build the v4flash-pd wheel into dist/ (ships stack.lock/stack.toml + the kernel .pth)
	$(BIN)/pip wheel -q --no-deps --no-build-isolation -w dist .

# --- environment builder (docs/environment.md) ---------------------------------------------------
# docker if a Docker engine answers, else podman. Extra flags: IMAGE_ARGS, e.g.
#   IMAGE_ARGS='--secret id=extra_ca,src=/etc/ssl/certs/ca-certificates.crt'   (TLS-intercepting proxy)
#   IMAGE_ARGS='--build-arg BASE_IMAGE=registry.local/cuda:13.0.2-runtime-ubuntu24.04@sha256:...'
ENGINE ?= $(shell docker version --format '{{.Server.Version}}' >/dev/null 2>&1 && echo docker || echo podman)
IMAGE ?= v4flash-pd
WHEELHOUSE ?= 0
IMAGE_ARGS ?=
V4_VERSION = $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' launcher/v4flash_pd/__init__.py)
V4_REVISION = $(shell git rev-parse HEAD 2>/dev/null || echo unknown)
LOCK_SHA256 = $(shell sha256sum stack.lock | cut -d' ' -f1)
IMAGE_BUILD = $(ENGINE) build -f docker/Dockerfile $(if $(filter podman,$(ENGINE)),--format docker) \
	--build-arg VERSION=$(V4_VERSION) --build-arg REVISION=$(V4_REVISION) \
	--build-arg LOCK_SHA256=$(LOCK_SHA256) --build-arg WHEELHOUSE=$(WHEELHOUSE) $(IMAGE_ARGS)

lock: venv ## regenerate stack.lock from stack.toml (uv, PyPI metadata only), then verify it
	$(BIN)/python tools/lock.py lock
	$(BIN)/python tools/lock.py check

image: ## build the full serving image (GPU stack) -> $(IMAGE):<version>; WHEELHOUSE=1 builds offline
	$(IMAGE_BUILD) --target full -t $(IMAGE):$(V4_VERSION) -t $(IMAGE):latest .

image-ci: ## build the CI image (everything but the GPU stack) -> $(IMAGE):ci
	$(IMAGE_BUILD) --target ci -t $(IMAGE):ci .

wheelhouse: venv ## download every locked wheel (hash-checked, image platform) into wheelhouse/
	$(BIN)/python tools/lock.py wheelhouse wheelhouse

lint: venv ## hadolint the Dockerfile, check the stack pins agree everywhere, parse flake.nix
	$(BIN)/hadolint --no-color docker/Dockerfile
	$(BIN)/python tools/check_consistency.py
	@if command -v nix-instantiate >/dev/null; then nix-instantiate --parse flake.nix >/dev/null && echo "flake.nix parses"; \
	 else echo "nix-instantiate not installed: flake.nix not parsed"; fi

clean:
	rm -rf $(VENV) build dist *.egg-info runs
