"""ccalloc as PyTorch's CUDA allocator.

    import ccalloc_torch
    ccalloc_torch.install()          # before the first CUDA allocation
    ...                              # unchanged model code
    print(torch.cuda.memory_summary())

install() tries, in order:
  "native":    libccalloc_torch.so, built against this torch, implements PyTorch's
               CUDAAllocator itself: torch.cuda.memory_stats(), memory_summary(),
               _record_memory_history()/_snapshot() (with Python frames), empty_cache(),
               set_per_process_memory_fraction(), caching_allocator_alloc(), torch.accelerator's
               memory functions and torch.multiprocessing's CUDA IPC all reach ccalloc.
  "hooks":     libccalloc_torch_hooks.so: torch's CUDAPluggableAllocator with the hooks its
               Python constructor cannot set (record_stream, empty_cache, memory fraction,
               OutOfMemoryError).
  "pluggable": CUDAPluggableAllocator over libccalloc.so's C entry points alone.
With the last two, torch.cuda.memory_stats() and friends do not work: use this module's
stats(), memory_summary(), record_history() and dump_snapshot() instead.

Sleepable pools (installed natively only): a SleepablePool is a torch.cuda.MemPool whose
physical memory can be released while its addresses stay reserved, and mapped again later
with the same contents, so tensors and CUDA graphs that captured its addresses stay valid:

    weights = ccalloc_torch.SleepablePool()
    with weights:                    # or torch.cuda.use_mem_pool(weights.pool)
        model = build_model().cuda()
    ...                              # capture graphs, serve
    weights.sleep(offload=True)      # GPU memory back to the device, contents to pinned host
    ...                              # the memory serves something else
    weights.wake()                   # same addresses, same bytes

The configuration is CCALLOC_CONF (the preset and any keys) with the keys of
PYTORCH_CUDA_ALLOC_CONF (else PYTORCH_ALLOC_CONF) on top, in PyTorch's grammar, read when
PyTorch initializes CUDA: install() makes no CUDA call. CCALLOC_ENABLE=1 installs ccalloc with
no code (the ccalloc_torch.pth hook, _autoinstall.py). Libraries are looked up next to this module (where
`pip install` puts them), then in CCALLOC_LIBRARY_DIR, then in the build folders of the
repository this module lives in.
"""

import collections
import ctypes
import glob
import json
import os
import warnings

__all__ = [
    "install", "installed", "library_dir", "stats", "memory_summary", "memory_reserved",
    "max_memory_reserved", "memory_allocated", "max_memory_allocated", "reset_peak_memory_stats",
    "empty_cache", "set_memory_fraction", "record_history", "dump_snapshot", "annotate",
    "SleepablePool", "PoolSleepInfo", "sleep_pool", "wake_pool", "pool_asleep", "pool_sleep_info",
]

_lib = None
_native_lib = None  # libccalloc_torch.so once installed natively
_installed = None  # "native", "hooks" or "pluggable" once installed
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
    """How ccalloc was installed: "native", "hooks", "pluggable", or None."""
    return _installed


def _native_library():
    """libccalloc_torch.so, loaded, or None where it was not built."""
    path = os.path.join(library_dir(), "libccalloc_torch.so")
    if not os.path.exists(path):
        return None
    lib = ctypes.CDLL(path)
    lib.ccalloc_torch_native_install.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.ccalloc_torch_native_installed.restype = ctypes.c_int
    return lib


def install(native=True):
    """Makes ccalloc PyTorch's CUDA allocator. Call it before the first CUDA allocation.

    native=False skips libccalloc_torch.so and installs through CUDAPluggableAllocator.
    Returns how it was installed (see installed())."""
    global _installed, _pluggable, _native_lib
    if _installed:
        return _installed
    import torch  # noqa: F401  (the libraries below need torch's libraries loaded)

    if native:
        lib = _native_library()
        if lib is not None:
            error = ctypes.create_string_buffer(4096)
            if lib.ccalloc_torch_native_install(error, len(error)) != 0:
                raise RuntimeError("ccalloc_torch.install: " + error.value.decode(errors="replace"))
            _native_lib = lib
            _installed = "native"
            return _installed
    plain = _library()
    hooks = os.path.join(library_dir(), "libccalloc_torch_hooks.so")
    if os.path.exists(hooks):
        hooks_lib = ctypes.CDLL(hooks)
        hooks_lib.ccalloc_torch_install.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        error = ctypes.create_string_buffer(1024)
        if hooks_lib.ccalloc_torch_install(error, len(error)) != 0:
            raise RuntimeError("ccalloc_torch.install: " + error.value.decode(errors="replace"))
        _installed = "hooks"
        return _installed
    warnings.warn("ccalloc_torch: neither libccalloc_torch.so nor libccalloc_torch_hooks.so was "
                  "built; installing through CUDAPluggableAllocator alone: record_stream, "
                  "empty_cache and memory fractions set through torch do not reach ccalloc, and "
                  "a failed allocation returns a null pointer instead of raising "
                  "OutOfMemoryError")
    _pluggable = torch.cuda.memory.CUDAPluggableAllocator(
        plain._name, "ccalloc_torch_alloc", "ccalloc_torch_free")
    torch.cuda.memory.change_current_allocator(_pluggable)
    _installed = "pluggable"
    return _installed


