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

Two routes, the first that works:
  - "c": CuPy's CFunctionAllocator calls the C malloc and free of _ccalloc_cupy.abi3.so
    (bindings/cupy, beside libccalloc.so), which ask CuPy for its current stream through
    the C function CuPy's own pool calls: no Python call of ours per block. install()
    first checks that this CuPy raises the exception a failed C malloc sets (a probe);
  - "python": CuPy's PythonFunctionAllocator calls _malloc below and the C entry point
    ccalloc_hook_free through ctypes.
CCALLOC_CUPY_ROUTE=python picks the second; route() says which one serves.
"""

import ctypes
import importlib.util
import os

from . import _library, library_dir

__all__ = ["install", "uninstall", "installed", "route", "record_stream", "OutOfMemoryError"]

_OUT_OF_MEMORY = 1  # CCALLOC_ERROR_OUT_OF_MEMORY (ccalloc/ccalloc.h)

_previous = None  # CuPy's allocator before install(), restored by uninstall()
_installed = False
_hook = None  # what install() gave cupy.cuda.set_allocator: a PythonFunctionAllocator's malloc
_calls = None  # (hook_malloc, hook_free, record_stream, last_error, last_status), bound once
_current_stream = None  # cupy.cuda.get_current_stream, bound by install()
_route = None  # "c" or "python", set by install()
_c_module = None  # _ccalloc_cupy, once the C route is bound
_ROUTE_MODULE = "_ccalloc_cupy.abi3.so"


def _bind():
    global _calls
    if _calls is None:
        lib = _library()
        malloc = lib.ccalloc_hook_malloc  # NULL on failure, the status kept
        malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        malloc.restype = ctypes.c_void_p
        free = lib.ccalloc_hook_free  # a failure goes to stderr: CuPy's free cannot raise
        free.argtypes = [ctypes.c_void_p, ctypes.c_int]
        free.restype = None
        record = lib.ccalloc_record_stream
        record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        record.restype = ctypes.c_int
        last_error = lib.ccalloc_last_error
        last_error.restype = ctypes.c_char_p
        last_status = lib.ccalloc_last_status
        last_status.restype = ctypes.c_int
        _calls = (malloc, free, record, last_error, last_status)
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


def _malloc(size, device):
    """The malloc of CuPy's PythonFunctionAllocator: a block of `size` (> 0) bytes on
    `device` (CuPy's current device) for CuPy's current stream, as an address. CuPy's memory
    object hands the address to the free below when its last pointer goes."""
    ptr = _calls[0](size, device, _current_stream().ptr)
    if ptr is None:
        what = "%d bytes on device %d" % (size, device)
        if _calls[4]() == _OUT_OF_MEMORY:
            raise OutOfMemoryError(_error(what))
        raise RuntimeError(_error(what))
    return ptr


def _route_module():
    """_ccalloc_cupy from the folder of libccalloc.so, or None where it was not built."""
    path = os.path.join(library_dir(), _ROUTE_MODULE)
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location(__package__ + "._ccalloc_cupy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stream_capsule():
    """The capsule of the C function that CuPy's pool asks for the current stream with
    (Cython exports it as `get_current_stream_ptr`), or None. _ccalloc_cupy calls it only
    if the capsule's signature is `intptr_t (void)`."""
    for name in ("cupy.cuda.stream", "cupy_backends.cuda.stream"):
        try:
            module = importlib.import_module(name)  # (sys.modules' entry where there is one)
        except ImportError:
            continue
        capsule = getattr(module, "__pyx_capi__", {}).get("get_current_stream_ptr")
        if capsule is not None:
            return capsule
    return None


def _address(function):
    return ctypes.cast(function, ctypes.c_void_p).value


def _c_allocator(cupy):
    """CuPy's CFunctionAllocator over _ccalloc_cupy's malloc and free, or None where this
    CuPy has none, the module is missing, CCALLOC_CUPY_ROUTE=python, or this CuPy does not
    raise the exception that a failed C malloc sets (a CuPy built so would hand out -1)."""
    allocator_class = getattr(cupy.cuda.memory, "CFunctionAllocator", None)
    if allocator_class is None or os.environ.get("CCALLOC_CUPY_ROUTE", "") == "python":
        return None
    module = _route_module()
    if module is None:
        return None
    try:
        allocator_class(*module.probe(), module).malloc(1)
        return None  # no exception: this CuPy ignores what the C malloc raises
    except module.ProbeError:
        pass
    except BaseException:  # noqa: a SystemError where CuPy does not check for it
        return None
    global _c_module
    _c_module = module
    malloc, free, _, last_error, last_status = _bind()
    param, c_malloc, c_free = module.bind(
        _address(malloc), _address(free), _address(last_status), _address(last_error),
        _stream_capsule(), cupy.cuda.get_current_stream, OutOfMemoryError)
    return allocator_class(param, c_malloc, c_free, module)


def route():
    """The route that serves CuPy ("c" or "python"; see the module's text), None before
    install()."""
    return _route if _installed else None


def install():
    """Makes ccalloc CuPy's allocator (cupy.cuda.set_allocator) for every device. Arrays
    made before keep the memory they have, from CuPy's own pool. Idempotent."""
    global _previous, _installed, _hook, _current_stream, _route, OutOfMemoryError
    import cupy
    if _installed:
        return "cupy"
    free = _bind()[1]
    if OutOfMemoryError is None:
        OutOfMemoryError = _out_of_memory_class()
    _current_stream = cupy.cuda.get_current_stream
    allocator = _c_allocator(cupy)
    if allocator is not None:
        _route = "c"
    else:
        # CuPy's own memory object calls the two functions: no Python object of ours per
        # block, and the free is the C entry point itself.
        allocator = cupy.cuda.memory.PythonFunctionAllocator(_malloc, free)
        _route = "python"
    _hook = allocator.malloc
    _previous = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(_hook)
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
    return cupy.cuda.get_allocator() is _hook


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
