"""What the benchmark reads from the allocator around a workload: its peaks, and, after
every step, its cumulative driver calls (scale.py turns them into calls per step)."""

import torch


def _stats(allocator):
    if allocator == "ccalloc":
        import ccalloc_torch

        return ccalloc_torch.stats()
    return torch.cuda.memory_stats()


def driver_calls(allocator):
    """A function returning the allocator's cumulative driver calls on the current device.

    PyTorch's allocator counts cudaMalloc and cudaFree (native) or the maps and unmaps of
    its expandable segments (num_device_alloc / num_device_free). ccalloc counts each kind
    of call it makes and the time spent in them (ccalloc_torch.driver_calls())."""
    if allocator == "ccalloc":
        import ccalloc_torch

        if hasattr(ccalloc_torch, "driver_calls"):
            return ccalloc_torch.driver_calls

    def from_stats():
        s = _stats(allocator)
        return {"device_alloc": s["num_device_alloc"], "device_free": s["num_device_free"]}

    return from_stats


def peaks(allocator):
    s = _stats(allocator)
    return {"peak_reserved_bytes": s["reserved_bytes.all.peak"],
            "peak_allocated_bytes": s["allocated_bytes.all.peak"],
            "peak_requested_bytes": s["requested_bytes.all.peak"],
            "num_device_alloc": s["num_device_alloc"],
            "num_alloc_retries": s["num_alloc_retries"]}
