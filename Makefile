# Stable user interface of the stack. Every target that needs the environment builds it
# first (idempotent: .venv/.installed is rebuilt only when a requirements file changes).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# fbgemm build: the CUDA wheel where a GPU is visible, the CPU build elsewhere.
FBGEMM ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo fbgemm-gpu==1.8.0 || echo fbgemm-gpu-cpu==1.8.0)

PRESET ?= demo
RUN ?= runs/$(PRESET)
NPROC ?= 2
DATA ?=
ARGS ?=
PYTEST_ARGS ?=
FORMATS ?=
ROWS ?= 10
USERS ?= 4
SPAWN_RATE ?= 4
DURATION ?= 30s
STAMP := $(shell date +%Y%m%d-%H%M%S)
OUT ?= reports/$(STAMP)
LOADTEST_ARGS ?=
NAME ?=
VERSION ?=
CHECKPOINT ?=

.PHONY: setup lock train export serve stop score loadtest demo bench test lint fmt clean help
help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' \
	  '{ n[NR] = $$1; d[NR] = $$2; if (length($$1) > w) w = length($$1) } \
	  END { for (i = 1; i <= NR; i++) printf "  %-*s  %s\n", w, n[i], d[i] }'

setup: $(VENV)/.installed  ## create .venv from requirements/lock.txt (CPU fbgemm, or CUDA where a GPU is visible)

# requirements/lock.txt pins the whole resolved set with hashes (pip refuses anything else),
# except the three packages whose build depends on the device (see pyproject.toml): torch (the
# CPU wheel on this machine's disk, or PyPI's CUDA build with its nvidia-* libraries), fbgemm
# (fbgemm-gpu-cpu or fbgemm-gpu) and torchrec (--no-deps: it declares the CUDA fbgemm wheel).
# On a machine without a GPU they are hash-pinned too (requirements/device-cpu.txt); on CUDA
# they are pinned by version here. On CPU torch's own requirements are already in the lock.
TORCH_PINS := torch==2.13.0 torchrec==1.8.0
DEVICE_REQS := $(if $(filter fbgemm-gpu-cpu%,$(FBGEMM)),requirements/device-cpu.txt)
$(VENV)/.installed: requirements/lock.txt requirements/device-cpu.txt pyproject.toml serving/gateway/_fastwire.c
	@echo "setup: installing the locked environment into $(VENV) (first run, or a changed requirements file: about 2 GB, a few minutes; later runs skip this)" >&2
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --require-hashes --no-deps -r requirements/lock.txt
	$(if $(DEVICE_REQS),$(PY) -m pip install -q --require-hashes --no-deps -r $(DEVICE_REQS),\
	  $(PY) -m pip install -q $(word 1,$(TORCH_PINS)) $(FBGEMM) && \
	  $(PY) -m pip install -q --no-deps $(word 2,$(TORCH_PINS)))
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -c "import torch, fbgemm_gpu, torchrec; print('torch', torch.__version__, 'torchrec', torchrec.__version__)"
	$(PY) -m serving.protos
	touch $@

# Locks: everything (make setup), and each image's own set: the torch images (trainer,
# torchserve: train + serve, no dev tools), the gateway (serve) and locust (load). The image
# locks are resolved under lock.txt (-c): the same versions and hashes as the venv the suite tests.
UV_COMPILE = $(VENV)/bin/uv pip compile --generate-hashes --find-links /opt/wheels --python-version 3.11 \
	--python-platform x86_64-manylinux_2_28 --no-emit-package recsys-stack --no-emit-package torch \
	--custom-compile-command "make lock" pyproject.toml
# The Flink joiner's environment is resolved on its own (requirements/flink.in): PyFlink pins
# protobuf 5, grpcio 1.65 and pandas apart from the training/serving lock.
FLINK_COMPILE = $(VENV)/bin/uv pip compile --generate-hashes --find-links /opt/wheels --python-version 3.11 \
	--python-platform x86_64-manylinux_2_28 --custom-compile-command "make lock" \
	requirements/flink.in -o requirements/flink.lock.txt
