"""The child side of test_ipc.py, run by torch.multiprocessing (spawn): installs its own
allocator before anything touches CUDA, then exchanges CUDA tensors with the parent."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bindings", "torch"))


def install(allocator):
    if allocator == "ccalloc":
        import ccalloc_torch
        how = ccalloc_torch.install()
        assert how == "native", how


def child(allocator, to_child, to_parent, device=0):
    """Receives a view of the parent's tensor (on `device`), reads it and adds 1 in place;
    sends back a view of one of its own tensors on that device; waits for the parent to be
    done with it before exiting (the producer must outlive the consumer's use)."""
    try:
        install(allocator)
        import torch
        torch.cuda.set_device(device)
        expandable = "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        # In the expandable runs, 18 MiB first: `own` then straddles two 20 MiB pages.
        pad = torch.empty(18 << 20, dtype=torch.uint8, device="cuda") if expandable else None
        received = to_child.get(timeout=120)
        total = float(received.double().sum())
        exact = bool(torch.equal(received, torch.arange(1000, 2000, dtype=torch.float32, device="cuda")))
        received.add_(1)
        torch.cuda.synchronize()
        own = torch.arange(3 << 20, dtype=torch.float32, device="cuda")
        torch.cuda.synchronize()
        to_parent.put({"backend": torch.cuda.get_allocator_backend(), "sum": total, "exact": exact,
                       "device": received.device.index, "tensor": own[1000:1000 + (1 << 19)]})
        to_child.get(timeout=120)  # the parent has read `own`
        del received, pad
        to_parent.put({"done": True})
    except BaseException as e:  # reported to the parent, which fails the test with it
        to_parent.put({"error": f"{type(e).__name__}: {e}"})
