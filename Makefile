# gthulhu-node. Every target installs what it needs first (scripts/install-deps, idempotent and quick).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PYTEST := $(PY) -m pytest
CMD ?= uname -a
# make test's lanes (pytest-xdist workers): each runs its own lab guests, one at a time, and a guest is
# single-threaded TCG, so two lanes use this 2-core machine's two cores. LANES=0: one process, as before.
LANES ?= 2

.PHONY: help deps build bpf proto lint lab-kernels test test-unit bench demo lab-shell lab-run install wheel deb clean

help:
	@echo "make demo       the agent scheduling a vLLM-like workload in the sched_ext lab VM"
	@echo "make test       every test: lint, unit, host and lab-VM tests"
	@echo "make bench      benchmarks (figures and ratios against baselines measured in the same run)"
	@echo "make lab-shell  a root shell in the sched_ext lab VM; make lab-run CMD='...' runs one command"
	@echo "make install    install the agent, its systemd unit and a default config on this host"
	@echo "make wheel      dist/gthulhu_node-*.whl with the prebuilt scheduler objects inside"
	@echo "make deb        dist/gthulhu-node_*.deb for this Debian suite (docs/packaging.md)"

deps:
	@scripts/install-deps

build: deps bpf proto

bpf: deps
	@$(MAKE) -s -C bpf

proto: deps
	@scripts/gen-proto

lint: build
	$(VENV)/bin/ruff check gthulhu_node tests
	$(VENV)/bin/mypy

# Every kernel of the lab matrix, and the newer libbpf, before any test asks for one: the first run builds
# the 6.12 LTS kernel from Debian's source (docs/lab.md has the time); later runs find all in the cache.
# Also arm64's 7.3 and the BTF of every offered cloud kernel of both architectures, which the host tests
# are parametrized by: fetched at collection, in every pytest worker at once, they raced on an empty cache.
# Last, the arm64 guest's Debian root (tests/vm/rootfs.py: about 12 minutes the first time, then cached).
lab-kernels: deps
	@$(PY) -m tests.vm.kernel --kernel 7.3 >/dev/null
	@$(PY) -m tests.vm.kernel --kernel 6.12 >/dev/null
	@$(PY) -m tests.vm.libbpf_build >/dev/null
	@$(PY) -m tests.vm.kernel --kernel 7.3 --arch arm64 >/dev/null
	@$(PY) -m tests.vm.kernel --other-btfs >/dev/null
	@$(PY) -m tests.vm.kernel --other-btfs --arch arm64 >/dev/null
	@$(PY) -m tests.vm.rootfs >/dev/null

test: build lint lab-kernels
	$(PYTEST) -n $(LANES) --dist loadgroup --durations=40 -m "not bench" tests

test-unit: build
	$(PYTEST) tests/unit

bench: build
	$(PYTEST) -m bench -s -p no:cacheprovider tests/bench

demo: build
	$(PY) -m tests.vm.demo

lab-shell: build
	$(PY) -m tests.vm.lab shell

lab-run: build
	$(PY) -m tests.vm.lab run -- $(CMD)

install: build
	scripts/install

# The wheel carries the prebuilt CO-RE objects (gthulhu_node/data/) and the unit and default configuration
# (gthulhu_node/share/), so a host installing it needs no compiler: docs/packaging.md.
wheel: build
	@scripts/build-wheel

deb: build
	@scripts/build-deb

clean:
	rm -rf dist bpf/.output gthulhu_node/api/gen gthulhu_node/data/*.bpf.o .mypy_cache .ruff_cache .pytest_cache
