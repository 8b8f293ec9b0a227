import math
import re

import numpy as np
import pytest

from rtmem.errors import PlatformError, UnitError
from rtmem.planners import Platform
from rtmem.units import (format_bandwidth, format_bytes, format_seconds, parse_bandwidth,
                         parse_bytes, parse_seconds)


@pytest.mark.parametrize("text, value", [
    ("12GiB", 12 * 2**30), ("12 GB", 12 * 10**9), ("512", 512), ("1.5 KiB", 1536),
    ("4kB", 4000), (100, 100), (2.5, 3), ("3 bytes", 3), ("1e3", 1000),
])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("bad", ["twelve", "-1", "12 XB", "1 GiB/s", True, math.nan, -5])
def test_parse_bytes_errors(bad):
    with pytest.raises(UnitError):
        parse_bytes(bad)


def test_negative_quantities_are_called_negative():
    # "-5GiB" used to be reported as unreadable, hiding the real problem
    for parse, text in ((parse_bytes, "-5GiB"), (parse_bandwidth, "-3 GB/s"),
                        (parse_seconds, "-2 ms")):
        with pytest.raises(UnitError, match=">"):
            parse(text)


def test_bandwidth_and_time():
    assert parse_bandwidth("12 GB/s") == 12e9
    assert parse_bandwidth("16GiB/s") == 16 * 2**30
    assert parse_bandwidth("inf") == math.inf
    for bad in ("0", "-3 GB/s", "fast"):
        with pytest.raises(UnitError):
            parse_bandwidth(bad)
    assert parse_seconds("3 ms") == pytest.approx(3e-3)
    with pytest.raises(UnitError):
        parse_seconds("soon")


def test_formatting():
    assert format_bytes(12 * 2**30) == "12.00 GiB"
    assert format_bytes(100) == "100 B"
    assert format_bandwidth(12e9) == "12.00 GB/s"
    assert format_seconds(0.0123) == "12.300 ms"
    assert format_bytes(math.inf) == "inf"


def test_platform():
    p = Platform("12GiB", "12 GB/s", "duplex")
    assert p.memory == 12 * 2**30 and p.bandwidth == 12e9 and p.channel == "duplex"
    assert str(p) == "12.00 GiB device memory, 12.00 GB/s duplex channel"
    # no "inf shared channel": an infinite bandwidth is no channel at all
    assert str(Platform("inf")) == ("unlimited device memory, "
                                    "instant transfers (infinite bandwidth)")
    assert Platform("inf").memory_limit == 2**62
    # 2**62 bytes and more stand for unlimited memory; one byte less is a budget
    for memory in (2**62, float(2**62), 2**63):
        assert Platform(memory).memory == math.inf
        assert str(Platform(memory)).startswith("unlimited device memory")
    assert Platform(2**62 - 1).memory == 2**62 - 1 == Platform(2**62 - 1).memory_limit
    for kwargs, fragment in [(dict(memory=0), "> 0 bytes"), (dict(memory=-5), "> 0 bytes"),
                             (dict(memory="lots"), "invalid memory"),
                             (dict(memory=10, bandwidth=0), "invalid bandwidth"),
                             (dict(memory=10, channel="tri"), "channel must be")]:
        with pytest.raises(PlatformError, match=fragment):
            Platform(**kwargs)


def test_a_budget_below_one_byte_says_it_rounds_down_to_zero():
    # "memory must be > 0 bytes, got 0.9": 0.9 is > 0, it was rounded down first
    for memory in (0.9, "0.5 B", "0.9", "0.0001 KiB"):
        with pytest.raises(PlatformError, match=r"rounds down to 0 bytes .* give at least "
                                                r"1 byte") as err:
            Platform(memory)
        assert repr(memory) in str(err.value) and "> 0" not in str(err.value)
    assert Platform(1.9).memory == 1
    for memory in (0, 0.0, "0", "0 B"):         # zero itself is just zero
        with pytest.raises(PlatformError, match=r"must be > 0 bytes, got"):
            Platform(memory)


