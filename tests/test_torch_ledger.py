"""The executor's running byte count (rtmem/torch/_stages.py ``_Ledger``) against a
recount from scratch (and :meth:`_Ledger.holds` against the recount's storages),
over random sequences of what the executor does to it: tensors counted and
uncounted (views share storages), storages freed with ``resize_(0)`` and
restored, and the excluded (model-state) pointers replaced."""

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from rtmem.torch._stages import _Ledger, _storages  # noqa: E402

_OPS = st.lists(st.tuples(st.sampled_from(["add", "remove", "free", "restore", "exclude"]),
                          st.integers(0, 10**6), st.integers(0, 10**6)),
                min_size=1, max_size=40)


def _recount(counted, excluded) -> int:
    tensors = [t for ts in counted for t in ts]
    return sum(s.nbytes() for k, s in _storages(tensors).items() if k not in excluded)


@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.integers(1, 64), min_size=1, max_size=5), ops=_OPS)
def test_the_ledger_total_is_a_recount(sizes, ops):
    bases = [torch.empty(n) for n in sizes]
    # each base, a view of it, and a second view: three tensors per storage
    pool = [t for b in bases for t in (b, b[1:], b.view(1, -1))]
    full = [b.untyped_storage().nbytes() for b in bases]
    ledger, counted, excluded = _Ledger(), [], set()
    for op, a, b in ops:
        if op == "add":
            group = [pool[a % len(pool)], None, pool[b % len(pool)]]
            counted.append(group)
            keys = ledger.add(group)
            assert len(keys) == 2
            group.append(keys)
        elif op == "remove" and counted:
            group = counted.pop(a % len(counted))
            ledger.remove(group.pop())
        elif op in ("free", "restore"):
            i = a % len(bases)
            s = bases[i].untyped_storage()
            s.resize_(0 if op == "free" else full[i])
            ledger.resized(s)
        elif op == "exclude":
            ptrs = [t.untyped_storage().data_ptr() for t in bases]
            excluded = {p for j, p in enumerate(ptrs) if (b >> j) & 1 and p}
            ledger.exclude(excluded)
        # ints only in the assertion: pytest's report would print the tensors, and
        # printing one whose storage is freed reads freed memory
        expected = _recount([g[:-1] for g in counted], excluded)
        total = ledger.total
        assert total == expected, f"after {op} {a} {b}"
        live = {k for k, s in _storages([t for g in counted for t in g[:-1]]).items()
                if s.nbytes()}
        for base in bases:
            ptr = base.untyped_storage().data_ptr()
            if base.untyped_storage().nbytes():
                assert ledger.holds(ptr) == (ptr in live), f"after {op} {a} {b}"
    for group in counted:
        ledger.remove(group.pop())
    assert ledger.total == 0 and not ledger._refs and not ledger._at_ptr
    assert not (ledger._ptr_of or ledger._bytes_of or ledger._bytes_at)


def test_uncounting_uses_the_storages_counted_even_after_a_data_swap():
    p = torch.nn.Parameter(torch.randn(8))
    ledger = _Ledger()
    keys = ledger.add([p])
    assert ledger.total == 32
    p.data = torch.empty(0)                 # what w_delete does to a parameter
    ledger.remove(keys)
    assert ledger.total == 0 and not ledger._refs and not ledger._at_ptr


def test_two_storages_over_the_same_memory_count_once_until_both_go():
    # two StorageImpls at one data pointer (two from_numpy of one array) count
    # once (as _storages keys them), and their bytes stay until the last goes
    np = pytest.importorskip("numpy")
    arr = np.arange(8, dtype=np.float32)
    a, b = torch.from_numpy(arr), torch.from_numpy(arr)
    ptr = a.untyped_storage().data_ptr()
    assert a.untyped_storage()._cdata != b.untyped_storage()._cdata
    assert b.untyped_storage().data_ptr() == ptr
    ledger = _Ledger()
    keys_a = ledger.add([a])
    keys_b = ledger.add([b])
    assert ledger.total == 32
    ledger.remove(keys_a)
    assert ledger.total == 32 and ledger.holds(ptr)
    ledger.remove(keys_b)
    assert ledger.total == 0 and not ledger.holds(ptr)
    assert not (ledger._at_ptr or ledger._bytes_at)



@settings(max_examples=100, deadline=None)
@given(picks=st.lists(st.tuples(st.integers(0, 10**6), st.booleans(),
                                st.lists(st.integers(0, 10**6), max_size=3)),
                      min_size=1, max_size=6),
       freed=st.integers(0, 7))
def test_a_stored_tensor_counts_in_both_ledgers_as_its_tensors_do(picks, freed):
    # _Entries.store looks each tensor's storage up once for the stored tensor and
    # both ledgers: what it counts must be what counting the tensors counts
    # (shared storages once, empty ones by identity, the abar's leaf input in the
    # byte ledger only), and replacing or popping must uncount all of it
    from rtmem.torch._stored import _Entries

    bases = [torch.empty(n) for n in (4, 8, 16)]
    pool = [t for b in bases for t in (b, b[1:], b.view(1, -1))]
    for j, b in enumerate(bases):
        if (freed >> j) & 1:
            b.untyped_storage().resize_(0)   # a deleted tensor's storage
    byte_ledger, holding = _Ledger(), _Ledger()
    entries = _Entries(byte_ledger, holding)
    for k, (a, has_inp, saved) in enumerate(picks):
        out = pool[a % len(pool)]
        inp = pool[(a // 7) % len(pool)] if has_inp else None
        saved = [pool[s % len(pool)] for s in saved]
        entries.store(k % 3, out, inp=inp, saved=saved)   # an index in use: replaced
        stored = entries[k % 3]
        assert stored.all_tensors() == [out, inp, *saved]
        assert {k: s._cdata for k, s in _storages(stored.needed()).items()} == \
            {k: s._cdata for k, s in zip(_storages(stored.needed()),
                                         stored.storages)}
        tensors = [t for st_ in entries.values() for t in st_.all_tensors()]
        assert byte_ledger.total == _recount([tensors], set())
        needed = {k for k, s in _storages([t for st_ in entries.values()
                                           for t in st_.needed()]).items() if s.nbytes()}
        for t in pool:
            ptr = t.untyped_storage().data_ptr()
            if t.untyped_storage().nbytes():
                assert holding.holds(ptr) == (ptr in needed)
    for k in list(entries):
        entries.pop(k)
    assert byte_ledger.total == 0 and not byte_ledger._refs and not holding._refs
