"""Applies the mutant named in ``SHMQ_MUTANT`` (``tests/mutants``) in every Python process
started with this folder on ``PYTHONPATH``: the test run, the brokers it starts, their
workers and every child.  ``tests/test_mutants.py`` sets both."""

import os
import sys

if os.environ.get("SHMQ_MUTANT"):
    from tests.mutants import apply

    apply(os.environ["SHMQ_MUTANT"])
    print(f"shmq mutant {os.environ['SHMQ_MUTANT']} applied in pid {os.getpid()}", file=sys.stderr)
