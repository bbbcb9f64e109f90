"""ccalloc under PyTorch's own variable PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync, against
PyTorch's cudaMallocAsync backend: PyTorch parses that variable again at run time (CUDA graph
capture, cuDNN, settings changed live, the OOM path) and asserts that the backend it names is
the allocator's name, so these operations ran into "Allocator backend parsed at runtime !=
allocator backend parsed at load time" while ccalloc called itself "ccalloc". The same
operations now run on both, with the same outputs."""

from test_graphs_and_pools import CAPTURE
from torch_compare import assert_same, both, skip_without_gpu

skip_without_gpu()

ASYNC = "backend:cudaMallocAsync"

WORK = """
torch.manual_seed(0)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.backends.cudnn.deterministic = True
got = {"backend": torch.cuda.get_allocator_backend()}
# A CUDA graph of a small MLP, replayed on new inputs.
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                            torch.nn.Linear(128, 10)).cuda()
static_in = torch.randn(16, 64, device="cuda")
""" + CAPTURE + """
outs = []
for i in range(3):
    static_in.copy_(torch.randn(16, 64, generator=torch.Generator().manual_seed(i)).cuda())
    graph.replay()
    outs.append(static_out.sum().item())
got["graph"] = outs
# make_graphed_callables.
callable_model = torch.cuda.make_graphed_callables(
    torch.nn.Linear(32, 8).cuda(), (torch.randn(4, 32, device="cuda", requires_grad=True),))
x = torch.randn(4, 32, device="cuda", requires_grad=True)
y = callable_model(x)
y.sum().backward()
got["graphed"] = [y.sum().item(), x.grad.sum().item()]
# A cuDNN convolution.
conv = torch.nn.Conv2d(3, 8, 3).cuda()
got["conv"] = conv(torch.randn(2, 3, 32, 32, device="cuda")).sum().item()
# Settings changed live.
torch.cuda.memory._set_allocator_settings("garbage_collection_threshold:0.5")
got["after_settings"] = torch.ones(1000, device="cuda").sum().item()
# Out of memory.
try:
    torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    got["oom"] = None
except torch.OutOfMemoryError as e:
    got["oom"] = type(e).__name__
torch.cuda.synchronize()
emit(got=got)
"""


def test_graphs_cudnn_settings_and_oom_run_as_on_pytorchs_cudamallocasync():
    pytorch, ccalloc = both(WORK, conf=ASYNC)
    assert pytorch["got"]["backend"] == "cudaMallocAsync"
    assert pytorch["got"]["oom"] == "OutOfMemoryError"
    assert_same(pytorch["got"], ccalloc["got"], "backend:cudaMallocAsync through PyTorch's variable")


def test_a_backend_named_native_is_the_name_too():
    pytorch, ccalloc = both("""
torch.cuda.memory._set_allocator_settings("garbage_collection_threshold:0.5")
x = torch.ones(1 << 20, device="cuda")
emit(backend=torch.cuda.get_allocator_backend(), total=x.sum().item())
""", conf="backend:native")
    assert pytorch == {"backend": "native", "total": float(1 << 20)}
    assert_same(pytorch, ccalloc, "backend:native through PyTorch's variable")
