# v4flash-pd developer entry points. `make demo` and `make test` work on a fresh clone.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The demo's light environment: the launcher and the pinned router only (no torch/triton/nixl).
DEMO_VENV ?= .venv-demo
DEMO_BIN := $(DEMO_VENV)/bin
ROUTER_PIN := sglang-router==0.3.2
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: help venv demo-venv test test-fast demo lint wheel lock image image-ci wheelhouse clean

help: ## this list, with the values the variables have now
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/; s/$$(IMAGE)/$(IMAGE)/g' | column -t -s $$'\t'
	@echo
	@echo "variables (override: make VAR=value):"
	@printf '  %-11s %s\n' PY "$(PY) ($$($(PY) --version 2>&1))" VENV "$(VENV)" DEMO_VENV "$(DEMO_VENV)" \
	  ENGINE "$(ENGINE)" IMAGE "$(IMAGE):$(V4_VERSION)" WHEELHOUSE "$(WHEELHOUSE)" IMAGE_ARGS "$(or $(IMAGE_ARGS),(none))" \
	  PYTEST_ARGS "$(or $(PYTEST_ARGS),(none))" DEMO_ARGS "$(or $(DEMO_ARGS),(none))"

TEST_REQS := tests/requirements.txt tests/requirements-bundle.txt tests/requirements-env.txt tests/requirements-ops.txt

$(BIN)/.stamp: pyproject.toml $(TEST_REQS)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]' $(addprefix -r ,$(TEST_REQS))
	touch $@

venv: $(BIN)/.stamp ## create .venv: launcher, kernels and every test tool (~2 GB: torch, triton, nixl)

$(DEMO_BIN)/.stamp: pyproject.toml
	$(PY) -m venv $(DEMO_VENV)
	$(DEMO_BIN)/pip install -q --upgrade pip
	$(DEMO_BIN)/pip install -q -e . '$(ROUTER_PIN)'
	touch $@

demo-venv: $(DEMO_BIN)/.stamp ## create .venv-demo: the launcher and the pinned router only (~150 MB)

test: venv ## run the whole test suite (what CI runs): the kernels, the hook + system tests and the rest as three pytest processes at once
	tools/run_tests.sh $(BIN)/python $(PYTEST_ARGS)

test-fast: venv ## the suite without slow/image tests
	$(BIN)/python -m pytest -m 'not gpu and not slow and not image' $(PYTEST_ARGS)

demo: demo-venv ## rehearse the trio locally: up, one request through the router, status, clean stop (DEMO_ARGS go to `up`)
	$(DEMO_BIN)/python -m v4flash_pd.demo $(DEMO_ARGS)

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

LINT_PATHS := launcher tools kernels tests setup.py

lint: venv ## ruff (the whole tree) + mypy --strict (launcher, kernels, benches), hadolint, the stack pins agree, the registry's doc tables, flake.nix parses
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/mypy
	$(BIN)/python tools/registry_docs.py --check
	$(BIN)/hadolint --no-color docker/Dockerfile
	$(BIN)/python tools/check_consistency.py
	@if command -v nix-instantiate >/dev/null; then nix-instantiate --parse flake.nix >/dev/null && echo "flake.nix parses"; \
	 else echo "nix-instantiate not installed: flake.nix not parsed"; fi

clean: ## remove .venv, .venv-demo, .cache (the pinned sglang wheel and its builds, ~0.5-1.5 GB), build outputs and runs/
	rm -rf $(VENV) $(DEMO_VENV) .cache build dist *.egg-info runs
