"""ccalloc as PyTorch's CUDA allocator.

    import ccalloc_torch
    ccalloc_torch.install()          # before the first CUDA allocation
    ...                              # unchanged model code
    print(ccalloc_torch.memory_summary())

The configuration comes from CCALLOC_CONF (else PYTORCH_CUDA_ALLOC_CONF, else
PYTORCH_ALLOC_CONF), in PyTorch's grammar. torch.cuda.memory_stats() and friends do not
work with a pluggable allocator: use this module's stats(), memory_summary(),
max_memory_reserved(), record_history() and dump_snapshot() instead. torch.cuda.empty_cache()
and torch.cuda.set_per_process_memory_fraction() reach ccalloc when libccalloc_torch.so was
built (it is whenever the build found torch).

Libraries are looked up next to this module (where `pip install` puts them), then in
CCALLOC_LIBRARY_DIR, then in the build folders of the repository this module lives in.
"""

import ctypes
import glob
import json
import os
import warnings

__all__ = [
    "install", "installed", "library_dir", "stats", "memory_summary", "memory_reserved",
    "max_memory_reserved", "memory_allocated", "max_memory_allocated", "reset_peak_memory_stats",
    "empty_cache", "set_memory_fraction", "record_history", "dump_snapshot", "annotate",
]

_lib = None
_installed = None  # "hooks" or "pluggable" once installed
_pluggable = None  # keeps torch's allocator object alive in the fallback path


def library_dir():
    """The folder holding libccalloc.so (and libccalloc_torch.so when built)."""
    here = os.path.dirname(os.path.abspath(__file__))
    if os.path.exists(os.path.join(here, "libccalloc.so")):
        return here
    env = os.environ.get("CCALLOC_LIBRARY_DIR")
    if env:
        return env
    repo = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    candidates = sorted(glob.glob(os.path.join(repo, "build", "*", "lib", "libccalloc.so")) +
                        glob.glob(os.path.join(repo, "build", "lib", "libccalloc.so")),
                        key=os.path.getmtime, reverse=True)
    if not candidates:
        raise RuntimeError("ccalloc_torch: libccalloc.so not found: build ccalloc "
                           "(pip install --no-build-isolation <repository>, scripts/gpu-check or "
                           "cmake) or set CCALLOC_LIBRARY_DIR")
    return os.path.dirname(candidates[0])


def _library():
    global _lib
    if _lib is None:
        path = os.path.join(library_dir(), "libccalloc.so")
        _lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        _lib.ccalloc_last_error.restype = ctypes.c_char_p
        _lib.ccalloc_memory_stats_json.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t,
                                                   ctypes.POINTER(ctypes.c_size_t)]
        _lib.ccalloc_memory_summary.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p,
                                                ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
        _lib.ccalloc_set_memory_fraction.argtypes = [ctypes.c_double, ctypes.c_int]
        _lib.ccalloc_record_history.argtypes = [ctypes.c_char_p, ctypes.c_char_p,
                                                ctypes.c_char_p, ctypes.c_size_t]
        _lib.ccalloc_dump_snapshot.argtypes = [ctypes.c_char_p]
        _lib.ccalloc_annotate.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    return _lib


def _check(status):
    if status != 0:
        raise RuntimeError(_library().ccalloc_last_error().decode(errors="replace"))


def installed():
    """How ccalloc was installed: "hooks", "pluggable", or None."""
    return _installed


def install():
    """Makes ccalloc PyTorch's CUDA allocator. Call it before the first CUDA allocation."""
    global _installed, _pluggable
    if _installed:
        return _installed
    import torch  # noqa: F401  (the hooks library needs torch's libraries loaded)

    lib = _library()
    hooks = os.path.join(library_dir(), "libccalloc_torch.so")
    if os.path.exists(hooks):
        hooks_lib = ctypes.CDLL(hooks)
        hooks_lib.ccalloc_torch_install.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        error = ctypes.create_string_buffer(1024)
        if hooks_lib.ccalloc_torch_install(error, len(error)) != 0:
            raise RuntimeError("ccalloc_torch.install: " + error.value.decode(errors="replace"))
        _installed = "hooks"
        return _installed
    warnings.warn("ccalloc_torch: libccalloc_torch.so was not built; installing through "
                  "CUDAPluggableAllocator alone: record_stream, empty_cache and memory "
                  "fractions set through torch do not reach ccalloc, and a failed allocation "
                  "returns a null pointer instead of raising OutOfMemoryError")
    _pluggable = torch.cuda.memory.CUDAPluggableAllocator(
        lib._name, "ccalloc_torch_alloc", "ccalloc_torch_free")
    torch.cuda.memory.change_current_allocator(_pluggable)
    _installed = "pluggable"
    return _installed


def _device(device):
    if device is None:
        return -1
    if hasattr(device, "index"):  # torch.device
        return -1 if device.index is None else device.index
    return int(device)


def stats(device=None):
    """memory_stats() of a device (PyTorch's keys), as a dict."""
    lib = _library()
    n = ctypes.c_size_t(0)
    _check(lib.ccalloc_memory_stats_json(_device(device), None, 0, ctypes.byref(n)))
    buf = ctypes.create_string_buffer(n.value + 1)
    _check(lib.ccalloc_memory_stats_json(_device(device), buf, len(buf), ctypes.byref(n)))
    return json.loads(buf.value.decode())


def memory_summary(device=None, abbreviated=False):
    lib = _library()
    n = ctypes.c_size_t(0)
    _check(lib.ccalloc_memory_summary(_device(device), int(abbreviated), None, 0, ctypes.byref(n)))
    buf = ctypes.create_string_buffer(n.value + 1)
    _check(lib.ccalloc_memory_summary(_device(device), int(abbreviated), buf, len(buf),
                                      ctypes.byref(n)))
    return buf.value.decode()


def memory_reserved(device=None):
    return stats(device)["reserved_bytes.all.current"]


def max_memory_reserved(device=None):
    return stats(device)["reserved_bytes.all.peak"]


def memory_allocated(device=None):
    return stats(device)["allocated_bytes.all.current"]


def max_memory_allocated(device=None):
    return stats(device)["allocated_bytes.all.peak"]


def reset_peak_memory_stats(device=None):
    _check(_library().ccalloc_reset_peak_stats(_device(device)))


def empty_cache():
    """Returns every device's cached, wholly free memory to the device."""
    _check(_library().ccalloc_empty_cache(-2))


def set_memory_fraction(fraction, device=None):
    _check(_library().ccalloc_set_memory_fraction(float(fraction), _device(device)))


def record_history(enabled="all", context="all", stacks="cpp", max_entries=1_000_000):
    """Starts (or, with enabled=None, stops) recording allocation history on every device."""
    _check(_library().ccalloc_record_history((enabled or "none").encode(),
                                             (context or "none").encode(),
                                             (stacks or "none").encode(), int(max_entries)))


def dump_snapshot(path):
    """Writes every device's segments and history: a pickle (or JSON for *.json; gzip for
    *.gz) that torch.cuda._memory_viz and pytorch.org/memory_viz read."""
    _check(_library().ccalloc_dump_snapshot(os.fspath(path).encode()))


def annotate(name, start=True, device=None):
    """Marks the start or end of a named region in the history."""
    _check(_library().ccalloc_annotate(_device(device), name.encode(), int(start)))
