#!/usr/bin/env python3
"""ccalloc as CuPy's allocator (bindings/torch/ccalloc_torch/cupy.py), without CuPy or a GPU:
a fake `cupy` module and a fake libccalloc.so stand in, so the test checks what the
allocator asks the C API for (CuPy's current device and stream), that the block is freed
exactly once, through the C API's free, when the last pointer over it goes, that an OOM is
CuPy's OutOfMemoryError with ccalloc's message, and install/uninstall/record_stream. The
fake PythonFunctionAllocator does what CuPy's does (cupy/cuda/memory.pyx): its memory
object calls malloc(size, device) for a size above 0 and free(ptr, device) when it dies.
The real thing on a GPU: tests/torch/test_cupy.py."""

import ctypes
import gc
import os
import sys
import types
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bindings", "torch"))


def fake_cupy():
    """The part of CuPy's interface the allocator uses, recording nothing itself."""
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    memory = types.ModuleType("cupy.cuda.memory")
    runtime = types.SimpleNamespace(device=3, getDevice=lambda: runtime.device)
    stream = types.SimpleNamespace(ptr=0x5000)

    class OutOfMemoryError(MemoryError):
        def __init__(self, size, total, limit=0):
            super().__init__("cupy's own text: %d %d" % (size, total))

    class PythonFunctionAllocatorMemory:
        def __init__(self, size, malloc_func, free_func, device_id):
            self.size, self.device_id, self.free_func = size, device_id, free_func
            self.ptr = malloc_func(size, device_id) if size > 0 else 0

        def __del__(self):
            if self.ptr:
                self.free_func(self.ptr, self.device_id)

    class PythonFunctionAllocator:
        def __init__(self, malloc_func, free_func):
            self.malloc_func, self.free_func = malloc_func, free_func

        def malloc(self, size):
            return MemoryPointer(PythonFunctionAllocatorMemory(
                size, self.malloc_func, self.free_func, runtime.device), 0)

    class MemoryPointer:
        def __init__(self, mem, offset):
            self.mem, self.ptr = mem, mem.ptr + offset

    memory.OutOfMemoryError = OutOfMemoryError
    state = {"allocator": "cupy's pool"}
    cuda.memory = memory
    cuda.runtime = runtime
    memory.PythonFunctionAllocator = PythonFunctionAllocator
    cuda.MemoryPointer = MemoryPointer
    cuda.get_current_stream = lambda: stream
    cuda.set_allocator = lambda a: state.__setitem__("allocator", a)
    cuda.get_allocator = lambda: state["allocator"]
    cupy.cuda = cuda
    return cupy, stream


def serves_cupys_device_and_stream_and_frees_once(test, set_stream):
    """A request on CuPy's device 3 and stream 0x5000, its block freed once when the last
    pointer over it goes; then device 1 and stream 0x6000 (`set_stream(0x6000)` makes it
    CuPy's current stream), asked for as they are when the request comes."""
    p = test.cupy.cuda.get_allocator()(1000)
    test.assertEqual(test.lib.calls, [("malloc", 1000, 3, 0x5000)])
    test.assertEqual((p.ptr, p.mem.size, p.mem.device_id), (0x10000, 1000, 3))
    view = test.cupy.cuda.MemoryPointer(p.mem, 512)  # a second pointer over the block
    del p
    gc.collect()
    test.assertEqual(len(test.lib.calls), 1)  # the view keeps it
    del view
    gc.collect()
    test.assertEqual(test.lib.calls[1:], [("free", 0x10000, 3)])
    set_stream(0x6000)
    test.cupy.cuda.runtime.device = 1
    q = test.cupy.cuda.get_allocator()(64)
    test.assertEqual(test.lib.calls[2], ("malloc", 64, 1, 0x6000))
    del q
    gc.collect()
    test.assertEqual(test.lib.calls[3], ("free", 0x11000, 1))


class FakeFunction:
    def __init__(self, body):
        self.body = body
        self.argtypes = None
        self.restype = None

    def __call__(self, *args):
        return self.body(*args)


class FakeLibrary:
    """libccalloc.so's C API as the allocator calls it: addresses from 0x10000 up."""

    def __init__(self):
        self.calls = []
        self.status = 0
        self.next = 0x10000
        self.error = b""
        self.ccalloc_hook_malloc = FakeFunction(self._malloc)
        self.ccalloc_hook_free = FakeFunction(lambda p, d: self.calls.append(("free", p, d)))
        self.ccalloc_record_stream = FakeFunction(
            lambda p, s: self.calls.append(("record_stream", p, s)) or 0)
        self.ccalloc_last_error = FakeFunction(lambda: self.error)
        self.ccalloc_last_status = FakeFunction(lambda: self.status)

    def _malloc(self, size, device, stream):
        self.calls.append(("malloc", size, device, stream))
        if self.status != 0:
            return None  # ctypes' c_void_p result for NULL
        ptr = self.next
        self.next += 0x1000
        return ptr


