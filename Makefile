# make run  - install what the broker needs, then start it on its defaults
# make test - install everything (tests, benchmarks, Spark, Celery, Dramatiq), then lint, type-check and run the whole suite (CI)
# make check - the inner loop: lint, type-check and the tests not marked slow, spark or crash
# make bench - install, run the benchmarks, then the plot sweeps: bench/results/<date>-<host>.json
#              and its PNGs in bench/results/<date>-<host>/ (redraw: python bench/plot.py FILE), and
#              shmq against its peers (NATS, RabbitMQ, Redis Streams, ZeroMQ, iceoryx2):
#              bench/results/<date>-<host>-peers.json; a peer that cannot be installed is reported
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
BASE := $(VENV)/.installed-base
FULL := $(VENV)/.installed-full
PEERS := $(VENV)/.installed-peers

.PHONY: run test check install install-all java lint bench peers clean

$(VENV)/bin/python:
	python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# the broker alone: posix-ipc, typer, rich, psutil, prometheus-client
$(BASE): pyproject.toml setup.py shmq/_speedups.c shmq/_speedups_one.c shmq/_speedups.h | $(VENV)/bin/python
	$(PIP) install --quiet -e .
	touch $(BASE)

# everything: the broker, the test tools, the benchmarks' peers and plots, PySpark, Celery, Dramatiq
$(FULL): pyproject.toml setup.py shmq/_speedups.c shmq/_speedups_one.c shmq/_speedups.h | $(VENV)/bin/python
	$(PIP) install --quiet -e '.[test,bench,spark,celery,dramatiq]'
	touch $(FULL) $(BASE)

install: $(BASE)
install-all: $(FULL)

run: $(BASE)
	$(VENV)/bin/shmq serve

# PySpark runs on a JVM: stop at once, in one line, rather than fail the Spark tests a minute in
java:
	@v=$$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1); \
	if [ -z "$$v" ] || [ "$$v" -lt 17 ]; then \
	  echo "make test: the Spark tests need Java 17 or newer (found: $${v:-none}); install a JDK, e.g. apt-get install openjdk-17-jre-headless" >&2; \
	  exit 1; \
	fi

lint: $(FULL)
	$(VENV)/bin/ruff check shmq server tests bench
	$(VENV)/bin/mypy shmq tests bench  # server/ is checked as shmq.server, through the link shmq/server

test: java lint
	$(VENV)/bin/pytest -n 2 tests
	@# the pure-Python twins of the C accelerator (shmq/accel.py), on the paths it speeds up
	SHMQ_PURE=1 $(VENV)/bin/pytest -n 2 -q tests/core/test_speedups.py tests/core/test_queue.py tests/client/test_headers.py tests/crash/test_crashpoints.py \
		tests/core/test_rawread.py tests/core/test_put_joined.py

check: lint
	$(VENV)/bin/pytest -n 2 -m "not slow and not spark and not crash" tests

# bench_peers.py's peers: the PyPI ones, and Debian's rabbitmq-server where it is missing and apt-get
# is there (Debian may start its own service on install: stopped again, bench_peers starts its own);
# what fails is said here and reported by bench_peers.py as not measured, and the bench goes on
$(PEERS): pyproject.toml | $(FULL)
	@$(PIP) install --quiet -e '.[peers]' && touch $(PEERS) || \
	  echo "make bench: pip could not install the peers extra: bench_peers.py reports what is missing" >&2

peers: $(PEERS)
	@if [ ! -x /usr/lib/rabbitmq/bin/rabbitmq-server ] && command -v apt-get >/dev/null; then \
	  echo "make bench: installing Debian's rabbitmq-server"; \
	  if DEBIAN_FRONTEND=noninteractive apt-get install -y -q rabbitmq-server >/dev/null || \
	     { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q rabbitmq-server >/dev/null; }; then \
	    if pidof beam.smp >/dev/null; then rabbitmqctl -q stop >/dev/null 2>&1 || service rabbitmq-server stop >/dev/null 2>&1 || true; fi; \
	  else \
	    echo "make bench: apt-get install rabbitmq-server failed: RabbitMQ will be reported as not measured" >&2; \
	  fi; \
	fi

bench: $(FULL) peers
	$(PY) bench/bench_local.py
	$(PY) bench/bench_tcp.py
	$(PY) bench/bench_durability.py
	$(PY) bench/sweep.py
	$(PY) bench/bench_peers.py

clean:
	rm -rf $(VENV) build *.egg-info