def _torch_device(device):
    import torch
    return torch.device("cuda", torch.cuda.current_device() if _device(device) == -1
                        else _device(device))


def _device(device):
    if device is None:
        return -1
    if hasattr(device, "index"):  # torch.device
        return -1 if device.index is None else device.index
    return int(device)


def _native():
    """True when torch.cuda's own memory functions reach ccalloc (the helpers below then go
    through them; libccalloc.so's C API reaches the same allocators, which torch.cuda's
    functions report with PyTorch's keys and rules)."""
    return _installed == "native"


def stats(device=None):
    """memory_stats() of a device (PyTorch's keys), as a dict."""
    if _native():
        import torch
        return dict(torch.cuda.memory_stats(_torch_device(device)))
    lib = _library()
    n = ctypes.c_size_t(0)
    _check(lib.ccalloc_memory_stats_json(_device(device), None, 0, ctypes.byref(n)))
    buf = ctypes.create_string_buffer(n.value + 1)
    _check(lib.ccalloc_memory_stats_json(_device(device), buf, len(buf), ctypes.byref(n)))
    return json.loads(buf.value.decode())


_MEMORY_CALLS = ("malloc", "free", "create", "release", "map", "set_access", "unmap", "call_ns",
                 "fences", "borrowed_handles", "borrowed_pieces", "borrow_waits",
                 "fence_latency_us", "busy_borrow_waits")


def driver_calls(device=None):
    """The device's memory calls since its allocator was made (cudaMalloc, cudaFree,
    cuMemCreate, cuMemRelease, cuMemMap, cuMemSetAccess, cuMemUnmap, and the nanoseconds
    spent in them: call_ns), and the stitching policy's sharing between streams (fences,
    borrowed_handles, borrowed_pieces, borrow_waits, fence_latency_us, busy_borrow_waits:
    the waits on a stream whose work before the fence could still run), as a dict. Needs
    ccalloc installed natively."""
    lib = _native_lib
    if lib is None or not _native():
        raise RuntimeError("ccalloc_torch.driver_calls needs ccalloc installed natively")
    out = (ctypes.c_uint64 * len(_MEMORY_CALLS))()
    error = ctypes.create_string_buffer(1024)
    fn = lib.ccalloc_torch_memory_calls
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t,
                   ctypes.c_char_p, ctypes.c_size_t]
    fn.restype = ctypes.c_int
    if fn(_device(device), out, len(out), error, len(error)) < 0:
        raise RuntimeError("ccalloc_torch.driver_calls: " + error.value.decode(errors="replace"))
    return dict(zip(_MEMORY_CALLS, (int(x) for x in out)))


def memory_summary(device=None, abbreviated=False):
    if _native():
        import torch
        return torch.cuda.memory_summary(_torch_device(device), abbreviated)
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
    if _native():
        import torch
        torch.cuda.reset_peak_memory_stats(_torch_device(device))
        return
    _check(_library().ccalloc_reset_peak_stats(_device(device)))


def empty_cache():
    """Returns every device's cached, wholly free memory to the device."""
    if _native():
        import torch
        torch.cuda.empty_cache()
        return
    _check(_library().ccalloc_empty_cache(-2))


def set_memory_fraction(fraction, device=None):
    if _native():
        import torch
        torch.cuda.set_per_process_memory_fraction(float(fraction), _torch_device(device))
        return
    _check(_library().ccalloc_set_memory_fraction(float(fraction), _device(device)))


def record_history(enabled="all", context="all", stacks="cpp", max_entries=1_000_000):
    """Starts (or, with enabled=None, stops) recording allocation history on every device.

    Installed natively this is torch.cuda.memory._record_memory_history, whose stacks are
    Python frames ("python") or Python and C++ frames ("all"; "cpp" means the same here)."""
    if _native():
        import torch
        torch.cuda.memory._record_memory_history(
            enabled=None if enabled in (None, "none") else enabled,
            context=None if context in (None, "none") else context,
            stacks="python" if stacks in (None, "none", "python") else "all",
            max_entries=int(max_entries))
        return
    _check(_library().ccalloc_record_history((enabled or "none").encode(),
                                             (context or "none").encode(),
                                             (stacks or "none").encode(), int(max_entries)))