def swap_modules(modules):
    """Puts `modules` (name: module, or None for none) in sys.modules; returns the function
    that puts back what was there."""
    saved = {name: sys.modules.get(name) for name in modules}

    def put(what):
        for name, module in what.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    put(modules)
    return lambda: put(saved)


class FakeCupyCase(unittest.TestCase):
    """A fake cupy in sys.modules (setUp's fake_cupy) and `lib` as ccalloc_torch.cupy's
    library, each test with the module's state fresh; all put back after it."""

    def use(self, lib, modules=None):
        self.restore_modules = swap_modules({"cupy": self.cupy, "cupy.cuda": self.cupy.cuda,
                                             "cupy.cuda.memory": self.cupy.cuda.memory,
                                             **(modules or {})})
        import ccalloc_torch.cupy as cc
        self.cc = cc
        self.lib = lib
        self.saved_library = (cc._library, cc.library_dir)
        cc._library = lambda: self.lib
        cc._calls = None
        cc._installed = False
        cc.OutOfMemoryError = None

    def tearDown(self):
        self.cc.uninstall()
        self.cc._library, self.cc.library_dir = self.saved_library
        self.cc._calls = None
        self.restore_modules()


class CupyAllocator(FakeCupyCase):
    def setUp(self):
        self.cupy, self.stream = fake_cupy()
        self.use(FakeLibrary())

    def test_install_and_uninstall(self):
        self.assertFalse(self.cc.installed())
        self.assertEqual(self.cc.install(), "cupy")
        self.assertTrue(self.cc.installed())
        hook = self.cupy.cuda.get_allocator()
        self.assertIs(hook.__self__.malloc_func, self.cc._malloc)
        self.assertIs(hook.__self__.free_func, self.lib.ccalloc_hook_free)  # the C entry point
        self.assertEqual(self.cc.install(), "cupy")  # idempotent
        self.assertIs(self.cupy.cuda.get_allocator(), hook)
        self.cc.uninstall()
        self.assertFalse(self.cc.installed())
        self.assertEqual(self.cupy.cuda.get_allocator(), "cupy's pool")
        self.assertEqual(self.lib.ccalloc_hook_malloc.argtypes,
                         [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p])
        self.assertEqual(self.lib.ccalloc_hook_free.argtypes, [ctypes.c_void_p, ctypes.c_int])

    def test_serves_on_cupys_device_and_stream_and_frees_once_when_dropped(self):
        self.cc.install()
        serves_cupys_device_and_stream_and_frees_once(
            self, lambda ptr: setattr(self.stream, "ptr", ptr))

    def test_out_of_memory_is_cupys_error_with_ccallocs_message(self):
        self.cc.install()
        self.lib.status = 1
        self.lib.error = b"CUDA out of memory. Tried to allocate 2.00 GiB."
        with self.assertRaises(self.cupy.cuda.memory.OutOfMemoryError) as caught:
            self.cc._malloc(2 << 30, 3)
        self.assertEqual(str(caught.exception),
                         "ccalloc_torch.cupy: 2147483648 bytes on device 3: "
                         "CUDA out of memory. Tried to allocate 2.00 GiB.")
        self.lib.status = 3
        self.lib.error = b"invalid value"
        with self.assertRaises(RuntimeError) as caught:
            self.cc._malloc(8, 3)
        self.assertIn("invalid value", str(caught.exception))
        self.assertNotIn("free", [c[0] for c in self.lib.calls])  # nothing was handed out

    def test_record_stream_names_the_blocks_start(self):
        self.cc.install()
        p = self.cupy.cuda.get_allocator()(4096)
        array = types.SimpleNamespace(data=self.cupy.cuda.MemoryPointer(p.mem, 256))
        self.cc.record_stream(array, types.SimpleNamespace(ptr=0x7000))
        self.cc.record_stream(p, 0x8000)
        self.assertEqual(self.lib.calls[1:3], [("record_stream", 0x10000, 0x7000),
                                              ("record_stream", 0x10000, 0x8000)])

