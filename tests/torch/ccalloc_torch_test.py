#!/usr/bin/env python3
"""ccalloc as PyTorch's allocator: a few training steps through ccalloc_torch.install(),
then ccalloc's statistics must show the work. Exits 77 (skipped) without torch or a GPU."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "bindings", "torch"))

try:
    import torch
except ImportError:
    print("skipped: torch is not importable")
    sys.exit(77)
if not torch.cuda.is_available():
    print("skipped: no CUDA device")
    sys.exit(77)

import ccalloc_torch  # noqa: E402

how = ccalloc_torch.install()
before = ccalloc_torch.stats()
assert before["allocation.all.allocated"] == 0, before["allocation.all.allocated"]

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                            torch.nn.Linear(4096, 10)).cuda()
opt = torch.optim.AdamW(model.parameters())
for _ in range(5):
    x = torch.randn(256, 1024, device="cuda")
    loss = torch.nn.functional.cross_entropy(model(x), torch.randint(0, 10, (256,), device="cuda"))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
torch.cuda.synchronize()

after = ccalloc_torch.stats()
checks = {
    "allocations were made": after["allocation.all.allocated"] > 0,
    "segments were obtained": after["num_device_alloc"] > 0,
    "memory is reserved": after["reserved_bytes.all.current"] > 0,
    "parameters and optimizer state are live": after["allocated_bytes.all.current"] >= 4 * (
        1024 * 4096 + 4096 * 10) * 3,
    "the summary reports it": "Allocated memory" in ccalloc_torch.memory_summary(),
}
if how in ("native", "hooks"):
    # Tensor.record_stream reaches ccalloc: the block waits for the side stream.
    side = torch.cuda.Stream()
    t = torch.empty(1 << 20, device="cuda")
    with torch.cuda.stream(side):
        t.mul_(2)
    t.record_stream(side)
    del t
    torch.cuda.synchronize()
    del model, opt, x, loss
    torch.cuda.empty_cache()  # through the reset hook
    checks["torch.cuda.empty_cache() reached ccalloc"] = (
        ccalloc_torch.stats()["reserved_bytes.all.current"] < after["reserved_bytes.all.current"])
if how == "native":
    # A sleepable pool (docs/sleep-wake.md#pytorch): no device memory while asleep, the same
    # bytes at the same address after the wake.
    pool = ccalloc_torch.SleepablePool()
    with pool:
        w = torch.arange(16 << 20, dtype=torch.int32, device="cuda")  # 64 MiB
    ptr = w.data_ptr()
    torch.cuda.synchronize()
    reserved_awake = ccalloc_torch.stats()["reserved_bytes.all.current"]
    pool.sleep(offload=True)
    info = pool.info()
    checks["a sleeping pool holds no device memory and saved its 64 MiB"] = (
        info.asleep and info.physical_bytes == 0 and info.saved_bytes == info.live_bytes == 64 << 20
        and reserved_awake - ccalloc_torch.stats()["reserved_bytes.all.current"] == info.segment_bytes)
    pool.wake()
    checks["a woken pool has the same bytes at the same address"] = (
        not pool.asleep and w.data_ptr() == ptr
        and torch.equal(w.cpu(), torch.arange(16 << 20, dtype=torch.int32)))
else:
    try:
        ccalloc_torch.SleepablePool()
        checks["SleepablePool refuses without the native install"] = False
    except RuntimeError as e:
        checks["SleepablePool refuses without the native install"] = "installed natively" in str(e)
failed = [name for name, ok in checks.items() if not ok]
for name, ok in checks.items():
    print(("ok   " if ok else "FAIL ") + name)
print(f"installed via {how}; allocations {after['allocation.all.allocated']}, "
      f"peak reserved {after['reserved_bytes.all.peak']} bytes")
sys.exit(1 if failed else 0)