def dump_snapshot(path):
    """Writes every device's segments and history: a pickle (or JSON for *.json; gzip for
    *.gz) that torch.cuda._memory_viz and pytorch.org/memory_viz read."""
    if _native():
        import gzip
        import pickle
        import torch
        path = os.fspath(path)
        snapshot = torch.cuda.memory._snapshot()
        opener = gzip.open if path.endswith(".gz") else open
        stem = path[:-3] if path.endswith(".gz") else path
        with opener(path, "wt" if stem.endswith(".json") else "wb") as f:
            if stem.endswith(".json"):
                json.dump(snapshot, f)
            else:
                pickle.dump(snapshot, f)
        return
    _check(_library().ccalloc_dump_snapshot(os.fspath(path).encode()))


_open_annotations = {}


def annotate(name, start=True, device=None):
    """Marks the start or end of a named region in the history.

    Installed natively, regions are torch.profiler.record_function ranges, which PyTorch
    records as the snapshot's external_annotations while history is recorded."""
    if _native():
        import torch
        if start:
            region = torch.profiler.record_function(name)
            region.__enter__()
            _open_annotations.setdefault(name, []).append(region)
        else:
            opened = _open_annotations.get(name)
            if not opened:
                raise RuntimeError(f"ccalloc_torch.annotate: no open region named {name!r}")
            opened.pop().__exit__(None, None, None)
        return
    _check(_library().ccalloc_annotate(_device(device), name.encode(), int(start)))


# --- Sleep and wake of pools (docs/sleep-wake.md) ---

class _SleepInfoStruct(ctypes.Structure):
    _fields_ = [("asleep", ctypes.c_int), ("segment_bytes", ctypes.c_size_t),
                ("physical_bytes", ctypes.c_size_t), ("saved_bytes", ctypes.c_size_t),
                ("live_bytes", ctypes.c_size_t)]


PoolSleepInfo = collections.namedtuple(
    "PoolSleepInfo", ["asleep", "segment_bytes", "physical_bytes", "saved_bytes", "live_bytes"])
PoolSleepInfo.__doc__ = """The sleep state of a sleepable pool, in bytes.

asleep:          whether the pool sleeps
segment_bytes:   its segments (address ranges reserved for it, asleep or not)
physical_bytes:  of which backed by physical memory now (0 while asleep)
saved_bytes:     pinned host memory holding its saved contents (while asleep after
                 sleep(offload=True))
live_bytes:      its live allocations (block sizes)"""

_sleep_prototypes_set = False


def _sleep_library(what):
    """libccalloc_torch.so with the sleep entry points, or a RuntimeError saying why not."""
    global _sleep_prototypes_set
    if _installed != "native":
        how = ("ccalloc_torch.install() has not been called" if _installed is None
               else f"ccalloc is installed as {_installed!r}, through torch's "
                    "CUDAPluggableAllocator, which does not route torch.cuda.MemPool "
                    "allocations to ccalloc's pools")
        raise RuntimeError(f"ccalloc_torch.{what}: sleepable pools need ccalloc installed "
                           f"natively (libccalloc_torch.so, ccalloc_torch.install()); {how}")
    lib = _native_lib
    if not _sleep_prototypes_set:
        try:
            lib.ccalloc_torch_request_sleepable_pool.argtypes = [ctypes.c_int]
            lib.ccalloc_torch_request_sleepable_pool.restype = ctypes.c_int
            pool = [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64]
            error = [ctypes.c_char_p, ctypes.c_size_t]
            lib.ccalloc_torch_pool_sleep.argtypes = pool + [ctypes.c_int] + error
            lib.ccalloc_torch_pool_wake.argtypes = pool + error
            lib.ccalloc_torch_pool_is_asleep.argtypes = pool + [ctypes.POINTER(ctypes.c_int)] + error
            lib.ccalloc_torch_pool_sleep_info.argtypes = (
                pool + [ctypes.POINTER(_SleepInfoStruct)] + error)
        except AttributeError as e:
            raise RuntimeError(f"ccalloc_torch.{what}: this libccalloc_torch.so has no sleep "
                               f"entry points ({e}): rebuild it") from None
        _sleep_prototypes_set = True
    return lib


