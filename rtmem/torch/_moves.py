"""The activation moves of :class:`~rtmem.torch.ScheduleExecutor`: ``offload``,
``delete`` and ``prefetch`` of a stored a_k or abar_k, and what dropping a stored
tensor frees (NOTE [ Executor ] rule 4 in executor.py), with the check that
refuses, before any work, a schedule moving an abar whose graph a backward
has consumed. Separate from ``executor.py``, which runs the schedule and
decides when a tensor is stored, consumed or dropped; the host copies and the
copies between device and host are :mod:`._host_side`'s.
"""

from __future__ import annotations

from rtmem.planners import Op

from ._bookkeeping import _CHECK_ACCOUNTING
from ._stages import ExecutionError
from ._stored import _copy_matches, _Entries, _Stored


def _check_graph_moves(schedule) -> None:
    """Refuse, before any work, a move of abar_k after ``B k-1`` ran its graph
    and before an ``F_all k-1`` makes it again: backward frees the graph, so the
    executor cannot bring it back (the simulator, which counts bytes, accepts
    it; the step would fail halfway, after writing some gradients)."""
    consumed = set()
    for j, (op, s, aux) in enumerate(schedule):
        if op == Op.F_ALL:
            consumed.discard(s + 1)
        elif op == Op.B:
            consumed.add(s + 1)
        elif aux and op in (Op.OFFLOAD, Op.DELETE, Op.PREFETCH) and s in consumed:
            raise ExecutionError(
                f"operation {j} of the schedule ({schedule.op_text(j)}) moves abar{s} "
                f"after B {s - 1} consumed its graph; a graph backward has run through "
                f"cannot be brought back. Remove the operation, or run F_all {s - 1} "
                f"again before it")


class _ActivationMoves:
    """Mixin of :class:`~rtmem.torch.ScheduleExecutor`, which provides the stored
    tensors ``_plain`` and ``_bar`` and their ledgers (``_ledger``, ``_holding``,
    :meth:`_protected`, :meth:`_never_freed`, :meth:`_check_held` from
    :class:`~rtmem.torch._bookkeeping._Bookkeeping`) and the host side (``_host``,
    :meth:`_host_storage`, :meth:`_copy`, :meth:`_note_copies`,
    :meth:`_restore_sources` from :class:`~rtmem.torch._host_side._HostSide`)."""

    def _drop(self, entries: dict, k: int):
        """Forget the stored tensor ``entries[k]``. Its storages go with the last
        reference to them, but other stored tensors may hold some without needing
        them (the leaf input of an abar built from a_k, a deleted view of a_k);
        those are freed here, as the simulator frees a dropped tensor at once.

        A plain a_k with a host copy is deleted instead (kept, not resident): the
        simulator keeps host copies past consumption (its Rule 5), so a later
        ``prefetch a_k`` may bring it back."""
        if entries is self._plain and (k, 0) in self._host:
            host = self._host[(k, 0)][0]
            if _copy_matches(entries[k], host):
                self._delete(entries, entries[k], host)
                return
        st = entries.pop(k)
        self._free_unneeded(st.storages)

    def _free_unneeded(self, storages):
        """Free the device ``storages`` of a stored tensor just forgotten that
        other stored tensors hold without needing them."""
        mine = {s.data_ptr(): s for s in storages if s.nbytes()}
        # Still counted in the ledger: held by another stored tensor or delta.
        # Those that need it are protected; the rest (the leaf input of an abar,
        # a tensor between delete and prefetch) hold it without needing it.
        held = [key for key in mine if self._ledger.holds(key)]
        if _CHECK_ACCOUNTING:
            self._check_held(mine, held)
        if held:
            protected = self._protected()
            for key in held:
                if protected(key):
                    continue
                self._resize(mine[key], 0)

    def _move(self, op, k: int, aux: int):
        entries = self._bar if aux else self._plain
        name = f"{'abar' if aux else 'a'}{k}"
        st = entries.get(k)
        if st is None:
            raise ExecutionError(
                f"cannot {op.name.lower()} {name}: that tensor was "
                "consumed; the executor moves a tensor only between its production and "
                "its consumption (recompute it instead)")
        if op == Op.OFFLOAD:
            # storages that are never freed (rule 4) need no host copy
            host = [self._host_storage(s.nbytes())
                    if s.nbytes() and not self._never_freed(s.data_ptr()) else None
                    for s in st.storages]
            pairs = [(h, s) for h, s in zip(host, st.storages) if h is not None]
            # the tensor may be dropped (F_none, B, delete) while the copy still
            # reads it: _copy marks its storages used on the D2H stream
            done = self._copy("d2h", pairs, [s for _, s in pairs])
            self._host[(k, aux)] = (host, done)
            self._note_copies(st, host, done)
            return
        if op == Op.DELETE and (k, aux) not in self._host:
            self._drop(entries, k)   # a discard: nothing will bring it back
            return
        host, done = self._host[(k, aux)]
        if not _copy_matches(st, host):
            raise ExecutionError(f"cannot {op.name.lower()} {name}: its host copy does not "
                                 "match the tensor on the device")
        if op == Op.DELETE:
            self._delete(entries, st, host)
        else:  # PREFETCH
            entries.set_resident(st, True)
            # allocated on the compute stream, so the caching allocator ties the
            # blocks to the stream that uses and frees them; compute waits (_wait).
            # A storage still (or again, through a tensor sharing it) on the device
            # holds its newest bytes (_restore_sources).
            sources = self._restore_sources(st, host, done)
            for s, h, _ in sources:
                self._resize(s, h.nbytes())
            st.ready = self._copy("h2d", [(s, h) for s, h, _ in sources],
                                  [s for s, _, _ in sources],
                                  after={e for _, _, e in sources})

    def _delete(self, entries: _Entries, st: _Stored, host: list):
        """Free the device storages of ``st`` (in ``entries``) that have a host
        copy ``host``; it stays known, not resident, for a prefetch."""
        entries.set_resident(st, False)   # first: st no longer protects its own
        protected = self._protected()
        for s, h in zip(st.storages, host):
            # freed behind the D2H copy (_copy), not blocking compute; a
            # protected storage stays, as its other owner needs it (rule 4)
            if h is not None and s.nbytes() and not protected(s.data_ptr()):
                self._resize(s, 0)

    def _resize(self, s, nbytes: int):
        """``s.resize_(nbytes)``, kept in the ledger: it counts the storage's
        bytes and address, which a resize changes."""
        s.resize_(nbytes)
        self._ledger.resized(s)
        self._holding.resized(s)
