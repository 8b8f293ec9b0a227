"""The tensors a :class:`~rtmem.torch.ScheduleExecutor` keeps between the
operations of a step (plain a_k and abar_k) and the dictionaries that hold them.
Separate from ``executor.py`` because this is bookkeeping only (what is stored,
which device storages it holds, the byte count kept in step with every insertion
and removal); what to store and when stays in the executor.

The rules it follows are NOTE [ Executor ] in executor.py, points 4 and 7.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ._stages import _described, _keyed


def _copy_matches(st, host) -> bool:
    """Whether the host copies ``host`` (made by an offload) fit the storages of
    the stored tensor ``st`` (a recomputation of the tensor gives the same)."""
    return len(host) == len(st.storages) and all(
        h is None or s.nbytes() in (0, h.nbytes()) for s, h in zip(st.storages, host))


@dataclass
class _Stored:
    """One schedule tensor on the device: a plain a_k or an abar_k (graph + output)."""

    out: torch.Tensor
    inp: torch.Tensor | None = None          # leaf input of F_all (abar only)
    saved: list = field(default_factory=list)  # tensors saved by autograd (abar only)
    storages: list = field(default_factory=list)  # device storages of out and saved;
    #                                          moves pair them with host copies by position
    version: int = 0                         # out._version when stored (NOTE rule 7)
    ready: object = None                     # CUDA event of the last prefetch
    resident: bool = True                    # False between delete and prefetch
    ledger_keys: tuple = ()                  # what _Entries counted for it
    holding_keys: tuple = ()                 # ... in the holding ledger

    def all_tensors(self):
        return [self.out, self.inp, *self.saved]

    def needed(self):
        """The tensors whose storages a resident ``self`` needs: its output and
        saved tensors (not the leaf input of an abar; NOTE [ Executor ] rule 4)."""
        return [self.out, *self.saved]


class _Entries(dict):
    """Stored tensors by index (the executor's plain and abar tensors). Every
    insertion and removal counts or uncounts the tensor's storages in the
    executor's two ledgers (:class:`_Ledger`), so the resident bytes and the protected
    storages are known after each operation without walking every stored tensor:

    - ``ledger``: every tensor of every stored tensor (:meth:`_Stored.all_tensors`),
      resident or not; its total is the executor's resident bytes;
    - ``holding``: the tensors that resident stored tensors need
      (:meth:`_Stored.needed`), which a delete or a drop must leave alone
      (NOTE [ Executor ] rule 4). Residency changes through :meth:`set_resident`.

    The executor counts delta itself: in the holding ledger, and in ``ledger``
    during a step with ``track_memory`` only (nothing reads its total otherwise).

    The executor's plain and abar dictionaries share both ledgers."""

    def __init__(self, ledger, holding):
        super().__init__()
        self._ledger, self._holding = ledger, holding

    def __setitem__(self, k, st: _Stored):
        self.pop(k, None)
        st.ledger_keys = self._ledger.add(st.all_tensors())
        st.holding_keys = self._holding.add(st.needed()) if st.resident else ()
        super().__setitem__(k, st)

    def store(self, k, out, inp=None, saved=()) -> None:
        """``self[k] =`` a new stored tensor of ``out`` (an abar also has the leaf
        input ``inp`` of its F_all and the tensors autograd ``saved``). Each
        tensor's storage is looked up once, for :attr:`_Stored.storages` and both
        ledgers: that was three lookups per tensor, ~1/3 of the ledgers' cost."""
        saved = list(saved)
        needed = [t.untyped_storage() for t in (out, *saved)]   # as _Stored.needed()
        # each storage described once, for the ledgers and for _keyed's keys
        described = _described(needed)
        st = _Stored(out=out, inp=inp, saved=saved,
                     storages=list(_keyed(needed, described).values()),
                     version=out._version)
        self.pop(k, None)
        # in the order of _Stored.all_tensors(), as __setitem__ counts them
        every = described if inp is None else \
            [described[0], *_described([inp.untyped_storage()]), *described[1:]]
        st.ledger_keys = self._ledger.add_described(every)
        st.holding_keys = self._holding.add_described(described)
        super().__setitem__(k, st)

    def set_resident(self, st: _Stored, resident: bool) -> None:
        """Mark ``st`` (stored here) resident or not (between a delete and a
        prefetch), counting what it needs in the holding ledger while it is."""
        if resident == st.resident:
            return
        if resident:
            st.holding_keys = self._holding.add(st.needed())
        else:
            self._holding.remove(st.holding_keys)
            st.holding_keys = ()
        st.resident = resident

    def _uncount(self, st: _Stored) -> None:
        self._ledger.remove(st.ledger_keys)
        self._holding.remove(st.holding_keys)
        st.ledger_keys = st.holding_keys = ()

    def pop(self, k, *default):
        if k not in self:
            return super().pop(k, *default)
        st = super().pop(k)
        self._uncount(st)
        return st

    def __delitem__(self, k):
        self.pop(k)

    def clear(self):
        for st in self.values():
            self._uncount(st)
        super().clear()

    def _uncounted(self, *args, **kwargs):
        raise TypeError("stored tensors are set, popped or cleared one by one (the "
                        "ledgers count each)")
    update = setdefault = popitem = _uncounted
