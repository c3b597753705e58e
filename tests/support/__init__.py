"""Helpers the tests share, by topic; the fixtures are in ``tests/conftest.py``.

Every test imports them absolutely (``from tests.support.server import Server``): the
suite is the package ``tests`` (each folder has an ``__init__.py``), so pytest puts the
repository's root on ``sys.path`` and ``tests.support`` resolves from any folder."""