def test_a_negative_budget_is_told_the_same_bound_as_zero():
    # "-1" said "a size must be finite and >= 0 bytes" (parse_bytes' words), and
    # the 0 it invited was then refused with "> 0"
    from decimal import Decimal
    for memory in (-1, -1.5, "-1", "-1GiB", " -1GiB", "-inf", -2**70, np.array(-2.0),
                   Decimal("-2")):
        _refused_as_not_positive(memory)
    # an array has no one truth value: a PlatformError, not numpy's ValueError
    with pytest.raises(PlatformError, match=r"must be one number .*shape \(2,\)"):
        Platform(np.array([-1, 2]))


def _refused_as_not_positive(memory):
    with pytest.raises(PlatformError, match=r"memory must be > 0 bytes, got") as err:
        Platform(memory)
    assert ">= 0" not in str(err.value) and "Platform(" not in str(err.value)


def test_a_negative_torch_budget_is_told_the_same_bound_as_zero():
    # as above, for a 0-d tensor (torch is an extra: skipped without it)
    torch = pytest.importorskip("torch")
    _refused_as_not_positive(torch.tensor(-2))


def test_integer_sizes_are_exact_and_huge_numbers_are_unit_errors():
    # Through a float, 2**53 + 1 bytes came back as 2**53 (ints and integer
    # strings alike), and an int beyond float's range raised a bare OverflowError.
    assert parse_bytes(2**53 + 1) == 2**53 + 1
    assert parse_bytes(str(2**53 + 1)) == 2**53 + 1
    assert parse_bytes("9007199254740993 B") == 2**53 + 1
    assert parse_bytes(f"{2**54 + 7} KiB") == (2**54 + 7) * 1024
    assert parse_bytes("-0") == 0 and parse_bytes("1e3 MiB") == 1000 * 2**20
    for parse in (parse_bytes, parse_seconds):
        with pytest.raises(UnitError):
            parse(-(10**400))
    with pytest.raises(UnitError, match="finite"):
        parse_seconds(10**400)
    assert parse_bandwidth(10**400) == math.inf      # as the string "1e400"
    with pytest.raises(UnitError, match=">= 0"):
        parse_bytes(-(2**70))


def test_formatting_rounds_into_the_next_unit_and_keeps_signs():
    # 1048575 B printed "1024.00 KiB" and 0.9999999 s "1000.000 ms"; -inf printed
    # "inf", nan "nan PiB", and -0.0 s "-0.0 ns".
    assert format_bytes(1048575) == "1.00 MiB"
    assert format_bytes(2**30 - 1, binary=False) == "1.07 GB"
    assert format_bytes(999_999, binary=False) == "1.00 MB"
    assert format_bandwidth(999.999) == "1.00 kB/s" and format_bandwidth(999) == "999 B/s"
    assert format_seconds(0.9999999) == "1.000 s"
    assert format_seconds(0.0009999999) == "1.000 ms"
    assert format_seconds(-0.0) == "0.0 ns" and str(parse_seconds("-0")) == "0.0"
    for fmt in (format_bytes, format_bandwidth, format_seconds):
        assert fmt(-math.inf) == "-inf" and fmt(math.inf) == "inf"
        assert fmt(math.nan) == "nan"


def test_is_whole_refuses_numpy_and_torch_bools_as_it_refuses_bools():
    # np.True_ passed as 1 (plan_layout(alignment=np.True_) laid out with
    # alignment 1), where True is refused and parse_bytes refuses both; torch's
    # bool tensor passed too, and a 0-d tensor's answer was a tensor (the torch
    # half is test_is_whole_refuses_torch_bools_as_it_refuses_bools)
    from rtmem.layout import plan_layout
    from rtmem.units import is_whole
    for value in (True, np.True_, np.bool_(False), np.array(True)):
        assert is_whole(value) is False, value
    for value in (4, np.int64(4), 4.0, np.float32(4.0), np.array(4)):
        assert is_whole(value) is True, value
    with pytest.raises(ValueError, match="power of two"):
        plan_layout([0], [1], [8], alignment=np.True_)