lock:  ## re-resolve requirements/*.lock.txt from pyproject.toml's ranges and requirements/flink.in (uv)
	$(UV_COMPILE) --all-extras -o requirements/lock.txt
	$(UV_COMPILE) --extra train --extra serve -c requirements/lock.txt -o requirements/torch.lock.txt
	$(UV_COMPILE) --extra serve -c requirements/lock.txt -o requirements/serve.lock.txt
	$(UV_COMPILE) --extra load -c requirements/lock.txt -o requirements/load.lock.txt
	$(FLINK_COMPILE)

TRAIN_ARGS = --config training/configs/$(PRESET).toml --run-dir $(RUN) $(if $(DATA),--data $(DATA)) $(ARGS)

train: setup  ## train PRESET (tiny|demo|criteo-kaggle) with NPROC processes into RUN; DATA=<tsv file|dir> for real data
	@# One process first: bad config/data/checkpoint fails here with one line, and the data is
	@# generated and preprocessed once with a progress bar; then the process group trains.
	$(PY) -m training.train --prepare-only --world-size $(NPROC) $(TRAIN_ARGS)
	@# torchrun through training.launch: on Ctrl-C, rank 0's one line (what survived, how to
	@# resume) instead of torchrun's traceback.
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m training.launch --standalone --nproc_per_node=$(NPROC) \
		-m training.train $(TRAIN_ARGS)

# Hyperparameter search (training/sweep, docs/training.md "Sweeps"): trials of PRESET, each a real
# training run on the validation AUC, in SWEEP_DIR (its study.journal, trial_NNNN/, report.md,
# trials.png, best.toml). TRIALS: the study's total (the same command continues it), TIMEOUT:
# seconds for this invocation; SWEEP_ARGS: more options (--parallel 2, --threads-per-trial 2,
# --storage URL) and training overrides every trial gets (train.max_steps=500).
SWEEP_DIR ?= runs/sweep-$(PRESET)
TRIALS ?=
TIMEOUT ?=
SWEEP_ARGS ?=
SWEEP_CMD = $(PY) -m training.sweep --preset $(PRESET) --out $(SWEEP_DIR) $(if $(TRIALS),--trials $(TRIALS)) \
	$(if $(TIMEOUT),--timeout $(TIMEOUT)) $(if $(DATA),--data $(DATA)) $(SWEEP_ARGS)
.PHONY: sweep sweep-slurm
sweep: setup  ## search PRESET's hyperparameters (Optuna TPE + pruning) on validation AUC into SWEEP_DIR [TRIALS= TIMEOUT= SWEEP_ARGS=]: report.md, trials.png, best.toml; rerun to continue
	$(SWEEP_CMD)

# The same sweep spread over TASKS Slurm array tasks (deploy/slurm/sweep.sbatch): each runs trials
# of the one study, its journal in SWEEP_DIR on storage every node sees.
TASKS ?= 2
sweep-slurm: setup  ## sbatch the sweep of PRESET as TASKS array tasks sharing SWEEP_DIR's study (Slurm) [TRIALS= TIMEOUT= SWEEP_ARGS= SBATCH_ARGS=]
	@set -e; $(need_sbatch); mkdir -p $(SWEEP_DIR); \
	job=$$(PRESET=$(call shq,$(PRESET)) SWEEP_DIR=$(call shq,$(SWEEP_DIR)) TRIALS=$(call shq,$(TRIALS)) \
	  TIMEOUT=$(call shq,$(TIMEOUT)) DATA=$(call shq,$(DATA)) SWEEP_ARGS=$(call shq,$(SWEEP_ARGS)) \
	  PY=$(call shq,$(abspath $(PY))) sbatch --parsable --array=0-$$(($(TASKS) - 1)) \
	  --output=$(SWEEP_DIR)/slurm-%A_%a.out $(SBATCH_ARGS) deploy/slurm/sweep.sbatch); job=$${job%%;*}; \
	echo "submitted sweep job array $$job ($(TASKS) tasks): squeue -j $$job; logs $(SWEEP_DIR)/slurm-$${job}_<task>.out; report $(SWEEP_DIR)/report.md"

