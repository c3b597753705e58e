"""Builds shmq's optional compiled accelerator, ``shmq._speedups`` (``shmq/_speedups*.c``).

Everything else about the package is in ``pyproject.toml``.  ``optional=True``: on a
machine without a C compiler (or Python's headers) the build of the extension is
skipped with a warning and shmq installs as pure Python (``shmq.accel``).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("shmq._speedups", ["shmq/_speedups.c", "shmq/_speedups_one.c"],
                             depends=["shmq/_speedups.h"], optional=True,
                             extra_compile_args=["-O2"])])
