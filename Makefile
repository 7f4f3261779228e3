# graphfeed — every target installs what it needs by itself.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
RUNTIME_STAMP := $(VENV)/.runtime-stamp
DATA   ?= data
WHEELS ?= ../shared/wheels

.PHONY: help install test lint proto proto-check demo demo-hetero demo-link compose-test gpu-check bench-partition bench-scale bench-peers clean

help:
	@echo "make demo             small graph -> 2 partitions -> 2 sampling servers -> 2 DDP trainers (PARTS=dir: yours)"
	@echo "make demo-hetero      typed mag-small -> 2 partitions -> 2 sampling servers -> 2 DDP R-GCN trainers"
	@echo "make demo-link        citation2-small with link splits -> 2 partitions -> 2 servers -> 2 DDP link trainers (MRR)"
	@echo "make test             install if needed, then lint and run the whole test suite"
	@echo "make compose-test     (root) build the image offline and run deploy/docker-compose.yml with podman"
	@echo "make gpu-check        (CUDA GPU) GPU tests, CUDA sampler/stream benchmarks, 1-GPU NCCL demo -> one report"
	@echo "make install          create $(VENV) and install graphfeed editable with dev extras"
	@echo "make lint             ruff + mypy"
	@echo "make proto            regenerate protos/ stubs from protos/sampling.proto"
	@echo "make bench-partition  generate products-like and partition it (benchmarks/partition.py)"
	@echo "make bench-scale      papers-like at 1/100 to 1/10: partition, serve, train; the cost model (about an hour)"
	@echo "make bench-peers      install PyG's torch-sparse/torch-scatter wheels for side-by-side benchmarks"

install: $(STAMP)

# Re-run only when the project's metadata changes; torch is pinned to the CPU wheel on disk.
# pip's own output shows the progress: a line per package it collects, a bar per download
# (on a terminal), then one "Installing collected packages" step that unpacks them all.
PIP_INSTALL := $(PY) -m pip install --disable-pip-version-check --progress-bar on
INSTALL_NOTE := torch $(shell sed -n 's/.*"torch==\([^"]*\)".*/\1/p' pyproject.toml) (CPU build, the largest), torch_geometric, numba, grpcio, ogb, pymetis

$(STAMP): pyproject.toml
	@test -x $(PY) || { echo "== creating $(VENV)"; $(PYTHON) -m venv $(VENV); }
	@echo "== installing graphfeed with its development tools into $(VENV) (a few minutes the first time):"
	@echo "   $(INSTALL_NOTE), and ruff, mypy, pytest; the last step, unpacking, takes a minute"
	$(PIP_INSTALL) -e '.[dev]'
	@touch $(STAMP) $(RUNTIME_STAMP)
	@echo "== installed into $(VENV)"

# What running graphfeed needs, without the development tools (the demo's install).
$(RUNTIME_STAMP): pyproject.toml
	@test -x $(PY) || { echo "== creating $(VENV)"; $(PYTHON) -m venv $(VENV); }
	@echo "== installing graphfeed and what it needs to run into $(VENV) (about 2 minutes the first time):"
	@echo "   $(INSTALL_NOTE); the last step, unpacking, takes a minute"
	$(PIP_INSTALL) -e .
	@touch $(RUNTIME_STAMP)
	@echo "== installed into $(VENV)"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy deploy/*.py benchmarks/*.py benchmarks/experiments/*.py benchmarks/netns/*.py examples/*.py

# PyG's CPU NeighborLoader (torch-sparse/torch-scatter, wheels in $(WHEELS) when present)
# only for the test that compares accuracy with it; graphfeed itself never imports them.
test: install lint
	@if [ -n "$$(ls $(WHEELS)/torch_sparse-*.whl 2>/dev/null)" ]; then $(MAKE) --no-print-directory bench-peers; fi
	$(PY) -m pytest -q

proto: install
	$(PY) -m protos.generate

proto-check: install
	$(PY) -m protos.generate --check

# small synthetic graph -> 2 partitions -> 2 sampling servers -> 2 DDP trainers (CPU);
# PARTS=dir trains on your own partition directory instead.
PARTS ?=
demo: $(RUNTIME_STAMP)
	$(PY) deploy/demo.py --data $(DATA)/demo $(if $(PARTS),--partition-dir $(PARTS))

# typed (ogbn-mag-shaped) mag-small -> 2 partitions (format v2) -> 2 sampling servers ->
# 2 DDP trainers of R-GCN on typed minibatches (CPU).
demo-hetero: $(RUNTIME_STAMP)
	$(PY) deploy/demo.py --typed --data $(DATA)/demo-typed

demo-link: $(RUNTIME_STAMP)
	$(PY) deploy/demo.py --link --data $(DATA)/demo-link

# Root, about 6 minutes on 2 cores from nothing (see deploy/compose_test.py for the steps).
COMPOSE_TEST_ARGS ?=
compose-test: install
	$(PY) -m pip install --quiet --disable-pip-version-check podman-compose==1.6.0
	$(PY) deploy/compose_test.py $(COMPOSE_TEST_ARGS)

# On a machine with a CUDA GPU: the gpu tests, the CUDA benchmark rows, the model step and a
# 1-GPU NCCL demo in under 10 minutes, one report (benchmarks/results/gpu-check.{json,md}).
# Without a GPU it says so and exits 0. GPU_PYTHON: this venv's python when there is one,
# else python3 with the machine's own packages (a GPU image with torch, numba-cuda, PyG and
# grpcio).
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-check:
	PYTHONPATH=. $(GPU_PYTHON) benchmarks/gpu_check.py

bench-partition: install
	$(PY) benchmarks/partition.py --data $(DATA)/bench

bench-scale: install
	$(PY) benchmarks/scale.py --data $(DATA)/scale --feature-dtype float16 --prefetch-bytes 134217728

bench-peers: install
	$(PY) -m pip install --quiet --no-deps $(WHEELS)/torch_scatter-*.whl $(WHEELS)/torch_sparse-*.whl

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache $(DATA)/demo $(DATA)/demo-typed $(DATA)/demo-link