# Multi-node: the same command on every node, RUN and the data caches on storage they all see.
# NODE_RANK=0 on the node RDZV_ENDPOINT names (its torchrun hosts the rendezvous store), 1.. on
# the others; the c10d rendezvous numbers the ranks itself. Each node's --prepare-only waits on
# the data's lock files while the first one prepares, then reuses its cache. Without NODE_RANK,
# all NNODES nodes are launched here (a try-out; their lines prefixed [node N]).
NNODES ?= 2
NODE_RANK ?=
RDZV_ENDPOINT ?= 127.0.0.1:29400
RDZV_ID ?= $(PRESET)
RDZV_TIMEOUT ?= 600
torchrun_node = OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m training.launch --nnodes=$(NNODES) \
	--nproc_per_node=$(NPROC) --rdzv_backend=c10d --rdzv_endpoint=$(RDZV_ENDPOINT) \
	--rdzv_id=$(RDZV_ID) --rdzv_conf=join_timeout=$(RDZV_TIMEOUT),is_host=$(1) -m training.train $(TRAIN_ARGS)

.PHONY: train-multinode
train-multinode: setup  ## train PRESET on NNODES nodes x NPROC: on each, NODE_RANK=0.. RDZV_ENDPOINT=<node 0>:<port> (no NODE_RANK: all nodes here)
	$(PY) -m training.train --prepare-only --world-size $$(($(NNODES) * $(NPROC))) $(TRAIN_ARGS)
ifneq ($(NODE_RANK),)
	$(call torchrun_node,$(if $(filter 0,$(NODE_RANK)),1,0))
else
	@pids=(); for n in $$(seq 0 $$(($(NNODES) - 1))); do \
	  (set -o pipefail; $(call torchrun_node,$$((n == 0))) 2>&1 | sed -u "s/^/[node $$n] /") & \
	  pids+=($$!); \
	done; rc=0; for p in "$${pids[@]}"; do wait $$p || rc=$$?; done; exit $$rc
endif

# Slurm (deploy/slurm/*.sbatch, docs/deploy.md "Slurm"): the variables of `make train` plus
# NNODES (one torchrun per node, NPROC processes each), SHARES (first a job array of SHARES
# tasks that preprocess the input, the training job after it: --dependency=afterok),
# SBATCH_ARGS (sbatch's own for the training job: --partition, --time, --cpus-per-task,
# --gres ...) and PREPARE_SBATCH_ARGS (the same for the array's tasks). Run from the
# repository on storage every node sees; each prints its job ids. Submitted again (after a
# scancel, a failure, a preemption), the training job resumes RUN/checkpoints/latest.
SHARES ?=
SBATCH_ARGS ?=
PREPARE_SBATCH_ARGS ?=
SLURM_VARS := PRESET RUN DATA ARGS NPROC RDZV_TIMEOUT
shq = '$(subst ','\'',$(1))'
sbatch_env = $(foreach v,$(SLURM_VARS),$(v)=$(call shq,$($(v)))) PY=$(call shq,$(abspath $(PY)))
need_sbatch = command -v sbatch >/dev/null || { echo "error: no sbatch here: run this on a Slurm \
  login node (or 'make slurm-deps' for a one-node cluster on this machine)" >&2; exit 1; }; mkdir -p $(RUN)
