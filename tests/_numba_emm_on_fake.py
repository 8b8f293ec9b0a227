"""Run by tests/test_cuda_backend_fake.py in a child process: the numba EMM plugin
on the fake CuPy. The child runs numba.cuda without the simulator (which has no
EMM), as a user with a GPU would; nothing here touches the CUDA driver."""

import gc
import pathlib
import sys
import types

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import _fake_cupy  # noqa: E402

fc = _fake_cupy.build(device=0, device_count=1, device_bytes=64 << 20,
                      host_bytes=64 << 20)
sys.modules.update(fc.modules)

from numba.cuda.cudadrv import driver  # noqa: E402

from rtmem.arena import DeviceArena, HostArena  # noqa: E402
from rtmem.integrations import numba_emm  # noqa: E402

driver._logger = driver.make_logger()   # what initializing the real driver does

arena = DeviceArena(1 << 20, backend="cuda")
numba_emm.install(arena)
# A refused install leaves the plugged-in arena in place.
for bad, error in ((HostArena(1 << 16, backend="cuda"), ValueError),
                   (DeviceArena(1 << 16, backend="host"), ValueError),
                   (object(), TypeError)):
    try:
        numba_emm.install(bad)
    except error:
        pass
    else:
        raise AssertionError(f"install({bad!r}) was accepted")
    assert numba_emm._arena is arena


class Context:      # memalloc and defer_cleanup never touch the context
    def __init__(self, device=0):   # numba's Context.device: its Device (a proxy)
        self.device = types.SimpleNamespace(id=device)


mgr = numba_emm.manager_class()(context=Context())
mgr.initialize()
assert mgr.arena is arena and mgr.deallocations.memory_capacity == arena.core.max_bytes

# numba's context for another device is refused: it was bound to the one arena,
# so numba's arrays on device 1 got device 0's memory. The default arena is not
# made for it either (half the free memory of a device the context cannot use).
from rtmem.errors import BackendError  # noqa: E402

for plugged in (arena, None):
    numba_emm._arena = plugged
    other = numba_emm.manager_class()(context=Context(device=1))
    try:
        other.initialize()
    except BackendError as exc:
        assert "context for device 1" in str(exc) and "on device 0" in str(exc), exc
        assert "one process per GPU" in str(exc), exc
    else:
        raise AssertionError(f"a device-1 context was bound to {other.arena!r}")
    assert numba_emm._arena is plugged and not hasattr(other, "arena")
numba_emm._arena = arena
assert arena.stats().count_by_kind["workspace"] == 0


def live():
    return arena.stats().count_by_kind["workspace"]


# get_memory_info: the arena's capacity, not its reserved size (a growable arena
# said it held a quarter of what fits)
growable = DeviceArena(1 << 20, max_bytes=4 << 20, backend="cuda")
numba_emm.install(growable)
grow_mgr = numba_emm.manager_class()(context=Context())
grow_mgr.initialize()
info = grow_mgr.get_memory_info()
assert (info.free, info.total) == (4 << 20, 4 << 20), info
held = grow_mgr.memalloc(4096)
info = grow_mgr.get_memory_info()
assert info.total == 4 << 20 and info.free == (4 << 20) - growable.stats().allocated_bytes
del held, grow_mgr
gc.collect()

# ... and no more than a LimitAdaptor's budget lets it hand out (a 64 KiB budget
# on a 1 MiB arena said 1 MiB free and total)
from rtmem.adaptors import LimitAdaptor, StatisticsAdaptor  # noqa: E402

budgeted = DeviceArena(1 << 20, backend="cuda",
                       adaptors=[lambda up: LimitAdaptor(up, 64 << 10), StatisticsAdaptor])
numba_emm.install(budgeted)
budget_mgr = numba_emm.manager_class()(context=Context())
budget_mgr.initialize()
assert budget_mgr.deallocations.memory_capacity == 64 << 10
info = budget_mgr.get_memory_info()
assert (info.free, info.total) == (64 << 10, 64 << 10), info
held = budget_mgr.memalloc(5000)                    # 5120 bytes of the budget
info = budget_mgr.get_memory_info()
assert (info.free, info.total) == ((64 << 10) - 5120, 64 << 10), info
held_too = budget_mgr.memalloc(info.free)           # all that is said to be free fits
assert budget_mgr.get_memory_info().free == 0
del held, held_too, budget_mgr
gc.collect()
numba_emm.install(arena)


# numba's defer_cleanup keeps freed memory reserved while it is active.
a = mgr.memalloc(4096)
address = a.device_pointer_value   # an int with either pointer type
assert all(b.stream is None for b in arena.core.live_blocks())    # UNORDERED
with mgr.defer_cleanup():
    del a
    gc.collect()
    assert live() == 1, "freed inside defer_cleanup"
    b = mgr.memalloc(4096)
    assert b.device_pointer_value != address, "reused inside defer_cleanup"
mgr.deallocations.clear()
assert live() == 1
del b
gc.collect()
mgr.deallocations.clear()
assert live() == 0

