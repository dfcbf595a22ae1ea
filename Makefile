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

wheel: venv ## build the v4flash-pd wheel into dist/
	$(BIN)/pip wheel -q --no-deps -w dist .

clean:
	rm -rf $(VENV) build dist *.egg-info runs