submit_prepare = prep=$$($(sbatch_env) sbatch --parsable --array=0-$$(($(SHARES) - 1)) \
  --output=$(RUN)/slurm-prepare-%A_%a.out $(PREPARE_SBATCH_ARGS) deploy/slurm/prepare.sbatch); prep=$${prep%%;*}; \
  echo "submitted preprocessing job array $$prep ($(SHARES) tasks): squeue -j $$prep; logs $(RUN)/slurm-prepare-$${prep}_<task>.out"
.PHONY: train-slurm prepare-slurm
train-slurm: setup  ## sbatch training of PRESET on NNODES nodes x NPROC into RUN (Slurm; SHARES=N: preprocess as an N-task job array first); prints the job id
	@set -e; $(need_sbatch); dep=""; \
	$(if $(SHARES),$(submit_prepare); dep="--dependency=afterok:$$prep --kill-on-invalid-dep=yes";) \
	job=$$($(sbatch_env) sbatch --parsable --nodes=$(NNODES) $$dep --output=$(RUN)/slurm-%j.out \
	  $(SBATCH_ARGS) deploy/slurm/train.sbatch); job=$${job%%;*}; \
	echo "submitted training job $$job ($(NNODES) nodes x $(NPROC)$(if $(SHARES), after $$prep)): squeue -j $$job; log $(RUN)/slurm-$$job.out; scancel $$job stops it, the same command resumes"

prepare-slurm: setup  ## sbatch preprocessing of PRESET's input (DATA) as a job array of SHARES tasks (Slurm; then make train-slurm merges); prints the job id
	@set -e; $(if $(SHARES),,echo "error: SHARES=N: how many array tasks share the input" >&2; exit 2;) \
	$(need_sbatch); $(submit_prepare)

# A one-node Slurm cluster on this machine (deploy/slurm/local-cluster.sh: Debian's slurm-wlm
# and munge, installed with apt when missing; /etc/slurm/slurm.conf for this host), and the
# tests that submit to it (tests/slurm; not part of `make test`). `make slurm-down` stops it.
.PHONY: slurm-deps slurm-down slurm-test
slurm-deps:  ## install (apt), configure and start a one-node Slurm here (munged, slurmctld, slurmd); waits until the node is idle
	@bash deploy/slurm/local-cluster.sh up

slurm-down:  ## stop the daemons make slurm-deps started
	@bash deploy/slurm/local-cluster.sh down

slurm-test: setup slurm-deps  ## sbatch the tiny preset on the local Slurm (2 tasks as 2 torchrun nodes, a 2-task preprocessing array, scancel + resume)
	$(PY) -m pytest tests/slurm $(PYTEST_ARGS)

# The continuous loop: RUN's latest checkpoint, then every file of DATA_DIR not consumed yet
# (name order; a file appears by rename: *.tmp and dot-files are never read); FOLLOW=1 polls.
# PRESET's config only for a run with no checkpoint and no --resume in CONTINUOUS_ARGS: a
# checkpoint brings its own (the model's shape must stay that of the weights it holds).
DATA_DIR ?=
FOLLOW ?=
CONTINUOUS_ARGS ?=
.PHONY: continuous
continuous: setup  ## keep RUN fresh on the click logs of DATA_DIR: score each file (RUN/progressive.jsonl), export + roll out the model before it judged on it, train a pass [FOLLOW=1]
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) \
		-m training.continuous --run-dir $(RUN) --data-dir $(DATA_DIR) $(if $(FOLLOW),--follow) \
		$(if $(or $(wildcard $(RUN)/checkpoints/latest),$(findstring --resume,$(CONTINUOUS_ARGS))),,--config training/configs/$(PRESET).toml) $(CONTINUOUS_ARGS)

export: setup  ## export RUN's latest checkpoint (CHECKPOINT=best: the best by held-out AUC): mapped int8/fp16/fp32 tables (FORMATS='["int8","onnx"]' to choose), parity, .mar
	$(PY) -m training.export --run-dir $(RUN) $(if $(FORMATS),--formats '$(FORMATS)') $(if $(NAME),--name $(NAME)) \
		$(if $(VERSION),--version $(VERSION)) $(if $(CHECKPOINT),--checkpoint $(CHECKPOINT)) $(EXPORT_ARGS)

