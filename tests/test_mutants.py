"""Each README promise's tests catch a plausible wrong version of the code (``tests/mutants``).

For every mutant, the tests that prove its promise run in a fresh pytest with the
mutant applied in every process (the brokers they start too) and the pure-Python twins
of the compiled stores (``SHMQ_PURE=1``): they must FAIL.  A mutant that survives names
a promise whose test proves nothing.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from shmq import mp
from shmq.core.cleanup import reclaim_dead
from tests.mutants import MUTANTS
from tests.support.instances import leftovers

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "tests" / "mutants" / "site"


def _run(name: str) -> subprocess.CompletedProcess[str]:
    m = MUTANTS[name]
    env = {**os.environ, "SHMQ_MUTANT": name, "SHMQ_PURE": "1",
           "PYTHONPATH": os.pathsep.join([str(SITE), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTEST_XDIST_WORKER", None)
    args = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:randomly", "-p", "no:cacheprovider",
            "-p", "no:xdist", *m.tests]
    with subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as p:
        try:
            out, err = p.communicate(timeout=600)
        finally:
            _clean_after(p)
    return subprocess.CompletedProcess(args, p.returncode, out, err)


def _clean_after(p: subprocess.Popen[str]) -> None:
    """A mutant breaks what cleans up too (a reclaim that takes live instances, say): what
    that run left, its instances' names starting with its session's prefix, goes now."""
    if p.poll() is None:
        p.kill()
        p.wait()
    prefix = f"t{p.pid}x"  # (tests.support.instances.SESSION_PREFIX of that pytest)
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(prefix in a for a in proc.info["cmdline"] or ()):
                proc.kill()
    for n in leftovers(prefix):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join("/dev/shm", n))
    reclaim_dead(mp.INSTANCE_PREFIX)  # shmq.mp queues a mutant left (live ones are kept)


def _caught(name: str) -> None:
    r = _run(name)
    out = r.stdout + r.stderr
    assert f"shmq mutant {name} applied" in r.stderr, out[-3000:]
    assert r.returncode == 1 and " failed" in r.stdout, (
        f"mutant {name!r} survived ({MUTANTS[name].promise}): exit {r.returncode}\n{out[-3000:]}")


@pytest.mark.parametrize("name", [n for n, m in MUTANTS.items() if not m.slow])
def test_a_mutant_of_the_promise_is_caught(name: str) -> None:
    _caught(name)


@pytest.mark.crash
@pytest.mark.parametrize("name", [n for n, m in MUTANTS.items() if m.slow])
def test_a_mutant_of_a_slow_promise_is_caught(name: str) -> None:
    _caught(name)


def test_every_readme_promise_has_a_mutant() -> None:
    """Every test the README names as a promise's proof is the target of some mutant."""
    import re
    readme = (ROOT / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| ") and "`tests/" in line]
    named = {t for row in rows for t in re.findall(r"`(tests/[^`]+)`", row)}
    targeted = {t for m in MUTANTS.values() for t in m.tests}
    covered = {t for t in named if any(x == t or x.startswith(t + "::") or x.startswith(t + "[")
                                       for x in targeted)}
    assert named - covered == set()
