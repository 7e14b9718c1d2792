# The two commands of the README:
#   make run   -- installs dependencies, configures, builds, runs the main job: packmoe train of
#                 the tiny model on the fortunes corpus on the CPU (the README's main command)
#   make test  -- installs dependencies, configures, builds, runs every test this machine can run
#   make install [PREFIX=~/.local] -- builds, then puts packmoe in PREFIX/bin (default /usr/local)
# CUDA is built whenever nvcc is found (override: make PACKMOE_CUDA=OFF test). Tests labelled
# `cuda` need a GPU and run only where one is visible.
BUILD ?= build
# OpenMP threads sleep instead of spinning while they wait: on a shared or small machine spinning
# threads steal the cores the work needs (measured: 1-3 s instead of 70 ms per tiny step).
export OMP_WAIT_POLICY ?= passive
PACKMOE_CUDA ?= AUTO
JOBS ?= $(shell nproc)
NVCC := $(shell command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null)

PREFIX ?= /usr/local

.PHONY: deps configure build run test install clean

deps:
	@scripts/install-deps.sh

configure: deps
	@cmake -S . -B $(BUILD) -G Ninja -DPACKMOE_CUDA=$(PACKMOE_CUDA) \
	  $(if $(NVCC),-DCMAKE_CUDA_COMPILER=$(NVCC)) >/dev/null

build: configure
	@cmake --build $(BUILD) -j $(JOBS)

run: build
	$(BUILD)/packmoe train --preset tiny --device cpu --out runs/tiny

test: build
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS); \
	else \
	  echo "no GPU visible: running every test but those labelled cuda"; \
	  ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS) -LE cuda; \
	fi

install: build
	@cmake --install $(BUILD) --prefix $(PREFIX)

clean:
	rm -rf $(BUILD)
