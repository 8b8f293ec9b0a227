"""The checker of NOTE [ Allocator structure ] (allocator.py): ``_check_invariants``
walks every slab, index and counter of a
:class:`~rtmem.allocator.BestFitAllocator` and asserts Rules 1-6. Tests call
it after every step; the runtime never does (it is linear in the blocks). A
mixin of the allocator, taking its lock.
"""

from __future__ import annotations

from ._blocks import _ADDR_MASK, _DEAD, _LIVE, _OFFSET_BITS, _PENDING, _READY, align_up


class _InvariantChecks:
    """Mixin of :class:`~rtmem.allocator.BestFitAllocator`."""

    def _check_invariants(self) -> None:
        """Assert NOTE [ Allocator structure ] Rules 1-6; raise AssertionError."""
        with self._lock:
            a = self.alignment
            allocated = requested = reserved = pending = n_live = n_free = 0
            fmap, indexed = self._free_map, {}      # addr -> (in _ready, stream)
            for stream, keys in [(None, self._ready), *self._pending.items()]:
                assert keys == sorted(set(keys)), "an index is unsorted or repeats"
                for key in keys:
                    block = fmap.get(key & _ADDR_MASK)
                    assert block is not None and key == block._key(), f"stale {key:#x}"
                    assert block.addr not in indexed, f"{block!r} indexed twice"
                    indexed[block.addr] = (keys is self._ready, stream)
            for sid, (_, nbytes, first) in self._slabs.items():
                reserved += nbytes
                assert first.prev is None and first.offset == 0, f"slab {sid} head"
                block, end = first, 0
                while block is not None:
                    assert block.slab == sid and block.owner is self
                    assert block.addr == (sid << _OFFSET_BITS) | block.offset
                    assert block.offset == end, f"gap or overlap at {block!r}"
                    assert block.size > 0 and block.size % a == 0 and block.offset % a == 0
                    assert block.next is None or block.next.prev is block, f"links {block!r}"
                    if block.state == _LIVE:
                        assert block.addr not in fmap and block.event is None
                        assert block.size == align_up(max(block.requested, 1), a), \
                            f"{block!r} is not exactly sized"
                        allocated += block.size
                        requested += block.requested
                        n_live += 1
                    elif block.state == _READY:
                        assert indexed.pop(block.addr, None) == (True, None)
                        assert fmap[block.addr] is block and block.event is None
                        assert block.next is None or block.next.state != _READY, \
                            f"adjacent ready blocks not coalesced at {block!r}"
                    else:
                        assert block.state == _PENDING
                        assert block.event is not None or any(
                            b is block for b in self._unstamped.get(block.stream, ())), \
                            f"{block!r} has no event and is not listed unstamped"
                        assert indexed.pop(block.addr, None) == (False, block.stream)
                        assert fmap[block.addr] is block
                        pending += block.size
                    n_free += block.state != _LIVE
                    end = block.end
                    block = block.next
                assert end == nbytes, f"slab {sid} blocks end at {end}, slab is {nbytes}"
            assert not indexed and len(fmap) == n_free, "stray blocks in an index or map"
            spare = {id(b) for b in self._spare if b.state == _DEAD and b.owner is self
                     and b.requested == -1 and b.event is None}
            assert len(spare) == len(self._spare), "a spare block is not dead and unused"
            assert not spare & {id(b) for f in self._fifo.values() for _, b in f}
            assert not spare & {id(b) for bl in self._unstamped.values() for b in bl}
            assert reserved == self._reserved and allocated == self._allocated
            assert requested == self._requested and pending == self._pending_bytes
            assert self._peak >= self._allocated
            assert self._alloc_count - self._free_count == n_live
