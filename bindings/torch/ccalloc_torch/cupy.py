"""ccalloc as CuPy's allocator: one cache for CuPy and PyTorch in the process.

    import ccalloc_torch.cupy
    ccalloc_torch.cupy.install()     # cupy.cuda.set_allocator, before the arrays it serves

CuPy's requests are served by the process's ccalloc allocator of CuPy's current device, on
CuPy's current stream, the allocator that libccalloc.so's C API and ccalloc_torch.install()
share. So with torch in the process (installed natively), CuPy's memory counts in
torch.cuda.memory_stats() and snapshots, torch.cuda.empty_cache() releases what CuPy freed,
and memory one framework frees serves the other's next request instead of sitting in a
cache the other cannot use.

An array's memory goes back to the cache when CuPy drops its last reference, on the stream
it was allocated on: a later request on that stream may take it at once (stream order), one
on another stream only once the work queued before the free has completed. An array used
on another stream is declared with record_stream(), as torch.Tensor.record_stream does.

CCALLOC_ENABLE=1 covers CuPy too: the hook (ccalloc_torch/_autoinstall.py) installs this
allocator when the program imports cupy.
"""

import ctypes

from . import _library

__all__ = ["install", "uninstall", "installed", "record_stream", "OutOfMemoryError"]

_OUT_OF_MEMORY = 1  # CCALLOC_ERROR_OUT_OF_MEMORY (ccalloc/ccalloc.h)

_previous = None  # CuPy's allocator before install(), restored by uninstall()
_installed = False
_calls = None  # (malloc, free, record_stream, last_error), bound once


def _bind():
    global _calls
    if _calls is None:
        lib = _library()
        malloc = lib.ccalloc_malloc
        malloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int,
                           ctypes.c_void_p]
        malloc.restype = ctypes.c_int
        free = lib.ccalloc_free
        free.argtypes = [ctypes.c_void_p]
        free.restype = ctypes.c_int
        record = lib.ccalloc_record_stream
        record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        record.restype = ctypes.c_int
        last_error = lib.ccalloc_last_error
        last_error.restype = ctypes.c_char_p
        _calls = (malloc, free, record, last_error)
    return _calls


def _error(what):
    message = _bind()[3]()
    return "ccalloc_torch.cupy: %s: %s" % (what, message.decode(errors="replace") if message
                                           else "(no message)")


def _out_of_memory_class():
    import cupy

    class OutOfMemory(cupy.cuda.memory.OutOfMemoryError):
        """CuPy's OutOfMemoryError (code that catches it keeps working), with ccalloc's
        message: what was asked, what is held, and why nothing could be freed."""

        def __init__(self, message):  # noqa: super().__init__ would format CuPy's own text
            MemoryError.__init__(self, message)

    return OutOfMemory


OutOfMemoryError = None  # the class, once install() has imported cupy


class _Allocation:
    """Owns one block: CuPy's UnownedMemory keeps it alive as long as any array or pointer
    over the memory lives, and dropping the last one frees the block into ccalloc's cache."""

    __slots__ = ("ptr", "__weakref__")

    def __init__(self, ptr):
        self.ptr = ptr

    def __del__(self):
        if self.ptr and _calls is not None:
            if _calls[1](self.ptr) != 0:
                # A destructor cannot raise: say it where the program will see it.
                import warnings
                warnings.warn(_error("free of 0x%x" % self.ptr), RuntimeWarning)
            self.ptr = 0


def _malloc(size):
    """CuPy's allocator interface: size in bytes to a cupy.cuda.MemoryPointer."""
    import cupy
    device = cupy.cuda.runtime.getDevice()
    if size == 0:
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(0, 0, None, device), 0)
    malloc = _bind()[0]
    ptr = ctypes.c_void_p()
    status = malloc(ctypes.byref(ptr), size, device, cupy.cuda.get_current_stream().ptr)
    if status == _OUT_OF_MEMORY:
        raise OutOfMemoryError(_error("%d bytes on device %d" % (size, device)))
    if status != 0:
        raise RuntimeError(_error("%d bytes on device %d" % (size, device)))
    owner = _Allocation(ptr.value)
    return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr.value, size, owner, device), 0)


def install():
    """Makes ccalloc CuPy's allocator (cupy.cuda.set_allocator) for every device. Arrays
    made before keep the memory they have, from CuPy's own pool. Idempotent."""
    global _previous, _installed, OutOfMemoryError
    import cupy
    if _installed:
        return "cupy"
    _bind()
    if OutOfMemoryError is None:
        OutOfMemoryError = _out_of_memory_class()
    _previous = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(_malloc)
    _installed = True
    return "cupy"


def uninstall():
    """Gives CuPy back the allocator it had before install(); arrays made meanwhile keep
    ccalloc's memory until they are dropped."""
    global _installed
    import cupy
    if not _installed:
        return
    cupy.cuda.set_allocator(_previous)
    _installed = False


def installed():
    """Whether ccalloc is CuPy's allocator now."""
    if not _installed:
        return False
    import cupy
    return cupy.cuda.get_allocator() is _malloc


def record_stream(memory, stream):
    """Declares that `stream` uses `memory` (a cupy.ndarray, a MemoryPointer or an address
    ccalloc handed out): its free then waits for the work queued on `stream` until then,
    before another stream may take the memory."""
    ptr = memory
    if hasattr(ptr, "data"):  # an ndarray: its MemoryPointer
        ptr = ptr.data
    if hasattr(ptr, "mem"):  # a MemoryPointer: the block's start, not an offset into it
        ptr = ptr.mem.ptr
    handle = stream.ptr if hasattr(stream, "ptr") else int(stream)
    if _bind()[2](int(ptr), handle) != 0:
        raise RuntimeError(_error("record_stream of 0x%x" % int(ptr)))