ROUTE_MODULE = os.environ.get("CCALLOC_CUPY_ROUTE_MODULE")
# CuPy's CFunctionAllocatorMemory calls the malloc through a Cython wrapper that returns the
# pointer as an integer and checks for an exception when it is -1; PYFUNCTYPE keeps the GIL
# and raises what the C function set, as that wrapper does.
C_MALLOC = ctypes.PYFUNCTYPE(ctypes.c_ssize_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
C_FREE = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)
HOOK_MALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
HOOK_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int)
HOOK_STATUS = ctypes.CFUNCTYPE(ctypes.c_int)
HOOK_ERROR = ctypes.CFUNCTYPE(ctypes.c_void_p)
HOOK_RECORD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
STREAM_PTR = ctypes.CFUNCTYPE(ctypes.c_ssize_t)


def add_c_function_allocator(cupy, checks="raises"):
    """CuPy's CFunctionAllocator (cupy/cuda/memory.pyx). `checks`: "raises" (CuPy's
    wrapper raises the C malloc's exception), "system_error" (a wrapper that does not check:
    CPython then raises SystemError with the pointer -1 kept) or "ignores" (-1 kept, no
    exception)."""
    memory = cupy.cuda.memory

    class CFunctionAllocatorMemory:
        def __init__(self, size, param, malloc_func, free_func, device_id):
            self.param, self.free_func, self.device_id, self.size = (
                param, free_func, device_id, size)
            self.ptr = 0
            if size > 0:
                try:
                    self.ptr = C_MALLOC(malloc_func)(param, size, device_id)
                except BaseException as e:
                    if checks == "raises":
                        raise
                    self.ptr = -1
                    if checks == "system_error":
                        raise SystemError("returned a result with an exception set") from e

        def __del__(self):
            if self.ptr:
                C_FREE(self.free_func)(self.param, self.ptr, self.device_id)

    class CFunctionAllocator:
        def __init__(self, param, malloc_func, free_func, owner):
            self.param, self.malloc_func, self.free_func, self.owner = (
                param, malloc_func, free_func, owner)

        def malloc(self, size):
            return cupy.cuda.MemoryPointer(CFunctionAllocatorMemory(
                size, self.param, self.malloc_func, self.free_func,
                cupy.cuda.runtime.device), 0)

    memory.CFunctionAllocator = CFunctionAllocator


def make_capsule(function, name):
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(ctypes.cast(function, ctypes.c_void_p).value, name, None)


class CLibrary:
    """libccalloc.so's hook entry points as C functions (ctypes callbacks): what the C
    route calls through the addresses it is given."""

    def __init__(self):
        self.calls = []
        self.status = 0
        self.next = 0x10000
        self.error = ctypes.create_string_buffer(256)
        self.ccalloc_hook_malloc = HOOK_MALLOC(self._malloc)
        self.ccalloc_hook_free = HOOK_FREE(lambda p, d: self.calls.append(("free", p, d)))
        self.ccalloc_record_stream = HOOK_RECORD(
            lambda p, s: self.calls.append(("record_stream", p, s)) or 0)
        self.ccalloc_last_error = HOOK_ERROR(lambda: ctypes.addressof(self.error))
        self.ccalloc_last_status = HOOK_STATUS(lambda: self.status)

    def _malloc(self, size, device, stream):
        self.calls.append(("malloc", size, device, stream or 0))
        if self.status != 0:
            return None
        ptr = self.next
        self.next += 0x1000
        return ptr