def _pool_call(what, function, pool, device, *args):
    """Calls a sleep entry point on `pool` (a SleepablePool, a torch.cuda.MemPool or an id
    tuple); raises torch.OutOfMemoryError or RuntimeError with ccalloc's message."""
    lib = _sleep_library(what)
    if isinstance(pool, SleepablePool):
        device = pool.device if device is None else device
        pool = pool.pool
    first, second = pool if isinstance(pool, tuple) else pool.id
    error = ctypes.create_string_buffer(2048)
    status = getattr(lib, function)(_device(device), first, second, *args, error, len(error))
    if status == 0:
        return
    message = error.value.decode(errors="replace")
    if status == 2:
        import torch
        raise torch.cuda.OutOfMemoryError(message)
    raise RuntimeError(message)


def sleep_pool(pool, offload=True, device=None):
    """Releases the GPU memory of a sleepable pool; its addresses stay reserved.

    offload=True copies the bytes of the pool's live allocations to pinned host memory first
    (wake_pool restores them); offload=False discards them. Waits for the device's work
    first. Tensors in the pool must not be used until wake_pool; allocating into the pool
    raises meanwhile. `pool`: a SleepablePool, a torch.cuda.MemPool or its id; `device`: the
    device the pool was created on (default: the SleepablePool's, else the current device)."""
    _pool_call("sleep_pool", "ccalloc_torch_pool_sleep", pool, device, int(bool(offload)))


def wake_pool(pool, device=None):
    """Maps GPU memory at the sleeping pool's addresses again and restores its saved bytes.
    Raises torch.OutOfMemoryError, leaving the pool asleep, when the device cannot provide
    the memory even after ccalloc's unused caches were returned."""
    _pool_call("wake_pool", "ccalloc_torch_pool_wake", pool, device)


def pool_asleep(pool, device=None):
    """Whether the pool sleeps (False for a private pool that is not sleepable)."""
    asleep = ctypes.c_int(0)
    _pool_call("pool_asleep", "ccalloc_torch_pool_is_asleep", pool, device, ctypes.byref(asleep))
    return bool(asleep.value)


def pool_sleep_info(pool, device=None):
    """The sleep state and sizes of a sleepable pool (PoolSleepInfo)."""
    info = _SleepInfoStruct()
    _pool_call("pool_sleep_info", "ccalloc_torch_pool_sleep_info", pool, device,
               ctypes.byref(info))
    return PoolSleepInfo(bool(info.asleep), info.segment_bytes, info.physical_bytes,
                         info.saved_bytes, info.live_bytes)


class SleepablePool:
    """A torch.cuda.MemPool whose GPU memory can be released and brought back at the same
    addresses (ccalloc installed natively only).

    `pool` is the torch.cuda.MemPool itself: torch.cuda.use_mem_pool(sp.pool) routes the
    current thread's allocations to it, as does `with sp:`; CUDA graphs may read and write
    its tensors. sleep() releases its physical memory (optionally saving its live tensors'
    bytes to pinned host memory), wake() maps memory at the same addresses again and restores
    them. The pool follows MemPool's rules otherwise: it is released when the last reference
    to the MemPool goes (its memory returns once its tensors are freed)."""

    def __init__(self, device=None):
        import torch
        lib = _sleep_library("SleepablePool")
        self.device = _torch_device(device).index
        self._entered = []
        # torch.cuda.MemPool() creates its pool in its constructor, on this thread, on the
        # current device: the request makes ccalloc create that pool sleepable.
        lib.ccalloc_torch_request_sleepable_pool(1)
        try:
            with torch.cuda.device(self.device):
                self.pool = torch.cuda.MemPool()
        finally:
            pending = lib.ccalloc_torch_request_sleepable_pool(0)
        if pending:
            raise RuntimeError("ccalloc_torch.SleepablePool: torch.cuda.MemPool() did not create "
                               "its pool through ccalloc's createOrIncrefPool; this torch is not "
                               "supported")

    @property
    def id(self):
        """The pool's id, torch.cuda.MemPool.id."""
        return self.pool.id

    @property
    def asleep(self):
        return pool_asleep(self)

    def sleep(self, offload=True):
        """See sleep_pool()."""
        sleep_pool(self, offload)

    def wake(self):
        """See wake_pool()."""
        wake_pool(self)

    def info(self):
        """See pool_sleep_info()."""
        return pool_sleep_info(self)

    def use_count(self):
        return self.pool.use_count()

    def snapshot(self):
        """The pool's segments, as torch.cuda.MemPool.snapshot()."""
        return self.pool.snapshot()

    def __enter__(self):
        """Routes the current thread's allocations on the pool's device to the pool
        (torch.cuda.use_mem_pool)."""
        import torch
        context = torch.cuda.use_mem_pool(self.pool, self.device)
        context.__enter__()
        self._entered.append(context)
        return self

    def __exit__(self, *exc):
        return self._entered.pop().__exit__(*exc)

    def __repr__(self):
        return f"SleepablePool(id={self.id}, device={self.device})"