def test_is_whole_refuses_torch_bools_as_it_refuses_bools():
    # torch is an extra: skipped without it
    torch = pytest.importorskip("torch")
    from rtmem.units import is_whole
    assert is_whole(torch.tensor(True)) is False
    assert is_whole(torch.tensor(4)) is True
    with pytest.raises(UnitError, match="must be a number"):
        parse_bytes(torch.tensor(True))


def test_arrays_of_one_element_are_refused_as_sizes_as_numpy_and_torch_alike():
    # torch.tensor([4096]) passed as 4096 (is_whole True, parse_bytes 4096 bytes,
    # plan_layout aligned to tensor([8]), Chain(x0=tensor([3])) took 3 bytes)
    # where numpy 2 refuses np.array([4096]); 0-d arrays and tensors still pass
    torch = pytest.importorskip("torch")
    from rtmem.planners.chain import Chain
    from rtmem.errors import ChainError
    from rtmem.layout import plan_layout
    from rtmem.units import is_whole
    for make in (np.array, torch.tensor):
        assert is_whole(make(4096)) is True
        assert parse_bytes(make(4096)) == 4096
        for value in (make([4096]), make([[4096]])):
            assert is_whole(value) is False, value
            for parse in (parse_bytes, parse_bandwidth, parse_seconds):
                with pytest.raises(UnitError, match=r"one number .*array of shape \(1"):
                    parse(value)
        with pytest.raises(ValueError, match="power of two"):
            plan_layout([0], [1], [8], alignment=make([8]))
        for memory in (make([2**30]), make([-5])):
            # not "must be > 0 bytes" for the [-5]: the shape is what is wrong
            with pytest.raises(PlatformError, match=r"invalid memory: .*shape \(1,\)"):
                Platform(memory)
        with pytest.raises(PlatformError, match=r"invalid bandwidth .*shape \(1,\)"):
            Platform(2**30, make([10**9]))
        with pytest.raises(ChainError, match=r"x0 must be one number, .*shape \(1,\)"):
            Chain(u_f=[1], u_b=[1], x=[1], xbar=[1], x0=make([3]))
    from rtmem.arena import HostArena
    arena = HostArena("64KiB")
    try:
        with pytest.raises(UnitError, match=r"shape \(1,\)"):
            arena.alloc(torch.tensor([4096]))
        assert arena.stats().alloc_count == 0
    finally:
        arena.close()


def test_integer_strings_of_up_to_40_digits_are_exact():
    # digit strings of up to 40 digits are read as ints (exact); through a float
    # "1" * 40 bytes became 1111111111111111161655750653203590414336
    assert parse_bytes("1" * 40) == int("1" * 40)
    assert parse_bytes("1" * 40 + " KiB") == int("1" * 40) * 1024


def test_a_negative_number_beyond_floats_range_is_a_negative_bandwidth():
    # float(-(10**400)) overflows: it is read as -inf, so refused, not as +inf
    for value in (-(10**400), "-1e400"):
        with pytest.raises(UnitError, match="> 0"):
            parse_bandwidth(value)


@pytest.mark.parametrize("text, secs", [
    ("20us", 20e-6), ("20 µs", 20e-6), ("7 ns", 7e-9), ("1.5 min", 90.0), ("2h", 7200.0),
    ("250 ms", 0.25), ("3 s", 3.0), ("4", 4.0),
])
def test_parse_seconds_units(text, secs):
    assert parse_seconds(text) == pytest.approx(secs, rel=1e-12)


@pytest.mark.parametrize("text", ["-inf", "-Infinity", "-∞", "-unlimited", "nan", "-nan",
                                  "NaN", " -inf "])
def test_a_non_positive_or_nan_bandwidth_word_gets_the_bandwidth_error(text):
    # "-inf" and "nan" said "cannot read '-inf' as a bandwidth; write it like ...
    # 'inf'", sending the user to spell it better, while the float -inf got
    # "must be > 0 bytes/s"; words float() reads are judged as the numbers are
    with pytest.raises(UnitError, match=r"a bandwidth must be > 0 bytes/s, got "):
        parse_bandwidth(text)
    with pytest.raises(PlatformError, match=r"must be > 0 bytes/s"):
        Platform(memory=2**30, bandwidth=text)


