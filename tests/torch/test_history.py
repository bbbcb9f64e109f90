"""torch.cuda.memory._record_memory_history / _snapshot / _dump_snapshot on ccalloc: the same
trace and segments as PyTorch's allocator records, Python frames that name the function
that allocated, and snapshots that torch.cuda._memory_viz renders."""

from torch_compare import assert_same, both, skip_without_gpu

skip_without_gpu()

RECORD = """
import pickle, tempfile
from torch.cuda import _memory_viz

def allocate_in_named_function():
    MiB = 1 << 20
    return [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (1000, 3 * MiB, 30 * MiB)]

def frames_name(frames, name):
    return any(f.get("name") == name for f in frames or [])

torch.cuda.memory._record_memory_history(max_entries=100000)
held = allocate_in_named_function()
scratch = torch.empty(5000, dtype=torch.uint8, device="cuda")
del scratch
del held[0]
torch.cuda.synchronize()
snapshot = torch.cuda.memory._snapshot()
"""


def test_trace_records_the_same_actions_and_sizes():
    pytorch, ccalloc = both(RECORD + """
trace = snapshot["device_traces"][0]
emit(actions=[[e["action"], e["size"]] for e in trace])
""")
    assert [a for a, _ in pytorch["actions"]].count("alloc") == 4
    assert_same(pytorch["actions"], ccalloc["actions"], "device_traces[0] (action, size)")


def test_trace_entries_carry_the_python_frames_of_the_allocating_function():
    pytorch, ccalloc = both(RECORD + """
trace = snapshot["device_traces"][0]
allocs = [e for e in trace if e["action"] == "alloc"]
emit(named=[frames_name(e.get("frames"), "allocate_in_named_function") for e in allocs],
     frees_have_frames=all(e.get("frames") for e in trace if e["action"] == "free_requested"))
""")
    assert pytorch == {"named": [True, True, True, False], "frees_have_frames": True}
    assert_same(pytorch, ccalloc, "frames on trace entries")


def test_live_blocks_and_segments_carry_their_allocation_frames():
    pytorch, ccalloc = both(RECORD + """
blocks = [b for s in snapshot["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
emit(live=sorted([b["size"], frames_name(b.get("frames"), "allocate_in_named_function")] for b in blocks),
     segments_named=sorted(frames_name(s.get("frames"), "allocate_in_named_function")
                           for s in snapshot["segments"]))
""")
    assert [named for _, named in pytorch["live"]] == [True, True]
    assert_same(pytorch, ccalloc, "frames on live blocks and segments")


def test_snapshot_segments_have_the_same_layout():
    pytorch, ccalloc = both(RECORD + """
def layout(s):
    return [s["total_size"], s["allocated_size"], s["active_size"], s["requested_size"],
            s["segment_type"], s["is_expandable"],
            [[b["size"], b["requested_size"] if b["state"] != "inactive" else 0, b["state"]]
             for b in s["blocks"]]]
emit(segments=sorted(layout(s) for s in snapshot["segments"]))
""")
    assert len(pytorch["segments"]) >= 2
    assert_same(pytorch["segments"], ccalloc["segments"], "snapshot segments")


def test_dumped_snapshot_renders_in_memory_viz_with_the_function_name():
    pytorch, ccalloc = both(RECORD + """
path = tempfile.mktemp(suffix=".pickle")
torch.cuda.memory._dump_snapshot(path)
with open(path, "rb") as f:
    dumped = pickle.load(f)
trace_html = _memory_viz.trace_plot(dumped)
segment_html = _memory_viz.segment_plot(dumped)
named = any(frames_name(e.get("frames"), "allocate_in_named_function")
            for e in dumped["device_traces"][0])
blocks_named = sorted(frames_name(b.get("frames"), "allocate_in_named_function")
                      for seg in dumped["segments"] for b in seg["blocks"]
                      if b["state"] == "active_allocated")
emit(named=named, blocks_named=blocks_named,
     trace_html=len(trace_html) > 1000 and "<html" in trace_html.lower(),
     segment_html=len(segment_html) > 1000 and "<html" in segment_html.lower(),
     keys=sorted(dumped))
""")
    assert pytorch["named"] and pytorch["trace_html"] and pytorch["segment_html"]
    assert pytorch["blocks_named"].count(True) == 2  # the two live tensors of the function
    assert_same(pytorch, ccalloc, "dumped snapshot rendered by _memory_viz")


