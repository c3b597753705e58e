# make run  - install, then start the broker on its defaults
# make test - install, then lint, type-check and run the whole test suite (what CI runs)
# make check - the inner loop: lint, type-check and the tests not marked slow, spark or crash
# make bench - install, run the benchmarks, then the plot sweeps: bench/results/<date>-<host>.json
#              and its PNGs in bench/results/<date>-<host>/ (redraw: python bench/plot.py FILE)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: run test check install lint bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[test,bench,spark]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/shmq serve

lint: $(STAMP)
	$(VENV)/bin/ruff check shmq server tests bench
	$(VENV)/bin/mypy shmq server tests bench

test: lint
	$(VENV)/bin/pytest -n 2 tests

check: lint
	$(VENV)/bin/pytest -n 2 -m "not slow and not spark and not crash" tests

bench: $(STAMP)
	$(PY) bench/bench_local.py
	$(PY) bench/bench_tcp.py
	$(PY) bench/bench_durability.py
	$(PY) bench/sweep.py

clean:
	rm -rf $(VENV) build *.egg-info