serve: setup  ## start TorchServe + the gRPC gateway for RUN's export in the background; waits until SERVING
	$(PY) -m serving.tools.supervisor start --gateway.schema $(RUN)/export/schema.json $(SERVE_ARGS)

stop:  ## stop the gateway (gracefully) and TorchServe
	@if [ -x $(PY) ]; then $(PY) -m serving.tools.supervisor stop $(SERVE_ARGS); fi

# The supervisor exits 3 when nothing runs (for scripts); here that is an answer, not a failure.
.PHONY: status
status:  ## what `make serve` started: TorchServe's READY workers, the gateway's health ("not running": exit 0)
	@if [ ! -x $(PY) ]; then echo "not running (no $(VENV) yet: make setup)"; exit 0; fi; \
	$(PY) -m serving.tools.supervisor status $(SERVE_ARGS); code=$$?; [ $$code -eq 3 ] || exit $$code

# Without DATA, the score/evaluate/rollout tools take the rows the model never trained on
# (recorded in its schema.json: a batch run's held-out split, a continuous run's next file) and
# refuse when there are none or that data is gone or changed.
# not echoed: stdout is the scores alone (`make score > scores.tsv`; which rows: on stderr)
score: setup  ## score ROWS rows of DATA (Criteo TSV; default: the served model's unseen rows) through the gateway: "row<TAB>probability" lines on stdout
	@$(PY) -m serving.tools.client --rows $(ROWS) $(if $(DATA),--data $(DATA))

loadtest: setup  ## headless Locust against the gateway: USERS, SPAWN_RATE, DURATION, OUT; report + summary.json + PNG; exit 3 when > 1% of calls fail
	$(PY) -m loadtest.run --users $(USERS) --spawn-rate $(SPAWN_RATE) --duration $(DURATION) --out $(OUT) $(LOADTEST_ARGS)

# The Flink joiner (streaming/, docs/online.md "The joiner"), in an environment of its own:
# .venv-flink from requirements/flink.lock.txt (hash-pinned; PyFlink 2.3 with its 329 MB of
# jars, about 850 MB in all, 2 minutes the first time; a marker file makes later runs skip it).
FLINK_VENV ?= .venv-flink
.PHONY: flink-setup joiner
flink-setup: $(FLINK_VENV)/.installed  ## create .venv-flink (PyFlink 2.3, Java 17 runs its MiniCluster) from requirements/flink.lock.txt
$(FLINK_VENV)/.installed: requirements/flink.lock.txt
	@echo "flink-setup: installing PyFlink into $(FLINK_VENV) (first run, or a changed lock: about 850 MB, 2 minutes; later runs skip this)" >&2
	$(PYTHON) -m venv $(FLINK_VENV)
	$(FLINK_VENV)/bin/python -m pip install -q --require-hashes --no-deps -r requirements/flink.lock.txt
	$(FLINK_VENV)/bin/python -c "import pyflink.version as v; print('pyflink', v.__version__)"
	touch $@

# LOGDIR: the gateway's feature log (impressions/, clicks/); OUT: the continuous loop's input
# folder (make continuous DATA_DIR=...; default runs/online/inbox); WINDOW: seconds W;
# JOINER_STATE: checkpoints, staging, the mover's state, the manifest joined.jsonl (keep it:
# a restart resumes from it). JOINER_ARGS: more flags (JOINER_ARGS=--help lists them).
LOGDIR ?= runs/serve/feature_log
WINDOW ?=
JOINER_STATE ?= runs/online/joiner
JOINER_ARGS ?=
joiner: flink-setup  ## the Flink joiner on a local MiniCluster: LOGDIR's impressions + clicks -> labelled TSV files in OUT (default runs/online/inbox), exactly once [WINDOW= JOINER_STATE= JOINER_ARGS=--help]
	PYTHONPATH=$(CURDIR) $(FLINK_VENV)/bin/python -m streaming.joiner --logdir $(LOGDIR) \
		--out $(if $(filter file,$(origin OUT)),runs/online/inbox,$(OUT)) --state $(JOINER_STATE) \
		$(if $(WINDOW),--window $(WINDOW)) $(JOINER_ARGS)

