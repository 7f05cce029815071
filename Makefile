# Two commands from a fresh clone: `make train` and `make test`. Each creates .venv when missing.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PRESET  ?= tracking
ARGS    ?=
LOGDIR  ?= runs
PORT    ?= 6006
# One rank per GPU when CUDA GPUs are visible, else 2 CPU ranks (gloo). Only `GPU N: ...` lines count: without a
# GPU or a working driver, nvidia-smi -L prints one line of error ("No devices were found") on stdout.
# CUDA_VISIBLE_DEVICES, when set, caps the count at the devices it lists ("" or -1: none).
# (Passed in by value: before make 4.4 $(shell) does not see a variable set on make's command line.) CUDA stops at the
# first entry that is not a device (-1).
VISIBLE = v=$$(printf '%s' $(call quote,$(CUDA_VISIBLE_DEVICES)) | tr ',' '\n' | awk '/^-/ {exit} /./ {n++} END {print n + 0}')
NPROC   ?= $(shell n=$$(nvidia-smi -L 2>/dev/null | grep -c '^GPU '); \
	$(if $(filter-out undefined,$(origin CUDA_VISIBLE_DEVICES)),$(VISIBLE); [ "$$v" -lt "$$n" ] && n=$$v;) \
	[ "$$n" -gt 0 ] && echo $$n || echo 2)
# 2 cores here: one thread per rank keeps ranks from oversubscribing the CPU.
export OMP_NUM_THREADS ?= 1
export MKL_NUM_THREADS ?= 1

PRESETS := cartpole tracking mujoco isaaclab
# A value as one shell word, as typed: single-quoted (a path can hold " or $; pass $(value VAR) to keep make's $).
quote = '$(subst ','\'',$(1))'

ISAACLAB_DIR     ?= ../IsaacLab
ISAACLAB_REF     ?= v3.0.0
ISAACLAB_VENV    ?= .venv-isaaclab
ISAACSIM         ?= 0
ISAACSIM_VERSION ?= 6.2.0.0

# Checks run before anything is built, which `make -j` (or MAKEFLAGS=-j) would not keep to.
.NOTPARALLEL:

.PHONY: help setup train test test-fast bench bench-grad bench-sync bench-rollout bench-mujoco gpu-wheels setup-mujoco setup-isaaclab export export-needs-ckpt eval eval-needs-ckpt train-settings tensorboard tensorboard-settings clean

help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-15s %s\n", $$1, $$2}'

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Torch first with an exact pin on CPU-only machines (a local CPU wheel); any torch in range on GPU boxes.
$(VENV)/.runtime: requirements.txt | $(BIN)/python
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(BIN)/pip install -q 'torch>=2.4,<2.15'; else $(BIN)/pip install -q torch==2.13.0; fi
	$(BIN)/pip install -q -r requirements.txt
	touch $@

# requirements-dev.txt holds setup-mujoco's packages too: its stamp saves a later `make bench-mujoco` a pip run.
$(VENV)/.dev: requirements-dev.txt $(VENV)/.runtime
	$(BIN)/pip install -q -r requirements-dev.txt
	touch $@ $(VENV)/.mujoco

setup: $(VENV)/.dev  ## create .venv with everything the tests need

# Isaac Lab runs in its own environment (make setup-isaaclab), every other preset in .venv.
ISAAC    = $(filter isaaclab,$(PRESET))
train: train-settings $(if $(ISAAC),,$(VENV)/.runtime)  ## train the default preset: NPROC ranks (2 on CPU), PRESET=tracking
	$(if $(ISAAC),$(call quote,$(ISAACLAB_VENV))/bin,$(BIN))/torchrun --standalone --nproc-per-node $(NPROC) train.py $(PRESET) $(value ARGS)

