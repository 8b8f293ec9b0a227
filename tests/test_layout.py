"""Buffer lifetimes from (chain, schedule) and the static layout built on them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rtmem.planners as P
from rtmem.errors import LayoutError, ScheduleError
from rtmem.layout import layout_for, plan_layout, verify_layout
from rtmem.planners.lifetimes import KIND_NAMES, lifetimes

BIG = P.Platform(memory=10**14, bandwidth=1e10)


@pytest.mark.parametrize("name", ["gpt2-small", "resnet50", "gpt2-medium"])
@pytest.mark.parametrize("segments", [1, 2, 4, "n"])
def test_peak_live_matches_simulator(name, segments):
    chain = P.builtin(name)
    k = chain.n if segments == "n" else segments
    sched = P.store_all_schedule(chain.n) if k == 1 else P.sequential_schedule(chain.n, k)
    lt = lifetimes(chain, sched)
    assert lt.peak_live() == P.simulate(chain, sched, BIG).peak
    assert (lt.alloc <= lt.free).all() and (lt.nbytes > 0).all()
    assert lt.n_ops == len(sched)


def test_lifetimes_of_a_small_schedule_with_moves():
    chain = P.Chain(u_f=[1, 1], u_b=[1, 1], x=[10, 20], xbar=[30, 40], w=[5, 6],
                    x0=7, o_f=[1, 2], o_b=[3, 4])
    sched = P.Schedule.from_text(
        "F_all 0, F_all 1, offload abar1, delete abar1, L, prefetch abar1, B 1, B 0, "
        "g_offload 1")
    P.simulate(chain, sched, BIG)                   # the schedule is valid
    lt = lifetimes(chain, sched)
    by = {}
    for i, name in enumerate(lt.names):
        by.setdefault(name, []).append((int(lt.alloc[i]), int(lt.free[i]),
                                        int(lt.nbytes[i]), lt.kind_name(i)))
    assert by["a0"] == [(-1, 7, 7, "activation")]   # consumed by B 0 (op 7)
    assert by["abar1"] == [(0, 3, 30, "activation"), (5, 7, 30, "activation")]
    assert by["abar2"] == [(1, 6, 40, "activation")]
    assert by["w0"] == [(-1, 9, 5, "weight")]
    assert by["g1"] == [(6, 8, 6, "gradient")]      # moved out by g_offload
    assert by["delta2"] == [(4, 6, 20, "gradient")]
    assert by["o_b0"] == [(7, 7, 3, "workspace")]
    assert "a2" not in by                           # F_all made abar2 only
    assert set(KIND_NAMES) >= {lt.kind_name(i) for i in range(len(lt))}


def test_lifetimes_reject_moves_of_missing_data():
    chain = P.Chain.homogeneous(2)
    with pytest.raises(ScheduleError, match="not resident"):
        lifetimes(chain, P.Schedule.from_text("delete abar1, F_all 0"))


@pytest.mark.parametrize("name", P.builtin_names())
def test_static_layout_of_builtins_is_tight_and_valid(name):
    chain = P.builtin(name)
    for sched in (P.store_all_schedule(chain.n), P.sequential_schedule(chain.n, 4)):
        lay = layout_for(chain, sched)
        lay.verify()
        assert lay.reserved_bytes >= lay.peak_live_bytes
        assert lay.overhead <= 1.05
        assert (lay.offsets % 256 == 0).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 10), st.integers(0, 5000)),
                min_size=0, max_size=40),
       st.sampled_from([1, 64, 256]))
def test_plan_layout_never_overlaps_live_buffers(items, alignment):
    alloc = [a for a, _, _ in items]
    free = [a + d for a, d, _ in items]
    size = [s for _, _, s in items]
    lay = plan_layout(alloc, free, size, alignment=alignment)
    lay.verify()
    assert lay.reserved_bytes >= lay.peak_live_bytes
    # brute force: at every time, live buffers are disjoint in bytes
    for t in range(0, 41):
        live = [i for i in range(len(items)) if alloc[i] <= t <= free[i]]
        spans = sorted((int(lay.offsets[i]), int(lay.offsets[i] + lay.sizes[i]))
                       for i in live)
        assert all(e <= s2 for (_, e), (s2, _) in zip(spans, spans[1:]))


def test_verify_layout_finds_overlap():
    with pytest.raises(LayoutError) as info:
        verify_layout([0, 100], [256, 256], [0, 1], [5, 2])
    assert info.value.pair == (0, 1)
    verify_layout([0, 0], [256, 256], [0, 3], [2, 5])     # disjoint in time: fine


def test_plan_layout_validates_input():
    with pytest.raises(ValueError, match="before it is allocated"):
        plan_layout([3], [1], [10])
    with pytest.raises(ValueError, match="one length"):
        plan_layout([0, 1], [1], [10])
    empty = plan_layout([], [], [])
    assert empty.reserved_bytes == 0 and empty.overhead == 1.0


def test_layout_matches_trace_in_an_arena():
    """The offsets of a static layout fit in one arena slab of reserved_bytes."""
    chain = P.builtin("gpt2-small")
    sched = P.sequential_schedule(chain.n, 3)
    lay = layout_for(chain, sched)
    assert np.all(lay.offsets + lay.sizes <= lay.reserved_bytes)
    assert lay.reserved_bytes <= 1.01 * lay.peak_live_bytes


@pytest.mark.parametrize("alignment", [0, 3, -256, 2.5])
def test_alignment_must_be_a_power_of_two(alignment):
    with pytest.raises(ValueError, match="power of two"):
        plan_layout([0], [1], [8], alignment=alignment)


def test_fractional_sizes_round_up():
    # They were truncated: a 10.5-byte buffer got 10 bytes, and its last byte
    # belonged to the next buffer.
    lay = plan_layout([0, 0], [1, 1], [10.5, 5.0], alignment=1)
    assert list(lay.sizes) == [11, 5]
    verify_layout(lay.offsets, lay.sizes, lay.alloc, lay.free)
    assert lay.offsets[1] >= 11 or lay.offsets[0] >= 5
    with pytest.raises(ValueError, match="finite"):
        plan_layout([0], [1], [float("inf")])


def test_bool_arrays_are_refused_as_sizes_and_op_indices():
    # A mask passed by mistake was taken as 0s and 1s (parse_bytes refuses bools)
    with pytest.raises(ValueError, match="buffer sizes .* must be integers, got .* bool"):
        plan_layout([0, 0], [1, 1], np.array([True, False]))
    with pytest.raises(ValueError, match="alloc op indices must be integers"):
        plan_layout(np.array([False, True]), [1, 1], [8, 8])


def test_a_forward_rerun_over_a_resident_output_is_counted():
    # lifetimes() gave a re-run whose output was already resident no buffer, so
    # its peak (and layout_for's reservation) fell short of the simulator's.
    import math
    chain = P.Chain(u_f=[1], u_b=[1], x=[10], xbar=[100], x0=1)
    sched = P.Schedule.from_text("F_all 0, F_all 0, L, B 0")
    res = P.simulate(chain, sched, P.Platform(math.inf))
    lt = lifetimes(chain, sched)
    assert lt.live_bytes()[1:-1].tolist() == res.timeline["mem"].tolist()
    assert lt.peak_live() == res.peak == 201
    assert layout_for(chain, sched, alignment=1).reserved_bytes >= 201


def test_verify_layout_refuses_inputs_it_cannot_check():
    # Broadcasting checked 3 lifetimes against 2 offsets, a negative size hid an
    # overlap, and ends past 2**63 wrapped around: all were accepted.
    with pytest.raises(ValueError, match="one length"):
        verify_layout([0, 512], [256, 256], [0, 9, 0], [5, 9, 5])
    with pytest.raises(ValueError, match="negative size"):
        verify_layout([0, 256], [-512, 256], [0, 0], [5, 5])
    big = 2 ** 62
    with pytest.raises(ValueError, match="2\\*\\*63"):
        verify_layout([big, big + 256], [big, 256], [0, 0], [1, 1])
    with pytest.raises(ValueError, match="2\\*\\*63"):
        plan_layout([0, 0], [1, 1], [big, big])      # its offsets wrapped to a 2**62 reserve


def test_lifetimes_and_layout_for_refuse_invalid_schedules():
    chain = P.Chain.homogeneous(2)
    for text in ("F_all 0, F_all 1, F_all 2, L", "F_all 0, F_all 1, L, B 1, B 0, w_prefetch 5"):
        with pytest.raises(ScheduleError, match="out of range"):      # IndexError before
            lifetimes(chain, P.Schedule.from_text(text))
    with pytest.raises(ScheduleError):                                # two losses
        layout_for(chain, P.Schedule.from_text("F_all 0, F_all 1, L, L, B 1, B 0"))


def test_peak_live_does_not_scale_with_the_op_index_span():
    # _peak_live took 8 bytes per op index between the first allocation and the
    # last free: far-apart indices asked numpy for an exabyte ("array is too big";
    # 10**9 apart, 8 GB).
    lay = plan_layout([0, 2**62, 2**63 - 2], [1, 2**62, 2**63 - 1], [256, 300, 512])
    assert lay.peak_live_bytes == 512 and lay.reserved_bytes == 512
    lay = plan_layout([-1, 10**9, -1], [10**9, 10**9, -1], [256, 256, 256])
    assert lay.peak_live_bytes == 512        # inclusive: both live at 10**9, at -1
    lay.verify()


def test_layout_inputs_are_checked_as_integers():
    # alignment=256.0 raised a bare TypeError; 2**63 and 1e30 bytes wrapped to
    # negative sizes ("must be >= 0"); 2**64 and None raised bare OverflowError /
    # TypeError; an op index of 0.5 was truncated to 0; verify_layout passed a
    # buffer freed before it was allocated (live at no op: never checked).
    assert plan_layout([0], [1], [10], alignment=256.0).sizes.tolist() == [256]
    for sizes in ([2**63], [1e30], [2**64]):
        with pytest.raises(ValueError, match="2\\*\\*63"):
            plan_layout([0], [1], sizes)
    with pytest.raises(ValueError, match="buffer sizes"):
        plan_layout([0], [1], [None])
    with pytest.raises(ValueError, match="whole numbers"):
        plan_layout([0.5], [1], [10])
    with pytest.raises(ValueError, match="alloc op indices"):
        plan_layout(["a"], [1], [10])
    with pytest.raises(ValueError, match="offsets"):
        verify_layout([2**64], [5], [0], [1])
    with pytest.raises(ValueError, match="before it is allocated"):
        verify_layout([0, 0], [256, 256], [0, 3], [1, 2])


def test_lifetimes_refuse_a_prefetch_of_resident_data():
    # The prefetch replaced the resident copy's record, which then stayed live to
    # the end of the schedule: two 'abar1' (or 'w0') buffers, peak overstated.
    chain = P.Chain(u_f=[1, 1], u_b=[1, 1], x=[10, 20], xbar=[30, 40], w=[5, 6], x0=7)
    for text, what in (("F_all 0, F_all 1, offload abar1, prefetch abar1, L, B 1, B 0",
                        "abar1 is already resident"),
                       ("F_all 0, F_all 1, w_prefetch 0, L, B 1, B 0",
                        "weights of stage 0 is already resident")):
        with pytest.raises(ScheduleError, match=what) as info:
            lifetimes(chain, P.Schedule.from_text(text))
        assert info.value.reason == "already-resident"
    ok = P.Schedule.from_text("F_all 0, F_all 1, offload abar1, delete abar1, L, "
                              "prefetch abar1, w_offload 0, w_prefetch 0, B 1, B 0")
    P.simulate(chain, ok, BIG)
    assert lifetimes(chain, ok).peak_live() == P.simulate(chain, ok, P.Platform(10**14)).peak


def test_python_number_objects_round_up_as_sizes_and_must_be_whole_as_op_indices():
    # object arrays went straight to int(): Fraction(3, 2) bytes became 1 and an
    # op index of 1/2 became 0, where the same floats round up or are refused
    from decimal import Decimal
    from fractions import Fraction
    lay = plan_layout([0, 0], [0, 0], [Fraction(3, 2), Decimal("2.5")], alignment=1)
    assert lay.sizes.tolist() == [2, 3]
    with pytest.raises(ValueError, match="whole numbers, got Fraction"):
        plan_layout([Fraction(1, 2)], [1], [4])
    with pytest.raises(ValueError, match="must be integers, got None"):
        plan_layout([None], [1], [4])
    # as for float arrays (beside an int beyond int64, the array holds objects): it
    # said "buffer sizes (bytes) must be integers, got nan"
    for bad in (float("nan"), float("inf"), Decimal("-Infinity")):
        with pytest.raises(ValueError, match=r"^buffer sizes \(bytes\) must be finite numbers$"):
            plan_layout([0, 0], [0, 0], [2**70, bad])
    # a bound on the int64 arithmetic, not a claim about the layout
    with pytest.raises(ValueError, match="too large to lay out in int64"):
        plan_layout([0, 1], [0, 1], [2**62, 2**62])


def test_a_buffer_takes_the_smallest_gap_that_holds_it_exactly_or_not():
    # NOTE [ Greedy-by-size packing ]: the smallest large-enough gap among the
    # conflicting buffers, else on top. Buffers 1 and 3 die at op 1 and leave
    # gaps of 9 bytes (offsets 10..19) and 7 bytes (27..34) for later buffers.
    alloc = [0, 0, 0, 0, 0, 5]
    free = [9, 1, 9, 1, 9, 6]
    lay = plan_layout(alloc, free, [10, 9, 8, 7, 6, 5], alignment=1)
    assert list(lay.offsets) == [0, 10, 19, 27, 34, 27]     # the 7-byte gap, not the 9
    assert lay.reserved_bytes == 40
    lay.verify()
    # A gap exactly the buffer's size is taken (8 bytes at 10..18 for the last one)
    lay = plan_layout([0, 0, 0, 5], [9, 1, 9, 6], [10, 8, 8, 8], alignment=1)
    assert list(lay.offsets) == [0, 10, 18, 10]
    assert lay.reserved_bytes == lay.peak_live_bytes == 26
    lay.verify()


def test_verify_layout_counts_both_ends_of_a_lifetime():
    # Inclusive intervals: a buffer freed at op 3 still shares op 3 with one
    # allocated there, whichever comes first in the arrays
    for alloc, free in (([0, 3], [3, 5]), ([3, 0], [5, 3])):
        with pytest.raises(LayoutError) as info:
            verify_layout([0, 128], [256, 256], alloc, free)
        assert info.value.pair == (0, 1)
    verify_layout([0, 128], [256, 256], [0, 4], [3, 5])    # op 3, then op 4: fine


def test_a_plain_copy_beside_its_abar_stays_live_and_weights_stay_weights():
    # L and B i release a plain a_i only when abar_i is not resident (Table 2.1;
    # the simulator keeps it): here a1 and a2 sit beside abar1 and abar2 and stay
    # live to the end (free == n_ops). No transfers: live bytes per op equal the
    # simulator's mem column.
    chain = P.Chain(u_f=[1, 1], u_b=[1, 1], x=[10, 20], xbar=[30, 40], w=[5, 6], x0=7)
    sched = P.Schedule.from_text("F_ck 0, F_all 0, F_ck 1, F_all 1, L, B 1, B 0")
    lt = lifetimes(chain, sched)
    by = {name: (int(lt.alloc[i]), int(lt.free[i])) for i, name in enumerate(lt.names)}
    assert by["a1"] == (0, 7) and by["a2"] == (2, 7)
    res = P.simulate(chain, sched, BIG)
    assert lt.live_bytes()[1:-1].tolist() == res.timeline["mem"].tolist()
    # weights brought back by w_prefetch are weights, like the initial ones
    moved = P.Schedule.from_text("F_all 0, F_all 1, L, w_offload 1, w_prefetch 1, B 1, B 0")
    P.simulate(chain, moved, BIG)
    lt = lifetimes(chain, moved)
    assert [lt.kind_name(i) for i, name in enumerate(lt.names) if name == "w1"] == \
        ["weight", "weight"]


def test_w_delete_frees_the_weights_and_a_recomputed_output_is_workspace():
    chain = P.Chain(u_f=[1, 1], u_b=[1, 1], x=[10, 20], xbar=[30, 40], w=[5, 6], x0=7)
    # w_delete 0 at op 3 frees w0 there (the host holds the master copy);
    # w_prefetch 0 at op 5 brings a new buffer back for B 0
    sched = P.Schedule.from_text("F_all 0, F_all 1, L, w_delete 0, B 1, w_prefetch 0, B 0")
    res = P.simulate(chain, sched, BIG)
    lt = lifetimes(chain, sched)
    w0 = [(int(lt.alloc[i]), int(lt.free[i])) for i, n in enumerate(lt.names) if n == "w0"]
    assert w0 == [(-1, 3), (5, 7)]
    assert lt.peak_live() == res.peak
    # a re-run over a resident output: the fresh copy lives during its op only,
    # as a workspace (the resident abar1 stays the activation)
    rerun = P.Schedule.from_text("F_all 0, F_all 0, F_all 1, L, B 1, B 0")
    lt = lifetimes(chain, rerun)
    kinds = {name: (lt.kind_name(i), int(lt.alloc[i]), int(lt.free[i]))
             for i, name in enumerate(lt.names)}
    assert kinds["abar1 (recomputed)"] == ("workspace", 1, 1)
    assert kinds["abar1"] == ("activation", 0, 5)


def test_equal_sizes_are_placed_in_allocation_order_and_equal_gaps_lowest_first():
    # NOTE [ Greedy-by-size packing ]: ties in size go by earlier allocation, so
    # the buffer allocated at op 0 is placed first, at offset 0, whatever the
    # order of the arrays
    lay = plan_layout([3, 0], [9, 5], [8, 8], alignment=1)
    assert list(lay.offsets) == [8, 0]
    # Of two smallest gaps of one size, the lower: A (10 bytes) at 0, then the
    # 7-byte B, C, D in index order at 10, 17, 24, E at 31. B and D die at op 1,
    # leaving two 7-byte gaps (10..17 and 24..31) for F, live at ops 5..6.
    lay = plan_layout([0, 0, 0, 0, 0, 5], [9, 1, 9, 1, 9, 6], [10, 7, 7, 7, 6, 5],
                      alignment=1)
    assert list(lay.offsets) == [0, 10, 17, 24, 31, 10]
    assert lay.reserved_bytes == 37
    lay.verify()


def test_zero_byte_buffers_take_one_alignment_as_in_the_allocator():
    # BestFitAllocator.allocate(0) takes one alignment; the layout must reserve
    # the same, and two such buffers live together must not share an offset
    lay = plan_layout([0, 0], [1, 1], [0, 0], alignment=256)
    assert lay.sizes.tolist() == [256, 256]
    assert sorted(lay.offsets.tolist()) == [0, 256]
    assert lay.reserved_bytes == lay.peak_live_bytes == 512


def test_peak_live_counts_aligned_sizes():
    # two 1-byte buffers live together take 256 aligned bytes each
    lay = plan_layout([0, 0], [0, 0], [1, 1], alignment=256)
    assert lay.peak_live_bytes == lay.reserved_bytes == 512


def test_layout_input_edge_cases():
    from fractions import Fraction
    # -2**63 is an int64: a float op index of exactly -2**63 is taken
    lay = plan_layout(np.array([-2.0 ** 63, 0.0]), [0, 0], [8, 8], alignment=1)
    assert lay.alloc.tolist() == [-2 ** 63, 0] and lay.peak_live_bytes == 16
    # a bool among Python number objects is refused, as in a bool array
    with pytest.raises(ValueError, match="must be integers, got True"):
        plan_layout([0, 0], [0, 0], np.array([Fraction(3, 2), True], dtype=object))
    # 2-D arrays of one shape are refused, not laid out
    with pytest.raises(ValueError, match="1-D"):
        plan_layout([[0, 0]], [[1, 1]], [[8, 8]])


def test_verify_layout_refuses_an_offset_of_minus_one_and_an_end_at_2_63():
    # -1 is plan_layout's "not placed yet"
    with pytest.raises(LayoutError, match="buffer 0 has no offset"):
        verify_layout([-1], [8], [0], [0])
    with pytest.raises(ValueError, match="2\\*\\*63"):
        verify_layout([2 ** 62], [2 ** 62], [0], [0])     # ends exactly at 2**63
    verify_layout([2 ** 62], [2 ** 62 - 1], [0], [0])     # one byte less: fine
