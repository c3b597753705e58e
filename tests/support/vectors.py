"""The frames docs/protocol.md writes out, as a test reads them back."""

from __future__ import annotations

import re

from tests.support.paths import PROTOCOL_DOC


def doc_vectors(label: str) -> dict[str, bytes]:
    """The frames docs/protocol.md gives as ``<label> NAME: hex | hex ...`` lines, by name."""
    found = re.findall(rf"^{label} ([a-z_]+):(.*)$", PROTOCOL_DOC.read_text(encoding="utf-8"), re.M)
    return {name: bytes.fromhex(re.sub(r"[\s|]", "", rest)) for name, rest in found}


class NamedQueue:
    """What a produce command needs of its queue: its name, as text and as bytes."""

    def __init__(self, name: str) -> None:
        self.name, self.name_bytes = name, name.encode()
