"""One allocator per process: a program that installs ccalloc into PyTorch (libccalloc_torch.so)
and also calls libccalloc.so's C API (here through ctypes) reaches the same allocator by both
routes. Memory taken through the C API shows in torch.cuda's statistics and snapshot, tensors
show in the C API's statistics, and a block that one route frees is reused by the other."""

from torch_compare import run, skip_without_gpu

skip_without_gpu()

# libccalloc.so, the one beside the adapter, through ctypes.
C_API = """
import ctypes
lib = ctypes.CDLL(os.path.join(ccalloc_torch.library_dir(), "libccalloc.so"))
lib.ccalloc_malloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int,
                               ctypes.c_void_p]
lib.ccalloc_free.argtypes = [ctypes.c_void_p]
"""

BOTH_ROUTES = C_API + """
lib.ccalloc_get_stat.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int64)]
lib.ccalloc_last_error.restype = ctypes.c_char_p

def c_stat(key):
    v = ctypes.c_int64(0)
    assert lib.ccalloc_get_stat(0, key.encode(), ctypes.byref(v)) == 0, lib.ccalloc_last_error()
    return v.value

def c_malloc(size):
    p = ctypes.c_void_p(0)
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    assert lib.ccalloc_malloc(ctypes.byref(p), size, 0, stream) == 0, lib.ccalloc_last_error()
    return p.value

got = {}
mib = 1 << 20
t = torch.empty(8 * mib, dtype=torch.uint8, device="cuda")
got["torch_alloc_seen_by_c"] = c_stat("allocated_bytes.all.current")
p = c_malloc(24 * mib)
got["c_alloc_seen_by_torch"] = torch.cuda.memory_allocated()
got["c_ptr_in_snapshot"] = any(b["address"] == p and b["state"] == "active_allocated"
                               for seg in torch.cuda.memory_snapshot() for b in seg["blocks"])
got["reserved_same"] = c_stat("reserved_bytes.all.current") == torch.cuda.memory_reserved()
assert lib.ccalloc_free(p) == 0, lib.ccalloc_last_error()
# The block the C API freed is cached by the one allocator: torch reuses it without growing.
reserved = torch.cuda.memory_reserved()
u = torch.empty(24 * mib, dtype=torch.uint8, device="cuda")
got["torch_reuses_c_block"] = u.data_ptr() == p
got["reserved_grew"] = torch.cuda.memory_reserved() - reserved
del u
got["after_free"] = [torch.cuda.memory_allocated(), c_stat("allocated_bytes.all.current")]
# A pointer torch holds, freed through the C API, is an error naming it, and the allocator
# stays usable.
got["foreign_free_rejected"] = lib.ccalloc_free(ctypes.c_void_p(t.data_ptr() + 512)) != 0
got["error_names_pointer"] = hex(t.data_ptr() + 512) in lib.ccalloc_last_error().decode()
del t
torch.cuda.synchronize()
got["end"] = [torch.cuda.memory_allocated(), c_stat("allocated_bytes.all.current")]
emit(got=got)
"""


def test_the_c_api_and_torch_reach_one_allocator():
    got = run("ccalloc", BOTH_ROUTES)["got"]
    mib = 1 << 20
    assert got["torch_alloc_seen_by_c"] == 8 * mib
    assert got["c_alloc_seen_by_torch"] == 32 * mib
    assert got["c_ptr_in_snapshot"]
    assert got["reserved_same"]
    assert got["torch_reuses_c_block"]
    assert got["reserved_grew"] == 0
    assert got["after_free"] == [8 * mib, 8 * mib]
    assert got["foreign_free_rejected"]
    assert got["error_names_pointer"]
    assert got["end"] == [0, 0]


def test_the_c_api_first_then_torch():
    # The C API makes the device's allocator before torch's first tensor: torch adopts it.
    got = run("ccalloc", C_API + """
p = ctypes.c_void_p(0)
assert lib.ccalloc_malloc(ctypes.byref(p), 4 << 20, 0, None) == 0
torch.cuda.memory._record_memory_history(max_entries=100)
t = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
allocated = torch.cuda.memory_allocated()
lib.ccalloc_free(p)
snap = torch.cuda.memory._snapshot()
actions = [e["action"] for e in snap["device_traces"][0]]
emit(allocated=allocated, after=torch.cuda.memory_allocated(), actions=actions)
""")
    assert got["allocated"] == 5 << 20
    assert got["after"] == 1 << 20
    # History recorded through torch sees the C API's free of its block, on the same device.
    assert got["actions"].count("free_requested") == 1
    assert got["actions"].count("alloc") == 1
