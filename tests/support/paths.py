"""Where the repository's files are, for the tests that read its docs or run its scripts."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: tests/support/ is two below it
DOCS = ROOT / "docs"
PROTOCOL_DOC = DOCS / "protocol.md"
OPERATIONS_DOC = DOCS / "operations.md"
