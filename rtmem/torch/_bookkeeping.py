"""The bookkeeping of :class:`~rtmem.torch.ScheduleExecutor`: which device
storages its stored tensors and delta hold, their bytes (``resident_bytes``,
``peak_bytes``), and which storages a delete or a drop must leave alone
(NOTE [ Executor ] rule 4 in executor.py). Separate from ``executor.py``, which
decides what is stored, freed and moved; this module only counts and answers.
With ``RTMEM_CHECK_ACCOUNTING=1`` (the test suite) every answer of the ledgers
is checked against a walk of the stored tensors.
"""

from __future__ import annotations

import os

from ._stages import _described, _Ledger, _storage_bytes, _storages
from ._stored import _Entries

#: Set by the test suite (tests/conftest.py): every operation's ledger total is
#: compared with a full recount of the stored tensors' storages.
_CHECK_ACCOUNTING = os.environ.get("RTMEM_CHECK_ACCOUNTING") == "1"


class _Bookkeeping:
    """Mixin of :class:`~rtmem.torch.ScheduleExecutor`, which provides the
    stored tensors (``_plain``, ``_bar``, made by :meth:`_new_ledger`),
    ``_state_count`` (from :class:`~rtmem.torch._host_side._HostSide`),
    ``_caller_keys``, ``_op_index``, ``track_memory``, ``resident_bytes`` and
    ``peak_bytes``."""

    def _new_ledger(self):
        """No stored tensors, no delta, nothing counted."""
        self._ledger, self._holding = _Ledger(), _Ledger()
        self._plain = _Entries(self._ledger, self._holding)
        self._bar = _Entries(self._ledger, self._holding)
        self._delta_t, self._delta_keys = None, ((), ())
        # delta goes in the byte count only for a step that records it: a step
        # without track_memory reads that ledger only to find storages a stored
        # tensor holds without needing them (_free_unneeded), and delta's are
        # protected by the holding ledger anyway. Decided per step, as the flag
        # may change between steps. (Two ledger updates per B saved.)
        self._delta_counted = self.track_memory

    @property
    def _delta(self):
        """delta_i, the gradient flowing back (in the holding ledger, and in the
        byte count of a step with ``track_memory``)."""
        return self._delta_t

    @_delta.setter
    def _delta(self, t):
        # its bytes are resident, and no move frees it
        counted, held = self._delta_keys
        # looked up and described once for both ledgers
        described = () if t is None else _described((t.untyped_storage(),))
        self._holding.remove(held)
        held = self._holding.add_described(described)
        if self._delta_counted:
            self._ledger.remove(counted)
            counted = self._ledger.add_described(described)
        self._delta_t, self._delta_keys = t, (counted, held)

    def _account(self):
        nbytes = self._ledger.total
        if _CHECK_ACCOUNTING:
            recount = self._recount()
            if nbytes != recount:
                raise AssertionError(f"executor ledger says {nbytes} B resident after "
                                     f"operation {self._op_index}, a recount {recount} B")
        self.resident_bytes.append(nbytes)
        self.peak_bytes = max(self.peak_bytes, nbytes)

    def _recount(self) -> int:
        """The ledger's figure from scratch: bytes of the storages of delta and of
        every stored tensor (parameters and buffers excluded)."""
        tensors = [self._delta]
        for st in (*self._plain.values(), *self._bar.values()):
            tensors += st.all_tensors()
        return _storage_bytes(tensors, exclude=self._state_count)

    def _never_freed(self, key) -> bool:
        """Whether the storage with key ``key`` (:func:`_storages`) is the model's
        state or the caller's inputs or target, which no move frees (rule 4)."""
        return key in self._state_count or key in self._caller_keys

    def _protected(self):
        """A test ``key -> bool`` for the keys (:func:`_storages`) of the device
        storages that a delete or a drop must leave alone (NOTE [ Executor ]
        rule 4): the model's parameters and
        buffers, the caller's inputs and target, delta, and the output and saved
        tensors of every resident stored tensor (:meth:`_Stored.needed`). A
        stored tensor can share a storage with any of them: an ``nn.Identity``,
        flatten or in-place stage returns its input's storage, batch norm saves
        its running statistics, a first stage may return the caller's batch.

        The holding ledger answers in O(1) per key; walking the resident stored
        tensors instead cost O(stored tensors) per delete, O(n^2) per step for
        a plan that deletes while many tensors are resident. With
        ``RTMEM_CHECK_ACCOUNTING=1`` every answer is checked against that walk."""
        holds, never_freed = self._holding.holds, self._never_freed

        def protected(key) -> bool:
            return never_freed(key) or holds(key)
        if not _CHECK_ACCOUNTING:
            return protected
        walked = self._protected_walk()

        def checked(key) -> bool:
            fast = protected(key)
            if fast != walked(key):
                raise AssertionError(f"executor holding ledger says storage {key:#x} is "
                                     f"{'' if fast else 'not '}protected after operation "
                                     f"{self._op_index}, a walk of the stored tensors "
                                     "disagrees")
            return fast
        return checked

    def _protected_walk(self):
        """:meth:`_protected` by walking every resident stored tensor: the
        reference its ledger is checked against."""
        tensors = [self._delta]
        for st in (*self._plain.values(), *self._bar.values()):
            if st.resident:
                tensors += st.needed()
        # a test, not a union: the parameter set is the model's size
        stored, never_freed = _storages(tensors), self._never_freed
        return lambda key: never_freed(key) or key in stored

    def _check_held(self, mine: dict, held: list):
        """Check ``held`` (what :meth:`_drop` found in the ledger among ``mine``)
        against a walk of the tensors that can hold a storage without needing
        it; a storage in neither is unprotected only if the walk finds it too."""
        holders = [o.inp for o in self._bar.values()]
        holders += [t for o in (*self._plain.values(), *self._bar.values())
                    if not o.resident for t in o.all_tensors()]
        walked = mine.keys() & _storages(holders).keys()
        protected = self._protected_walk()
        if {k for k in held if not protected(k)} != {k for k in walked if not protected(k)}:
            raise AssertionError(f"executor ledger and a walk of the stored tensors disagree "
                                 f"on which storages operation {self._op_index} frees")
