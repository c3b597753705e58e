# make run  - install, then start the broker on its defaults
# make test - install, then lint, type-check and run the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: run test install lint bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[test,bench,spark]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/shmq serve

lint: $(STAMP)
	$(VENV)/bin/ruff check shmq server
	$(VENV)/bin/mypy shmq server

test: lint
	$(VENV)/bin/pytest -n 2 tests

bench: $(STAMP)
	$(PY) bench/bench_local.py
	$(PY) bench/bench_tcp.py
	$(PY) bench/bench_durability.py

clean:
	rm -rf $(VENV) build *.egg-info