# Before the prerequisites and torchrun (whose tracebacks would bury the cause): PRESET and NPROC as make passes them.
# An NPROC past 4 ranks per core (bench_grad_sync's bound) is refused: torchrun builds a worker per rank first (a
# 20-digit NPROC: it hung, growing, with no output) and then starts them all.
# An OMP_NUM_THREADS that is not a count ("abc", "", 0) is refused too: libgomp warned and ran a thread per core in
# every rank (train.py does not check it).
# Spaces around a value are dropped, as make's $(filter) drops them from PRESET: NPROC="2 " reaches torchrun unquoted
# (2 ranks) and libgomp reads OMP_NUM_THREADS=" 1 " as 1, so refusing them would refuse what runs.
train-settings:
	@$(if $(filter-out $(PRESETS),$(PRESET))$(filter-out 1,$(words $(PRESET))),echo $(call quote,error: \
		PRESET=$(PRESET) is not a preset; use one of: $(PRESETS)) >&2; exit 2,true)
	@$(if $(ISAAC),[ -x $(call quote,$(ISAACLAB_VENV))/bin/torchrun ] || { echo $(call quote,error: PRESET=isaaclab \
		runs in $(ISAACLAB_VENV)/bin/torchrun; it is not there: make setup-isaaclab first (docs/simulators.md)) \
		>&2; exit 2; },true)
	@case $(call quote,$(strip $(NPROC))) in ''|*[!0-9]*|0*) \
		echo $(call quote,error: NPROC=$(strip $(NPROC)) must be a positive number of ranks) >&2; exit 2;; esac
	@n=$(call quote,$(strip $(NPROC))); c=$$(getconf _NPROCESSORS_ONLN 2>/dev/null || nproc 2>/dev/null); \
	if [ -n "$$c" ] && { [ $${#n} -gt 6 ] || [ "$$n" -gt $$((4 * c)) ]; }; then echo "error: NPROC=$$n is more" \
		"ranks than this machine can host: at most 4 per CPU core ($$c cores, so NPROC=$$((4 * c)))" >&2; exit 2; fi
	@case $(call quote,$(strip $(OMP_NUM_THREADS))) in ''|*[!0-9]*|0*) echo $(call quote,error: \
		OMP_NUM_THREADS=$(strip $(OMP_NUM_THREADS)) must be a positive number of threads (or unset: 1)) >&2; exit 2;; esac

test: $(VENV)/.dev  ## run the whole test suite
	$(BIN)/python -m pytest -q tests

test-fast: $(VENV)/.dev  ## run the quick subset (no slow multi-rank or learning tests)
	$(BIN)/python -m pytest -q -m "not slow" tests

bench: $(VENV)/.dev  ## training throughput vs RSL-RL (rsl-rl-lib, from requirements-dev.txt), then bench-grad and bench-rollout (ARGS=--quick: all three)
	$(BIN)/python bench/bench_train.py $(value ARGS)
	$(MAKE) bench-grad
	$(MAKE) bench-rollout

bench-grad: $(VENV)/.runtime  ## gradient sync: flat | bucketed vs DDP vs a raw all-reduce, 2 gloo ranks (ARGS=--quick)
	$(BIN)/python bench/bench_grad_sync.py $(value ARGS)

bench-sync: $(VENV)/.dev  ## weight sync: patch vs bucket vs naive dist.send (~10 s on 2 cores; ARGS=--quick: ~3 s)
	$(BIN)/python bench/bench_sync.py $(value ARGS)

bench-rollout: $(VENV)/.dev  ## rollout ranks: colocated vs 1 + 1 sync/async, weight-sync bytes, learning (~1 h; ARGS=--quick)
	$(BIN)/python bench/bench_rollout.py $(value ARGS)

bench-mujoco: $(VENV)/.mujoco  ## mujoco preset vs CleanRL: 3 tasks x 3 seeds x {1,2} ranks, 1M steps (hours); ARGS="--tasks Hopper-v4 --jobs 2"
	$(BIN)/python bench/bench_mujoco.py $(value ARGS)

# What bench/gpu_check.sh needs beyond the GPU machine's own packages (it has torch, numpy, tensorboard,
# onnx): tyro and rsl-rl-lib with their pure-Python needs, as Python 3.12 wheels to carry there (typing-extensions
# too: tyro and typeguard need >= 4.13 and 4.14, and the version there is not known).
GPU_WHEELS := tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 rsl-rl-lib==5.5.1 tensordict==0.15.3 \
	pyvers==0.2.3 GitPython==3.2.1 gitdb==4.0.12 smmap==5.0.3 typing-extensions==4.16.0
gpu-wheels: $(BIN)/python  ## download the wheels bench/gpu_check.sh installs on a bare GPU machine into .whl/
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS)

setup-mujoco: $(VENV)/.mujoco  ## gymnasium + MuJoCo into .venv for the gymnasium adapter (make test installs them too)

# A stamp, as .runtime: without it every `make bench-mujoco` (a bad ARGS too) ran pip before the bench could say so.
$(VENV)/.mujoco: $(VENV)/.runtime
	$(BIN)/pip install -q "gymnasium[mujoco]>=1.4,<1.5" 'mujoco>=4.0,<4.1; python_version >= "3.11"' \
		'mujoco>=3.3,<4; python_version < "3.11"'
	touch $@

setup-isaaclab:  ## Isaac Lab 3.0 in ../IsaacLab + its own Python 3.12 env .venv-isaaclab; ISAACSIM=1 adds Isaac Sim
	[ -d $(call quote,$(ISAACLAB_DIR)) ] || git clone --branch $(ISAACLAB_REF) https://github.com/isaac-sim/IsaacLab.git \
		$(call quote,$(ISAACLAB_DIR))
	[ -x $(call quote,$(ISAACLAB_VENV))/bin/python ] || python3.12 -m venv $(call quote,$(ISAACLAB_VENV))
	$(call quote,$(ISAACLAB_VENV))/bin/pip install -q --upgrade pip
	if [ "$(ISAACSIM)" = 1 ]; then $(call quote,$(ISAACLAB_VENV))/bin/pip install \
		"isaacsim[all,extscache]==$(ISAACSIM_VERSION)" --extra-index-url https://pypi.nvidia.com; fi
	. $(call quote,$(if $(filter /%,$(ISAACLAB_VENV)),$(ISAACLAB_VENV),$(CURDIR)/$(ISAACLAB_VENV)))/bin/activate && cd $(call quote,$(ISAACLAB_DIR)) && ./isaaclab.sh --install
	$(call quote,$(ISAACLAB_VENV))/bin/pip install -q -r requirements.txt

# Before the prerequisites: a missing CKPT is said before .venv is built.
export: export-needs-ckpt $(VENV)/.runtime  ## policy of CKPT=runs/.../model_N.pt as TorchScript and torch.export (+ ONNX if onnx, onnxscript are installed)
	$(BIN)/python -m ppo.export $(call quote,$(value CKPT)) $(value ARGS)

export-needs-ckpt:
	@$(if $(value CKPT),true,echo "error: make export needs CKPT=path/to/model_<iteration>.pt" >&2; exit 2)

# An Isaac Lab checkpoint (PRESET=isaaclab) is scored in Isaac Lab's environment, as make train runs it there.
eval: eval-needs-ckpt $(if $(ISAAC),,$(VENV)/.runtime)  ## score CKPT=runs/.../model_N.pt in its env: mean return and length (ARGS="--episodes 100 --stochastic"; Isaac Lab: PRESET=isaaclab)
	$(if $(ISAAC),$(call quote,$(ISAACLAB_VENV))/bin,$(BIN))/python -m ppo.evaluate $(call quote,$(value CKPT)) $(value ARGS)

eval-needs-ckpt:
	@$(if $(value CKPT),true,echo "error: make eval needs CKPT=path/to/model_<iteration>.pt" >&2; exit 2)
	@$(if $(ISAAC),[ -x $(call quote,$(ISAACLAB_VENV))/bin/python ] || { echo $(call quote,error: PRESET=isaaclab \
		evaluates in $(ISAACLAB_VENV)/bin/python; it is not there: make setup-isaaclab first (docs/simulators.md)) \
		>&2; exit 2; },true)

# Before the prerequisites, as train-settings: a bad PORT or LOGDIR is said before .venv is built.
tensorboard: tensorboard-settings $(VENV)/.runtime  ## serve LOGDIR=runs (your --log.root) on PORT=6006
	$(BIN)/tensorboard --logdir $(call quote,$(value LOGDIR)) --port $(PORT)

tensorboard-settings:
	@case $(call quote,$(PORT)) in ''|*[!0-9]*|0*|??????*) false;; *) [ $(PORT) -le 65535 ];; esac || \
		{ echo $(call quote,error: PORT=$(PORT) must be a port number from 1 to 65535) >&2; exit 2; }
	@[ -d $(call quote,$(value LOGDIR)) ] || { echo $(call quote,error: LOGDIR=$(value LOGDIR) is not a folder: \
		train first (make train) or set LOGDIR to a run's --log.root) >&2; exit 2; }

clean:  ## remove caches (keeps .venv and runs/: checkpoints are never deleted by make)
	rm -rf .pytest_cache
	find . -name __pycache__ -not -path "./.venv*" -prune -exec rm -rf {} +
