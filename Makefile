# longrun: `make test` and `make demo` work from a fresh clone (they set up .venv first).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
# most tests wait on the processes they start: two pytest processes keep a 2-core machine busy
TEST_PROCESSES ?= 2

.PHONY: setup test test-fast lint demo system-deps clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first, pinned, when none is present: a loose range would pull a multi-GB CUDA build
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "torch==$(TORCH_VERSION)"
	$(BIN)/pip install -q -e ".[dev,trainer,postgres]"
	$(BIN)/pip install -q --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
	touch $@

setup: $(VENV)/.installed

# the SSH and network tests need OpenSSH's server and iproute2; the browser tests (tests/web) Chromium; the tests
# on PostgreSQL its server (tests/postgres.py starts a throw-away cluster from Debian's binaries); the Slurm tests
# (tests/slurm.py starts a throw-away cluster) slurmctld, slurmd and munged
system-deps:
	@if [ -x /usr/sbin/sshd ] && command -v ip >/dev/null && command -v ssh-keygen >/dev/null && command -v chromium >/dev/null \
		&& ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 \
		&& [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && [ -x /usr/sbin/munged ] && command -v docker-compose >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server openssh-client iproute2 chromium postgresql slurm-wlm munge docker-compose >/dev/null; \
	else \
		echo "The SSH, browser, PostgreSQL and Slurm tests need OpenSSH's server, iproute2, Chromium, PostgreSQL, Slurm, munge and docker-compose: run 'sudo apt-get install openssh-server iproute2 chromium postgresql slurm-wlm munge docker-compose', then 'make test' again." >&2; exit 1; \
	fi

lint: setup
	$(BIN)/ruff check .

test: setup system-deps
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n $(TEST_PROCESSES) --dist loadgroup

# unit and in-process API tests only: no server, sshd or torchrun is started
test-fast: setup
	$(BIN)/python -m pytest -q -n $(TEST_PROCESSES) -m "not slow"

demo: setup
	$(BIN)/python examples/demo.py

clean:
	rm -rf .demo .pytest_cache
