"""Builds shmq's optional compiled accelerator, ``shmq._speedups`` (``shmq/_speedups*.c``).

Everything else about the package is in ``pyproject.toml``.  ``optional=True``: on a
machine without a C compiler (or Python's headers) the build of the extension is
skipped with a warning and shmq installs as pure Python (``shmq.accel``).
"""

from setuptools import Extension, setup

SOURCES = ["shmq/_speedups.c", "shmq/_speedups_one.c", "shmq/_speedups_wire.c"]

setup(ext_modules=[Extension("shmq._speedups", SOURCES,
                             depends=["shmq/_speedups.h"], optional=True,
                             extra_compile_args=["-O2"])])
