"""Hooks that make other libraries allocate from rtmem arenas.

- :mod:`rtmem.integrations.cupy`: a CuPy allocator (``cupy.cuda.set_allocator``).
- :mod:`rtmem.integrations.numba_emm`: a numba.cuda External Memory Manager.

Each imports its library only when called and raises ``ModuleNotFoundError``
naming the extra to install (``pip install rtmem[cuda12]``) when it is missing.
"""

from ..units import parse_bytes

__all__ = ["cupy", "numba_emm"]


def check_arena(arena, kind: str, library: str) -> None:
    """Refuse, before anything changes, an arena or kind that ``library``'s
    allocations could not come from (they would fail at every allocation)."""
    from ..arena import is_arena
    from ..buffer import KINDS, bad_kind
    if not is_arena(arena):
        raise TypeError(f"{library} needs an rtmem DeviceArena on the cuda backend; got "
                        f"{type(arena).__name__}")
    if arena.backend.name != "cuda" or arena.location != "device":
        raise ValueError(f"{library} needs device memory of the cuda backend; got a "
                         f"{arena.location} arena on the {arena.backend.name} backend")
    if kind not in KINDS:
        raise bad_kind(kind)
    # A closed arena was accepted, and then every allocation failed.
    arena._check_open()


def alloc_exported(arena, nbytes, kind: str, stream, export):
    """``export(buf, address, keep)`` of a new buffer of ``nbytes`` bytes (at
    least one): ``address`` its device address, ``keep`` the allocation of its
    slab, which the library's memory object must hold until the library frees
    the buffer, so the memory outlives ``arena.close()`` as ``buf.cupy()`` views
    do (close() only drops the arena's reference to a slab). The buffer is freed
    again if the export raises, so a failed hand-over leaks nothing."""
    # At least a byte: a zero-byte buffer exports a null pointer (the CUDA array
    # interface's rule for empty arrays), and the libraries expect an address.
    # Sizes are read as arena.alloc reads them: max(int(nbytes), 1) gave a -1
    # request a byte and a 10.5-byte one 10. arena.alloc does the frees a
    # garbage collection deferred.
    size = nbytes if nbytes.__class__ is int and nbytes > 0 else max(parse_bytes(nbytes), 1)
    buf = arena.alloc(size, kind=kind, stream=stream)
    try:
        p = buf.primary
        return export(buf, p.slab.device_ptr + p.offset, p.slab.owner)
    except BaseException:
        buf.free()
        raise
