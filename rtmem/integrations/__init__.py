"""Hooks that make other libraries allocate from rtmem arenas.

- :mod:`rtmem.integrations.cupy`: a CuPy allocator (``cupy.cuda.set_allocator``).
- :mod:`rtmem.integrations.numba_emm`: a numba.cuda External Memory Manager.

Each imports its library only when called and raises ``ModuleNotFoundError``
naming the extra to install (``pip install rtmem[cuda12]``) when it is missing.
"""

__all__ = ["cupy", "numba_emm"]
