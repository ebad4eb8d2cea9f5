"""How torch's profiler links a Triton kernel (a driver-API launch, no torch op around it) to the
host: for a torch op's kernel and a Triton kernel, each inside a record_function scope, print
every kineto event's name, device, correlation ids, thread and start — to attribute Triton
kernels to the model's trace scopes in bench/breakdown.py. One-off diagnostic (GPU)."""
import torch
import triton
import triton.language as tl
from torch.profiler import ProfilerActivity, profile, record_function


@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=m) + 1, mask=m)


x = torch.zeros(4096, device="cuda")
_add_one[(4,)](x, x.numel(), BLOCK=1024)  # compile outside the profile
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    with record_function("strata.attention"):
        y = x * 2
        _add_one[(4,)](x, x.numel(), BLOCK=1024)
    with record_function("strata.moe"):
        _add_one[(4,)](x, x.numel(), BLOCK=1024)
    torch.cuda.synchronize()
t0 = min(e.start_ns() for e in prof.profiler.kineto_results.events())
for e in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns()):
    print(f"{e.name()[:40]:<40} {str(e.device_type()):<16} corr={e.correlation_id():<6} "
          f"linked={e.linked_correlation_id():<6} thr={e.start_thread_id()} "
          f"t={(e.start_ns() - t0) / 1e3:9.1f}us dur={e.duration_ns() / 1e3:8.1f}us")
print("FunctionEvents:")
for e in prof.events():
    parent = e.cpu_parent.name if e.cpu_parent else None
    print(f"  {e.name[:40]:<40} {e.device_type!s:<16} id={e.id} parent={parent} "
          f"kernels={[k.name[:20] for k in e.kernels]}")