@pytest.mark.parametrize("text", ["+inf", "+Infinity", "INF"])
def test_a_signed_plus_infinity_is_an_unlimited_bandwidth(text):
    assert parse_bandwidth(text) == math.inf


@pytest.mark.parametrize("text", ["+inf", "Infinity", "+Infinity", "INF", " unlimited ", "∞"])
def test_every_infinity_word_is_an_unlimited_memory_budget(text):
    # Platform's memory read only 'inf' and 'unlimited' as unlimited; the other
    # words the bandwidth takes for infinity ('+inf', 'Infinity', '∞') got "a size
    # must be finite", contradicting the 'inf' it accepts
    assert Platform(memory=text).memory == math.inf
    assert Platform(memory=text, bandwidth=text).bandwidth == math.inf


@pytest.mark.parametrize("parse, text, fragment", [
    (parse_bytes, "-inf", "a size must be finite and >= 0 bytes, got '-inf'"),
    (parse_bytes, "inf", "a size must be finite and >= 0 bytes, got 'inf'"),
    (parse_bytes, "nan", "a size must be finite and >= 0 bytes, got 'nan'"),
    (parse_seconds, "-inf", "a duration must be finite and >= 0 seconds, got '-inf'"),
    (parse_seconds, "Infinity", "a duration must be finite and >= 0 seconds"),
    (parse_seconds, "nan", "a duration must be finite and >= 0 seconds, got 'nan'"),
])
def test_infinite_or_nan_sizes_and_durations_are_told_the_range(parse, text, fragment):
    # as the floats inf and nan are: "cannot read 'inf' as a size" hid that the
    # value was read and is out of range
    with pytest.raises(UnitError, match=re.escape(fragment)):
        parse(text)


@pytest.mark.parametrize("parse, text, meant, value, bits", [
    (parse_bytes, "800mb", "800MB", 800 * 10**6, False),
    (parse_bytes, "1.5gib", "1.5GiB", 3 * 2**29, False),
    (parse_bytes, "2 GIB", "2 GiB", 2 * 2**30, False), (parse_bytes, "1 kib", "1 KiB", 1024, False),
    (parse_bytes, "800m", "800M", 800 * 10**6, False), (parse_bytes, "64kb", "64kB", 64000, False),
    (parse_bytes, " 5 mbytes", "5 Mbytes", 5 * 10**6, False),
    (parse_bandwidth, "12 gb/s", "12 GB/s", 12e9, True),
    (parse_bandwidth, "3mbps", "3MBps", 3e6, True),
    (parse_bandwidth, "16gib/s", "16GiB/s", 16 * 2**30, True),
    (parse_bandwidth, "2 TBytes/S", "2 Tbytes/s", 2e12, False),
])
def test_a_unit_refused_for_its_case_suggests_the_spelling_it_means(parse, text, meant, value,
                                                                     bits):
    # case matters (m would be milli), but "cannot read '800mb'" did not say so
    with pytest.raises(UnitError) as e:
        parse(text)
    message = str(e.value)
    assert f"unit letters are case-sensitive (m would be milli, b bits): did you mean " \
           f"{meant!r}" in message
    assert ("divide a bit rate by 8" in message) == bits
    assert parse(meant) == value       # the suggestion reads as the letters say


@pytest.mark.parametrize("parse, text", [
    (parse_bytes, "7xb"), (parse_bytes, "12 gb/s"), (parse_bytes, "5 mib mib"),
    (parse_bandwidth, "800 gib"), (parse_bandwidth, "12"[:0] + "gb/s"),
])
def test_unreadable_units_get_no_case_suggestion(parse, text):
    with pytest.raises(UnitError, match="cannot read") as e:
        parse(text)
    assert "did you mean" not in str(e.value)