def test_history_can_be_stopped_and_cleared():
    pytorch, ccalloc = both("""
torch.cuda.memory._record_memory_history(max_entries=1000)
x = torch.empty(4096, device="cuda")
enabled = torch._C._cuda_isHistoryEnabled()
torch.cuda.memory._record_memory_history(enabled=None)
stopped = torch._C._cuda_isHistoryEnabled()
y = torch.empty(4096, device="cuda")
emit(enabled=enabled, stopped=stopped, entries=len(torch.cuda.memory._snapshot()["device_traces"][0]))
""")
    assert pytorch == {"enabled": True, "stopped": False, "entries": 0}
    assert_same(pytorch, ccalloc, "history switched off")


CONTEXT_LEVEL = """
MiB = 1 << 20

def allocate_in_named_function():
    return torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")

def free_in_named_function(holder):
    holder.clear()  # the list holds the only reference: the tensor is freed in here

def named(frames, name):
    return any(f.get("name") == name for f in frames or [])

def record(context, stacks):
    torch.cuda.memory._record_memory_history(context=context, stacks=stacks, max_entries=1000)
    keep = allocate_in_named_function()
    free_in_named_function([allocate_in_named_function()])
    torch.cuda.synchronize()
    s = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    entries = [[e["action"], bool(e.get("frames")),
                named(e.get("frames"), "allocate_in_named_function"),
                named(e.get("frames"), "free_in_named_function")]
               for e in s["device_traces"][0] if e["action"] != "snapshot"]
    blocks = sorted([b["state"], bool(b.get("frames")),
                     named(b.get("frames"), "allocate_in_named_function")]
                    for seg in s["segments"] for b in seg["blocks"])
    # Whether segments carry frames, and those of the malloc that allocated (or first
    # mapped) them; then what the segment frees or unmaps of empty_cache carry.
    segments = sorted({(bool(seg.get("frames")),
                        named(seg.get("frames"), "allocate_in_named_function"))
                       for seg in s["segments"]})
    del keep
    torch.cuda.memory._record_memory_history(context=context, stacks=stacks, max_entries=1000)
    torch.cuda.empty_cache()
    after = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    releases = sorted({(bool(e.get("frames")), named(e.get("frames"), "allocate_in_named_function"))
                       for e in after["device_traces"][0]
                       if e["action"] in ("segment_free", "segment_unmap")})
    return {"entries": entries, "blocks": blocks, "segments": segments, "releases": releases}
"""


def test_context_levels_put_frames_where_pytorch_does():
    pytorch, ccalloc = both(CONTEXT_LEVEL + """
emit(**{level: record(level, "python") for level in ("state", "alloc", "all")})
""")
    # state: blocks only; alloc: entries too, frees with the allocation's frames; all: frees
    # with their own.
    assert not any(has for _, has, _, _ in pytorch["state"]["entries"])
    assert any(freed for a, _, _, freed in pytorch["all"]["entries"] if a == "free_requested")
    assert not any(freed for a, _, _, freed in pytorch["alloc"]["entries"])
    assert pytorch["all"]["releases"] == [[True, False]]
    for level in ("state", "alloc", "all"):
        assert_same(pytorch[level], ccalloc[level], "context=" + level)


def test_context_levels_under_the_default_preset():
    # The default policy maps and splits memory its own way, so segment entries and free
    # blocks differ; the allocations' and frees' entries and the live blocks' frames do not.
    pytorch, ccalloc = both(CONTEXT_LEVEL + """
out = {}
for level in ("state", "alloc", "all"):
    r = record(level, "python")
    out[level] = {"entries": [e for e in r["entries"] if not e[0].startswith("segment")],
                  "blocks": [b for b in r["blocks"] if b[0] != "inactive"]}
    out[level + "_segments"] = {"segments": r["segments"], "releases": r["releases"]}
emit(**out)
""", preset="ccalloc")
    assert all(has and named for _, has, named in pytorch["state"]["blocks"])
    for level in ("state", "alloc", "all"):
        assert_same(pytorch[level], ccalloc[level], "context=" + level + " (default preset)")
    # Segments are the policy's own (whether PyTorch would have split a segment's head
    # depends on its layout), but their frames follow the same levels: a segment's own or
    # none, its releases' none at "state", the segment's or none at "alloc", the
    # empty_cache caller's at "all".
    own_or_none = {(False, False), (True, True)}
    for level in ("state", "alloc", "all"):
        mine = ccalloc[level + "_segments"]
        assert {tuple(x) for x in mine["segments"]} <= own_or_none, level
    assert ccalloc["state_segments"]["releases"] == [[False, False]]
    assert {tuple(x) for x in ccalloc["alloc_segments"]["releases"]} <= own_or_none
    assert ccalloc["all_segments"]["releases"] == [[True, False]]


