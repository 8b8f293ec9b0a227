"""rtmem.kernels: compute kernels (numba CPU kernels and numba.cuda kernels).

Arrays in, arrays out; no runtime objects. Filled in by the kernel issues (CPU
Adam, DHA kernels); numba.cuda is imported lazily by the modules that need it.
"""

__all__: list[str] = []
