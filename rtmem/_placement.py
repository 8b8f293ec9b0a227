"""Placements and moves: where a :class:`~rtmem.buffer.Buffer`'s bytes live
(a block of one arena) and the copy pending on it. Used by the buffer's
residency state (NOTE [ Residency state machine ] in rtmem/buffer.py), its
views and the transfers; ``rtmem.buffer`` re-exports :class:`Placement`.
"""

from __future__ import annotations

__all__ = ["Placement"]


class Placement:
    """A block of one arena holding a buffer's bytes.

    ``event``/``stream``: the last transfer that read or wrote the block, so that
    freeing it is stream-ordered (the block is not reused before that copy ends).
    ``pins``: pinned views of this block (NOTE [ Pinned views ] in
    rtmem/buffer.py).
    """

    __slots__ = ("arena", "block", "event", "stream", "pins")

    def __init__(self, arena, block):
        self.arena = arena
        self.block = block
        self.event = None
        self.stream = None
        self.pins = 0

    @property
    def slab(self):
        """The backend slab holding the block."""
        return self.arena._slab_of(self.block)

    @property
    def offset(self) -> int:
        """Offset of the block in its slab, bytes."""
        return self.block.offset


def _in_open(p: Placement | None) -> bool:
    """Whether ``p`` is a copy: a placement in an open arena (a closed arena's
    counts as no copy, NOTE [ Residency state machine ])."""
    return p is not None and not p.arena._closed


def _in_closed(p: Placement | None) -> bool:
    """Whether ``p`` is a placement left in a closed arena."""
    return p is not None and p.arena._closed


def _poll_transfers(backend) -> None:
    """Drop the keepalives of ``backend``'s completed copies (NOTE [ Keeping
    memory alive during copies ] in rtmem.transfers)."""
    from .transfers import _poll_engine     # transfers imports the buffer modules
    _poll_engine(backend)


class _Move:
    """A buffer's pending copy: its ``event``, the ``side`` it writes
    (``"device"`` for H2D, ``"host"`` for D2H) and the ``prior`` move it was
    chained on (its copy waits for that one's event)."""

    __slots__ = ("event", "side", "prior")

    def __init__(self, event, side: str, prior=None):
        self.event = event
        self.side = side
        self.prior = prior
