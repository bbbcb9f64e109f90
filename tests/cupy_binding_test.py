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


class CupyAllocator(unittest.TestCase):
    def setUp(self):
        self.cupy, self.stream = fake_cupy()
        self.saved = {n: sys.modules.get(n) for n in ("cupy", "cupy.cuda", "cupy.cuda.memory")}
        sys.modules["cupy"] = self.cupy
        sys.modules["cupy.cuda"] = self.cupy.cuda
        sys.modules["cupy.cuda.memory"] = self.cupy.cuda.memory
        import ccalloc_torch.cupy as cc
        self.cc = cc
        self.lib = FakeLibrary()
        self.saved_library = cc._library
        cc._library = lambda: self.lib
        cc._calls = None
        cc._installed = False
        cc.OutOfMemoryError = None

    def tearDown(self):
        self.cc.uninstall()
        self.cc._library = self.saved_library
        self.cc._calls = None
        for name, module in self.saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module

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
        p = self.cupy.cuda.get_allocator()(1000)
        self.assertEqual(self.lib.calls, [("malloc", 1000, 3, 0x5000)])
        self.assertEqual((p.ptr, p.mem.size, p.mem.device_id), (0x10000, 1000, 3))
        view = self.cupy.cuda.MemoryPointer(p.mem, 512)  # a second pointer over the block
        del p
        gc.collect()
        self.assertEqual(len(self.lib.calls), 1)  # the view keeps it
        del view
        gc.collect()
        self.assertEqual(self.lib.calls[1:], [("free", 0x10000, 3)])
        # Another stream and device: asked for as they are when the request comes.
        self.stream.ptr = 0x6000
        self.cupy.cuda.runtime.device = 1
        q = self.cupy.cuda.get_allocator()(64)
        self.assertEqual(self.lib.calls[2], ("malloc", 64, 1, 0x6000))
        del q
        gc.collect()
        self.assertEqual(self.lib.calls[3], ("free", 0x11000, 1))

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


if __name__ == "__main__":
    unittest.main()