# The closed loop (issue 49, docs/online.md): a first model, the stack with its feature log on,
# simulated users and clicks, the Flink joiner, make continuous with deltas, until Ctrl-C (or
# ONLINE_ARGS=--duration 10m), then its figures in reports/online/report.json.
ONLINE_ARGS ?=
.PHONY: demo-online
demo-online: setup flink-setup  ## serve -> simulated traffic + clicks -> Flink join -> continuous training with deltas -> served, until Ctrl-C; figures in reports/online [ONLINE_ARGS=--help]
	$(PY) -m loadtest.online_demo $(ONLINE_ARGS)

.PHONY: chaos
CHAOS_ARGS ?=
chaos: setup  ## RUN's export on 2 replicas + gateway under Locust, a fault every 20 s for 2 min: OUT (default reports/chaos-<time>)/report.json, chaos.png
	$(PY) -m loadtest.chaos --gateway.schema $(RUN)/export/schema.json \
		--out $(if $(filter file,$(origin OUT)),reports/chaos-$(STAMP),$(OUT)) $(CHAOS_ARGS)

.PHONY: rollout rollback
ROLLOUT_ARGS ?=
EVAL_DATA ?= $(DATA)
rollout: setup  ## roll VERSION out on the running stack: register, evaluate vs the default on EVAL_DATA (default: VERSION's unseen rows), 5->50->100%, promote, drain
	$(PY) -m serving.tools.rollout $(if $(VERSION),--version $(VERSION)) $(if $(EVAL_DATA),--eval-data $(EVAL_DATA)) $(ROLLOUT_ARGS)

rollback: setup  ## return the running stack to the previous default version (no failed request)
	$(PY) -m serving.tools.rollout --rollback $(ROLLOUT_ARGS)

.PHONY: evaluate
evaluate: setup  ## score labelled rows (DATA; default: the served version's unseen rows) through the gateway [VERSION=]: AUC, NE, log loss, calibration -> OUT (JSON + PNG)
	$(PY) -m serving.tools.evaluate $(if $(DATA),--data $(DATA)) $(if $(VERSION),--version $(VERSION)) --out $(OUT) $(EVALUATE_ARGS)

demo: setup  ## everything on the embedded default: train -> export -> serve -> score -> load test -> stop
	$(MAKE) --no-print-directory train PRESET=demo
	$(MAKE) --no-print-directory export PRESET=demo EXPORT_ARGS=--overwrite
	@set -e; trap '$(MAKE) --no-print-directory stop' EXIT; \
	  $(MAKE) --no-print-directory serve PRESET=demo SERVE_ARGS="--from-export $(SERVE_ARGS)"; \
	  $(MAKE) --no-print-directory score PRESET=demo ROWS=5; \
	  $(MAKE) --no-print-directory loadtest DURATION=20s OUT=$(OUT) \
	    LOADTEST_ARGS="--calibrate --slo-failure-ratio 0 $(LOADTEST_ARGS)"; \
	  echo "report: $(OUT)/report.html  $(OUT)/latency.png  $(OUT)/summary.json"

# torch alone: runs on a CUDA machine with the repository copied and no venv
# (make gpu-check PY=python3), as the mapped fp16 tables (and the portable formats) allow.
.PHONY: gpu-check
gpu-check:  ## load RUN's export (mapped fp16/fp32, portable if written) on CUDA (CPU half without one), parity + handler + latency
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m serving.tools.gpu_check --export $(RUN)/export $(GPU_CHECK_ARGS)