# Pending frees are flushed when the arena runs out, as numba's own manager does.
mgr.deallocations.memory_capacity = 1 << 40         # keep them pending
held = [mgr.memalloc(300 << 10) for _ in range(3)]  # most of the arena
del held
gc.collect()
assert live() == 3 and len(mgr.deallocations) == 3
again = mgr.memalloc(300 << 10)
assert live() == 1 and len(mgr.deallocations) == 0
del again
gc.collect()
mgr.deallocations.clear()


# numba's device memory outlives arena.close(): a MemoryPointer held its buffer
# but not the slab, so close() cudaFree'd memory numba still pointed at. The
# slab goes with numba's deferred free of the last such allocation.
import numpy as np  # noqa: E402

short = DeviceArena(1 << 16, backend="cuda")
short_mgr = numba_emm.manager_class()(context=Context())
short_mgr.arena = short
data = np.random.default_rng().standard_normal(64).astype(np.float32)
mem = short_mgr.memalloc(data.nbytes)
slab_ptr = short.slabs[0].ptr
fc.host_view(mem.device_pointer_value, data.nbytes)[:] = data.view(np.uint8)
short.close()
assert slab_ptr in fc.live, "close() freed memory numba still holds"
seen = fc.host_view(mem.device_pointer_value, data.nbytes).view(np.float32)
assert (seen == data).all(), "numba's memory was overwritten by close()"
with short_mgr.defer_cleanup():
    del mem, seen
    gc.collect()
    assert slab_ptr in fc.live, "freed while numba defers its frees"
short_mgr.deallocations.clear()
assert slab_ptr not in fc.live, "the slab outlived numba's last allocation"
del short_mgr

# A failed hand-over frees the buffer it allocated.
def broken(driver, address):
    raise RuntimeError("no pointer")


real_device_pointer = numba_emm._device_pointer
numba_emm._device_pointer = broken
try:
    mgr.memalloc(4096)
except RuntimeError:
    pass
else:
    raise AssertionError("memalloc did not raise")
assert live() == 0

# A bad RTMEM_NUMBA_ARENA_BYTES is named in the error: numba makes the default
# arena while it creates its context, and the message alone said "pass the slab
# size in bytes (e.g. 1 << 30)" or "use a smaller arena (nbytes=)".
import os  # noqa: E402

from rtmem.errors import OutOfMemoryError, UnitError  # noqa: E402

numba_emm._arena = None
for value, error in (("0", ValueError), ("12 parsecs", UnitError),
                     ("1GiB", OutOfMemoryError)):
    os.environ["RTMEM_NUMBA_ARENA_BYTES"] = value
    try:
        numba_emm.manager_class()(context=Context()).initialize()
    except error as exc:
        assert str(exc).startswith(f"RTMEM_NUMBA_ARENA_BYTES={value!r}: "), exc
        assert "unset it" in str(exc), exc
        if error is OutOfMemoryError:
            assert type(exc) is OutOfMemoryError and exc.requested == 1 << 30, exc
    else:
        raise AssertionError(f"RTMEM_NUMBA_ARENA_BYTES={value!r} was accepted")
    assert numba_emm._arena is None
del os.environ["RTMEM_NUMBA_ARENA_BYTES"]

# install() after numba made a context: numba gives a context its manager when
# it makes it (Device.get_primary_context), so a context with numba's own kept
# cudaMalloc for good while install() returned; one with the plugin moved to the
# new arena only at its next push. Stand-ins for numba's devices and contexts.
numba_emm._device_pointer = real_device_pointer
numba_emm.install(arena)
theirs = Context()
theirs.memory_manager = driver.NumbaCUDAMemoryManager(context=theirs)
driver.driver.devices[0] = types.SimpleNamespace(id=0, primary_context=theirs)
newer = DeviceArena(1 << 16, backend="cuda")
try:
    numba_emm.install(newer)
except BackendError as exc:
    assert "already made its CUDA context for device 0" in str(exc), exc
    assert "before any numba.cuda use" in str(exc), exc
else:
    raise AssertionError("install() after numba's own context was accepted")
assert numba_emm._arena is arena        # refused before anything changed
del driver.driver.devices[0]
mine = Context()
mine.memory_manager = numba_emm.manager_class()(context=mine)
mine.memory_manager.initialize()
driver.driver.devices[0] = types.SimpleNamespace(id=0, primary_context=mine)
numba_emm.install(newer)
assert numba_emm._arena is newer and mine.memory_manager.arena is newer
# numba's deallocation threshold follows the switch: it kept the old arena's
# capacity (16 times the new one), so frees were held back past what fits.
assert mine.memory_manager.deallocations.memory_capacity == 1 << 16
# ... and so does a context rebound at its next push (initialize()).
later = DeviceArena(1 << 17, backend="cuda")
numba_emm._arena = later
mine.memory_manager.initialize()
assert mine.memory_manager.arena is later
assert mine.memory_manager.deallocations.memory_capacity == 1 << 17
numba_emm._arena = newer
mine.memory_manager.initialize()
later.close()
del driver.driver.devices[0]
newer.close()
arena.close()
fc.shutdown()
print("ok")
