"""A batch's payloads given back to back: their lengths and their bytes, with no object per
payload.  The Spark sink's chunks come this way (``ShmQueue.put_joined``), and so does a
PRODUCE_BATCH body without headers, as the broker reads it (``protocol.bodies.decode_joined``);
``Ring.try_put_many`` copies such a batch's bytes in one run."""

from __future__ import annotations

from typing import Any


class Joined:
    """``lens``: each payload's length; ``data``: the payloads back to back (their sum)."""

    __slots__ = ("lens", "data")

    def __init__(self, lens: list[int], data: bytes | memoryview) -> None:
        self.lens, self.data = lens, data

    def __len__(self) -> int:
        return len(self.lens)

    def payloads(self) -> list[bytes]:
        """The payloads one by one (where each must be an object of its own: a journal)."""
        whole, out, at = bytes(self.data), [], 0
        for n in self.lens:
            out.append(whole[at:at + n])
            at += n
        return out


def nbytes(batch: Any) -> int:
    """The payload bytes of a batch: a ``Joined`` or a sequence of byte strings."""
    return len(batch.data) if batch.__class__ is Joined else sum(map(len, batch))