def test_a_segment_never_split_keeps_its_context_as_on_pytorch():
    # 20 MiB: one whole large segment, which no allocation splits; its snapshot entry and
    # its segment free at "alloc" carry the frames of the malloc that allocated it.
    pytorch, ccalloc = both(CONTEXT_LEVEL + """
def allocate_whole_segment():
    return torch.empty(20 * MiB, dtype=torch.uint8, device="cuda")

out = {}
for level in ("state", "alloc", "all"):
    torch.cuda.memory._record_memory_history(context=level, stacks="python", max_entries=1000)
    x = allocate_whole_segment()
    s = torch.cuda.memory._snapshot()
    del x
    torch.cuda.empty_cache()
    after = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    out[level] = {
        "segments": [[seg["total_size"], named(seg.get("frames"), "allocate_whole_segment")]
                     for seg in s["segments"]],
        "releases": [[e["action"], bool(e.get("frames")),
                      named(e.get("frames"), "allocate_whole_segment")]
                     for e in after["device_traces"][0]
                     if e["action"] in ("segment_free", "segment_unmap")]}
emit(**out)
""")
    assert pytorch["state"]["segments"] == [[20 << 20, True]]
    assert pytorch["alloc"]["releases"] == [["segment_free", True, True]]
    for level in ("state", "alloc", "all"):
        assert_same(pytorch[level], ccalloc[level], "context=" + level)


def test_stacks_choice_gathers_the_same_kinds_of_frames():
    pytorch, ccalloc = both(CONTEXT_LEVEL + """
out = {}
for stacks in ("python", "all"):  # torch 2.11 accepts no other value
    r = record("all", stacks)
    out[stacks] = [[a, has, py] for a, has, py, _ in r["entries"] if a == "alloc"]
emit(**out)
""")
    assert all(py for _, _, py in pytorch["python"])
    assert all(has and py for _, has, py in pytorch["all"])
    for stacks in ("python", "all"):
        assert_same(pytorch[stacks], ccalloc[stacks], "stacks=" + stacks)


def test_blocks_keep_their_frames_after_history_stops():
    pytorch, ccalloc = both(CONTEXT_LEVEL + """
torch.cuda.memory._record_memory_history(max_entries=1000)
keep = allocate_in_named_function()
torch.cuda.memory._record_memory_history(enabled=None)
s = torch.cuda.memory._snapshot()
emit(blocks=sorted(named(b.get("frames"), "allocate_in_named_function")
                   for seg in s["segments"] for b in seg["blocks"]
                   if b["state"] == "active_allocated"),
     entries=len(s["device_traces"][0]))
""")
    assert_same(pytorch, ccalloc, "block frames after history stops")


def test_max_entries_keeps_the_newest_entries():
    pytorch, ccalloc = both(CONTEXT_LEVEL + """
torch.cuda.memory._record_memory_history(max_entries=5)
for _ in range(4):
    free_in_named_function([allocate_in_named_function()])
torch.cuda.synchronize()
s = torch.cuda.memory._snapshot()
emit(actions=[[e["action"], named(e.get("frames"), "allocate_in_named_function")]
              for e in s["device_traces"][0]])
""")
    assert len(pytorch["actions"]) == 5
    assert_same(pytorch, ccalloc, "max_entries ring")


def test_memory_metadata_is_kept_on_the_entries_made_while_it_is_set():
    # torch.cuda.memory._set_memory_metadata: a string attached to every allocation made
    # until it is changed or cleared (PyTorch's TraceEntry user_metadata).
    pytorch, ccalloc = both("""
if not hasattr(torch.cuda.memory, "_set_memory_metadata"):
    emit(missing=True)
    sys.exit(0)
torch.cuda.memory._record_memory_history(max_entries=1000)
torch.cuda.memory._set_memory_metadata("phase=forward")
a = torch.empty(1000, dtype=torch.uint8, device="cuda")
torch.cuda.memory._set_memory_metadata("phase=backward")
b = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
torch.cuda.memory._set_memory_metadata("")
c = torch.empty(2000, dtype=torch.uint8, device="cuda")
trace = torch.cuda.memory._snapshot()["device_traces"][0]
allocs = [e for e in trace if e["action"] == "alloc"]
# Every key an entry has other than those that differ from run to run.
emit(entries=[sorted((k, str(v)) for k, v in e.items()
                     if k not in ("addr", "time_us", "frames", "stream"))
              for e in allocs],
     tagged=[any("phase=" in str(v) for v in e.values()) for e in allocs])
""")
    if pytorch.get("missing"):
        import pytest
        pytest.skip("this torch has no torch.cuda.memory._set_memory_metadata")
    assert pytorch["tagged"] == [True, True, False], pytorch
    assert_same(pytorch, ccalloc, "alloc entries under _set_memory_metadata")
