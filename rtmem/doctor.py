"""``rtmem doctor``: report what the runtime finds on this machine.

Prints the backend that would be chosen (and why), the GPU(s), the CUDA driver
and runtime versions, CuPy and numba(-cuda) versions, and the pinned-memory
ceiling (``RLIMIT_MEMLOCK`` and the host memory available). Nothing here fails
on a machine without a GPU: missing pieces are reported with what to install.
"""

from __future__ import annotations

import json
import os

from .units import format_bytes

__all__ = ["collect", "register", "run"]


def _numba_info() -> dict:
    info = {}
    try:
        import numba
        info["numba"] = numba.__version__
    except ImportError as exc:
        info["numba"] = None
        # numba refuses, with an ImportError, a numpy (or Python) newer than it
        # supports ("Numba needs NumPy 2.4 or less"): the report said "not
        # installed" and sent users to install what they had. Say which numba is
        # there and why it does not import.
        try:
            from importlib.metadata import version
            info["numba_installed"] = version("numba")
        except Exception:   # really not installed
            return info
        info["numba_error"] = f"{type(exc).__name__}: {exc}"
        return info
    try:
        from importlib.metadata import version
        info["numba_cuda"] = version("numba-cuda")
    except Exception:   # not installed as a separate package: numba's own cuda
        info["numba_cuda"] = None
    # The simulator (NUMBA_ENABLE_CUDASIM=1) says "available" with no GPU and
    # has no NVVM: report it as what it is.
    info["numba_cuda_simulator"] = bool(getattr(numba.config, "ENABLE_CUDASIM", False))
    try:
        from numba import cuda
        info["numba_cuda_available"] = bool(cuda.is_available())
    except Exception as exc:   # reported, doctor never raises
        info["numba_cuda_available"] = False
        info["numba_cuda_error"] = f"{type(exc).__name__}: {exc}"
    try:
        # The DHA kernels compile through NVVM (libnvvm + libdevice, from the CUDA
        # toolkit or the nvidia-nvvm wheel); the driver alone is not enough.
        from numba.cuda.cudadrv import nvvm
        # The simulator's nvvm stub says "not available": the report then told
        # to set CUDA_HOME, which the simulator never reads.
        info["numba_cuda_nvvm"] = None if info["numba_cuda_simulator"] else \
            bool(nvvm.is_available())
    except Exception:   # no numba.cuda: no NVVM to report
        info["numba_cuda_nvvm"] = None
    if info["numba_cuda_nvvm"] is False:
        try:            # is_available() hides why: loading it again says
            nvvm.NVVM()
        except Exception as exc:  # noqa: BLE001 - reported, doctor never raises
            info["numba_cuda_nvvm_error"] = f"{type(exc).__name__}: {exc}"
    # numba-cuda looks for libNVVM under CUDA_HOME once it is set, and only there.
    info["CUDA_HOME"] = os.environ.get("CUDA_HOME")
    return info


def collect() -> dict:
    """Everything ``rtmem doctor`` reports, as a dict (bytes for sizes)."""
    from .backends import BACKENDS, cuda_available
    from .backends.cuda import describe_cuda
    report = {"RTMEM_BACKEND": os.environ.get("RTMEM_BACKEND")}
    try:
        from .backends import backend_name
        report["backend"] = backend_name()
    except Exception as exc:   # a bad RTMEM_BACKEND: report it
        report["backend"] = None
        report["backend_error"] = str(exc)
    report["backends"] = list(BACKENDS)
    report["gpu_usable"] = cuda_available()
    report["cuda"] = describe_cuda()
    report.update(_numba_info())
    return report