@unittest.skipIf(ROUTE_MODULE is None, "_ccalloc_cupy was not built (no Python headers)")
class CupyCRoute(FakeCupyCase):
    """The C route (bindings/cupy/cupy_route.c) as CuPy's CFunctionAllocator calls it."""

    def setUp(self):
        self.cupy, self.stream = fake_cupy()
        self.stream_module = types.ModuleType("cupy.cuda.stream")
        self.cupy.cuda.stream = self.stream_module
        self.use(CLibrary(), {"cupy.cuda.stream": self.stream_module,
                              "cupy_backends.cuda.stream": None})
        self.cc.library_dir = lambda: os.path.dirname(ROUTE_MODULE)
        self.stream_ptr = 0x5000
        self.getter = STREAM_PTR(lambda: self.stream_ptr)
        self.capsule_name = ctypes.create_string_buffer(b"intptr_t (void)")
        self.saved_env = os.environ.pop("CCALLOC_CUPY_ROUTE", None)

    def tearDown(self):
        super().tearDown()
        if self.saved_env is not None:
            os.environ["CCALLOC_CUPY_ROUTE"] = self.saved_env

    def install(self, checks="raises", capsule_name=None):
        add_c_function_allocator(self.cupy, checks)
        if capsule_name is not None:
            self.capsule_name = ctypes.create_string_buffer(capsule_name)
        self.stream_module.__pyx_capi__ = {
            "get_current_stream_ptr": make_capsule(self.getter, self.capsule_name)}
        self.assertEqual(self.cc.install(), "cupy")
        return self.cc._route_module()

    def test_serves_cupys_stream_from_its_c_function_and_frees_once(self):
        module = self.install()
        self.assertEqual(self.cc.route(), "c")
        self.assertEqual(module.stream_source(), "capsule")
        self.assertEqual(self.lib.calls, [])  # the probe reached no entry point
        # The stream that the capsule's function answers.
        serves_cupys_device_and_stream_and_frees_once(
            self, lambda ptr: setattr(self, "stream_ptr", ptr))

    def test_another_signature_asks_cupys_python_function(self):
        module = self.install(capsule_name=b"int (void)")
        self.assertEqual((self.cc.route(), module.stream_source()), ("c", "python"))
        self.stream_ptr = 0x9999  # the capsule's function is not called
        p = self.cupy.cuda.get_allocator()(8)
        self.stream.ptr = 0x7000
        q = self.cupy.cuda.get_allocator()(8)
        self.assertEqual(self.lib.calls, [("malloc", 8, 3, 0x5000), ("malloc", 8, 3, 0x7000)])
        del p, q
        gc.collect()
        self.assertEqual(sorted(c[1] for c in self.lib.calls[2:]), [0x10000, 0x11000])

        def broken():
            raise ValueError("no stream here")
        self.cupy.cuda.get_current_stream = broken
        module.bind(*[ctypes.cast(f, ctypes.c_void_p).value for f in (
            self.lib.ccalloc_hook_malloc, self.lib.ccalloc_hook_free,
            self.lib.ccalloc_last_status, self.lib.ccalloc_last_error)],
            None, broken, MemoryError)
        with self.assertRaisesRegex(ValueError, "no stream here"):
            self.cupy.cuda.get_allocator()(8)
        self.assertEqual(len(self.lib.calls), 4)  # nothing asked of the C API

    def test_out_of_memory_is_cupys_error_with_ccallocs_message(self):
        self.install()
        self.lib.status = 1
        self.lib.error.value = b"CUDA out of memory. Tried to allocate 2.00 GiB."
        with self.assertRaises(self.cupy.cuda.memory.OutOfMemoryError) as caught:
            self.cupy.cuda.get_allocator()(2 << 30)
        self.assertEqual(str(caught.exception),
                         "ccalloc_torch.cupy: 2147483648 bytes on device 3: "
                         "CUDA out of memory. Tried to allocate 2.00 GiB.")
        self.lib.status = 3
        self.lib.error.value = b"invalid value"
        with self.assertRaisesRegex(RuntimeError, "8 bytes on device 3: invalid value"):
            self.cupy.cuda.get_allocator()(8)
        gc.collect()
        self.assertEqual([c[0] for c in self.lib.calls], ["malloc", "malloc"])  # no free
        self.lib.status = 0  # the allocator serves again
        p = self.cupy.cuda.get_allocator()(8)
        self.assertEqual(p.ptr, 0x10000)

    def test_a_cupy_that_does_not_raise_the_c_mallocs_exception_gets_the_python_route(self):
        for checks in ("system_error", "ignores"):
            with self.subTest(checks=checks):
                self.install(checks)
                self.assertEqual(self.cc.route(), "python")
                p = self.cupy.cuda.get_allocator()(16)
                self.assertEqual(self.lib.calls[-1], ("malloc", 16, 3, 0x5000))
                del p
                gc.collect()
                self.cc.uninstall()
                self.cc._installed = False
        self.assertEqual([c[0] for c in self.lib.calls], ["malloc", "free"] * 2)

    def test_the_variable_picks_the_python_route(self):
        os.environ["CCALLOC_CUPY_ROUTE"] = "python"
        try:
            self.install()
        finally:
            del os.environ["CCALLOC_CUPY_ROUTE"]
        self.assertEqual(self.cc.route(), "python")
        self.assertIs(self.cupy.cuda.get_allocator().__self__.malloc_func, self.cc._malloc)

    def test_bind_rejects_what_is_not_an_address_or_a_class(self):
        module = self.install()
        with self.assertRaisesRegex(ValueError, "hook_free is a null address"):
            module.bind(1, 0, 1, 1, None, lambda: None, MemoryError)
        with self.assertRaisesRegex(TypeError, "get_current_stream is not callable"):
            module.bind(1, 1, 1, 1, None, 5, MemoryError)
        with self.assertRaisesRegex(TypeError, "out_of_memory is not an exception class"):
            module.bind(1, 1, 1, 1, None, lambda: None, int)
        p = self.cupy.cuda.get_allocator()(8)  # the route bound before still serves
        self.assertEqual((p.ptr, self.lib.calls), (0x10000, [("malloc", 8, 3, 0x5000)]))


if __name__ == "__main__":
    unittest.main()