bench: setup  ## training (trainer vs DMP ceiling vs plain PyTorch) and serving (in-process floor, plain TorchServe, TorchServe gRPC, gateway) ratios
	$(PY) -m training.bench $(ARGS)
	$(PY) -m serving.bench $(SERVING_BENCH_ARGS)

.PHONY: bench-scale
SCALE_STAGES ?= serving training
bench-scale: setup  ## export/serving vs table size (SCALE_ARGS), preprocessing + training at the Kaggle shape (SCALE_TRAIN_ARGS): reports/bench-scale/ [SCALE_STAGES=serving|training]
	$(if $(filter serving,$(SCALE_STAGES)),$(PY) -m serving.bench.scale $(SCALE_ARGS))
	$(if $(filter training,$(SCALE_STAGES)),$(PY) -m training.bench.scale $(SCALE_TRAIN_ARGS))

# Issues 36, 47: end of a training pass -> every worker serving it, through the continuous loop
# (make continuous with deltas, 2 replicas x 2 workers under Locust): reports/bench-freshness/.
.PHONY: bench-freshness
FRESHNESS_ARGS ?=
bench-freshness: setup  ## the continuous loop's deltas on a served stack under Locust, demo and criteo-kaggle: freshness p50/max, rows, bytes, failed calls, changed-ids check [FRESHNESS_ARGS]
	$(PY) -m loadtest.freshness $(FRESHNESS_ARGS)

# A replica's start, quiet and beside a 2-process CPU hog: phases from TorchServe's log (JVM up,
# worker spawned, handler loaded, READY, first call): reports/bench-ready/.
.PHONY: bench-ready
READY_ARGS ?= --store demo=model_store
bench-ready: setup  ## a replica's start to its first answered call, quiet vs beside a CPU hog, by phase (reports/bench-ready/) [READY_ARGS: --store L=DIR, --kaggle DIR]
	$(PY) -m serving.bench.ready $(READY_ARGS)

# Issue 45: one client's abuse must cost another client nothing. A legitimate client measured
# alone, then beside each abuser in turn (another tenant's largest requests, calls without a
# token, idle TLS connections past the gateway's open-files limit, /metrics scrapes, JSON bombs,
# malformed HTTP, plaintext to the TLS port): reports/bench-isolation/.
.PHONY: bench-isolation
ISOLATION_ARGS ?=
bench-isolation: setup  ## legit client alone vs beside 8 abusers: success %, p99/alone, log growth, gateway RSS (reports/bench-isolation/) [ISOLATION_ARGS]
	$(PY) -m serving.bench.isolation $(ISOLATION_ARGS)

# The suite in TEST_WORKERS parallel pytest-xdist workers (most tests wait on processes they
# started: TorchServe, torchrun, Locust; 3 on 2 cores overlap those waits). TEST_WORKERS=0: one
# process.
TEST_WORKERS ?= 3
test: test-deps setup flink-setup  ## the CI suite (CPU, real torchrun process groups, real compose/Prometheus)
	$(PY) -m pytest $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) --ignore=tests/containers --ignore=tests/slurm $(PYTEST_ARGS)

# The stack in real containers (tests/containers: docker-compose over podman's socket, podman kube
# play): the images built first (make images keeps the layers under its tagged images, so a rebuild
# is quick; only the gateway's two build stages are redone: docs/deploy.md).
.PHONY: compose-test
compose-test: setup container-deps images  ## the compose stack (and the k8s manifests) run for real in podman containers
	$(PY) -m pytest tests/containers $(PYTEST_ARGS)

