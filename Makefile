# Every target installs what it needs first, so each is safe to run on a fresh machine and to re-run.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU wheel of torch is pinned here (not in pyproject) so set-up never pulls a multi-GB CUDA build.
TORCH_CPU ?= torch==2.13.0
# Shared libraries the non-CUDA Mooncake wheel links against.
APT_PACKAGES := libibverbs1 librdmacm1 libnuma1
# Test tools: the browser the dashboard test drives (Playwright with the system executable) and
# promtool (from Debian's prometheus package) that checks the /metrics exposition.
APT_TEST_TOOLS := chromium prometheus
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: setup test lint fmt typecheck demo bench bench-plan bench-transport bench-events clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@if ! ldconfig -p | grep -q 'libibverbs.so.1' || ! ldconfig -p | grep -q 'librdmacm.so.1' \
	    || ! ldconfig -p | grep -q 'libnuma.so.1'; then \
	  echo "installing $(APT_PACKAGES)"; \
	  $(if $(filter 0,$(shell id -u)),,sudo) apt-get update -qq && \
	  $(if $(filter 0,$(shell id -u)),,sudo) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(APT_PACKAGES); \
	fi
	@if ! command -v chromium >/dev/null || ! command -v promtool >/dev/null; then \
	  echo "installing $(APT_TEST_TOOLS)"; \
	  $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(APT_TEST_TOOLS); \
	fi
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_CPU)"
	$(PY) -m pip install -q -e ".[cpu,test]"
	touch $(STAMP)

test: setup
	$(PY) -m pytest

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

fmt: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

demo: setup
	$(VENV)/bin/kvhandoff demo

bench: bench-plan bench-transport bench-events

bench-plan: setup
	$(VENV)/bin/kvhandoff bench plan

bench-transport: setup
	$(VENV)/bin/kvhandoff bench transport

bench-events: setup
	$(VENV)/bin/kvhandoff bench events

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