def _lines(r: dict) -> list[str]:
    cuda = r["cuda"]
    out = [f"backend          {r['backend'] or 'invalid'}"
           + (f"  (RTMEM_BACKEND={r['RTMEM_BACKEND']})" if r["RTMEM_BACKEND"] else
              "  (automatic: cuda if a GPU is usable, else host)")]
    if r.get("backend_error"):
        out.append(f"  ! {r['backend_error']}")
    cupy = cuda.get("cupy") or "not installed (pip install rtmem[cuda12] or rtmem[cuda13])"
    out.append(f"cupy             {cupy}")
    if cuda.get("error") and cuda.get("cupy"):
        out.append(f"  ! {cuda['error']}")
    if "driver_version" in cuda:
        out.append(f"cuda driver      {cuda['driver_version']}   runtime {cuda['runtime_version']}")
    for dev in cuda.get("devices", []):
        out.append(f"gpu {dev['id']}            {dev['name']}, {format_bytes(dev['total_bytes'])}, "
                   f"sm {dev['compute_capability']}, map host memory: "
                   f"{'yes' if dev['can_map_host_memory'] else 'no'}")
    if not cuda.get("devices"):
        out.append("gpu              none found")
    if r.get("numba_error"):
        # installed but refused to import: numba-cuda is unusable too
        out.append(f"numba            {r.get('numba_installed')} is installed but does not "
                   f"import: kernels and CPU Adam cannot run")
        out.append(f"  ! {r['numba_error']} (install a numba release that supports "
                   f"this numpy and Python)")
        return out + _pinned_lines(r)
    out.append(f"numba            {r.get('numba') or 'not installed'}")
    nc = r.get("numba_cuda") or "numba's built-in numba.cuda"
    nvvm = {True: "yes", False: "no (kernels cannot compile)", None: "unknown"}[
        r.get("numba_cuda_nvvm")]
    if r.get("numba_cuda_simulator"):
        out.append(f"numba-cuda       {nc}; the CUDA simulator (NUMBA_ENABLE_CUDASIM=1): "
                   f"kernels run on the CPU, no GPU is used")
    else:
        out.append(f"numba-cuda       {nc}; usable: "
                   f"{'yes' if r.get('numba_cuda_available') else 'no'}; NVVM: {nvvm}; "
                   f"CUDA_HOME={r.get('CUDA_HOME') or 'unset'}")
    if r.get("numba_cuda_nvvm_error"):
        out.append(f"  ! {r['numba_cuda_nvvm_error']} (set CUDA_HOME to a CUDA toolkit "
                   f"that has nvvm/, or install the nvidia-nvvm wheel)")
    return out + _pinned_lines(r)


def _pinned_lines(r: dict) -> list[str]:
    cuda = r["cuda"]
    lim = cuda.get("memlock_limit_bytes")
    avail = cuda.get("host_available_bytes")
    # cudaHostAlloc pins through the driver, bounded by host memory; RLIMIT_MEMLOCK
    # bounds mlock / cudaHostRegister of existing memory.
    return [f"pinned limit     host available {format_bytes(avail) if avail else 'unknown'} "
            f"(cudaHostAlloc); memlock rlimit "
            f"{'unlimited' if lim is None else format_bytes(lim)} (mlock, cudaHostRegister)"]


def run(args) -> int:
    """Print the report (``--json`` for JSON). Returns 0, or 1 when the selected
    backend cannot run (e.g. RTMEM_BACKEND=cuda without a usable GPU)."""
    report = collect()
    if getattr(args, "json", False):
        print(json.dumps(report, indent=2, default=str))
    else:
        print("\n".join(_lines(report)))
    if report["backend"] is None or (report["backend"] == "cuda" and not report["gpu_usable"]):
        return 1
    return 0


def register(subparsers) -> None:
    """Add the ``doctor`` subcommand to an argparse ``subparsers`` object; its
    ``func(args)`` returns the exit code."""
    p = subparsers.add_parser("doctor", help="report GPU, driver, CuPy, numba, numba-cuda "
                                              "and pinned-memory limits",
                              description=__doc__.splitlines()[0].replace("``", ""))
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)