# System tools the suite runs for real: docker-compose (tests/deploy validates the compose file
# with `docker-compose config`, no engine needed), prometheus (it scrapes the live stack) and gcc
# (setup, run after this, builds the gateway's native decoder; the suite tests it and its twin).
# Installed with apt when missing (as root, or with passwordless sudo); otherwise the target
# fails with the command to run: the suite never skips them.
TEST_TOOLS := docker-compose prometheus gcc
.PHONY: test-deps
test-deps:  ## install the system tools the suite needs (apt: docker-compose, prometheus, gcc)
	@missing=""; for t in $(TEST_TOOLS); do command -v $$t >/dev/null || missing="$$missing $$t"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" -eq 0 ]; then sudo_=""; elif sudo -n true 2>/dev/null; then sudo_="sudo"; \
	else echo "error: the test suite needs$$missing: run 'sudo apt-get install -y$$missing'" >&2; exit 1; fi; \
	echo "installing$$missing (apt)"; \
	$$sudo_ apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo_ apt-get install -y -qq$$missing >/dev/null

lint: setup  ## ruff + mypy
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/mypy training serving loadtest recsys_stack recsys_model streaming

fmt: setup
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

clean:  ## remove runs and caches (not the venv)
	rm -rf runs data/cache data/synthetic .pytest_cache

# Container images (docs/deploy.md, "Building the images with podman"): podman builds every
# image docker-compose.yml names from docker/Dockerfile, tagged as compose names them, on a
# machine with no image registry too (the base then comes from Debian packages: base-image).
IMAGE_TAG ?= latest
IMAGE_TARGETS ?= trainer torchserve gateway locust prometheus
IMAGE_BASE ?=
TORCH_INDEX ?= auto
MIRROR ?=
# 1: after a good build, remove the untagged images of docker/Dockerfile (build stages, replaced
# images; docs/deploy.md); 0 keeps them (the fastwire and gateway-venv stages stay cached).
IMAGE_PRUNE ?= 1
IMAGE_ENV = IMAGE_TAG='$(IMAGE_TAG)' IMAGE_TARGETS='$(IMAGE_TARGETS)' IMAGE_BASE='$(IMAGE_BASE)' \
	TORCH_INDEX='$(TORCH_INDEX)' MIRROR='$(MIRROR)' IMAGE_PRUNE='$(IMAGE_PRUNE)' $(if $(filter command line,$(origin FBGEMM)),FBGEMM='$(FBGEMM)')
.PHONY: container-deps base-image images
container-deps:  ## install podman, runc, debootstrap, docker-compose (apt) and podman's /etc/containers/containers.conf
	@bash docker/build_images.sh deps

base-image:  ## the Python base without a registry: debootstrap -> localhost/debian-min:bookworm -> localhost/recsys-python:3.11
	@$(IMAGE_ENV) nice -n 10 bash docker/build_images.sh base

images:  ## podman-build every compose image (IMAGE_TARGETS, tag IMAGE_TAG; IMAGE_BASE: python:3.11-slim or the local base), check, list sizes, remove the build stages [IMAGE_PRUNE=0 keeps them]
	@$(IMAGE_ENV) nice -n 10 bash docker/build_images.sh images

# The images to a registry, tagged by the project's version: REGISTRY/recsys-<name>:VERSION (the
# cluster overlay's names), one line per image with its digest, then the compose variables that
# run them (RECSYS_IMAGE_PREFIX=REGISTRY/recsys- RECSYS_IMAGE_TAG=VERSION). A local registry for
# trying it: Debian's docker-registry (make container-deps installs it; docs/deploy.md).
REGISTRY ?=
IMAGE_VERSION ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
REGISTRY_TLS_VERIFY ?= true
.PHONY: push
push:  ## tag and push IMAGE_TARGETS as REGISTRY/recsys-<name>:<project version>; prints each digest and compose's variables [REGISTRY_TLS_VERIFY=false for plain HTTP]
	@$(IMAGE_ENV) REGISTRY='$(REGISTRY)' VERSION='$(IMAGE_VERSION)' REGISTRY_TLS_VERIFY='$(REGISTRY_TLS_VERIFY)' \
	  bash docker/build_images.sh push
