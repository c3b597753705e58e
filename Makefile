# make run  - install what the broker needs, then start it on its defaults
# make test - install everything (tests, benchmarks, Spark, Celery, Dramatiq), then lint, type-check and run the whole suite (CI)
# make check - the inner loop: lint, type-check and the tests not marked slow, spark or crash
# make bench - install, run the benchmarks, then the plot sweeps: bench/results/<date>-<host>.json
#              and its PNGs in bench/results/<date>-<host>/ (redraw: python bench/plot.py FILE)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
BASE := $(VENV)/.installed-base
FULL := $(VENV)/.installed-full

.PHONY: run test check install install-all java lint bench clean

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

bench: $(FULL)
	$(PY) bench/bench_local.py
	$(PY) bench/bench_tcp.py
	$(PY) bench/bench_durability.py
	$(PY) bench/sweep.py

clean:
	rm -rf $(VENV) build *.egg-info
