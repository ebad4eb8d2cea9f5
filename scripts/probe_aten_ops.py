"""Which aten ops (not strata's kernels) reach the device in one eager plain step of the probe
session (scripts/probe_session.py; LAYERS as there): each op with the strata source lines that
called it (a TorchDispatchMode), counted by (op, lines, operand shapes). Views and allocations
are left out. One-off diagnostic (GPU): source scripts/device_env.sh && LAYERS=0-4,20-24 python
scripts/probe_aten_ops.py"""
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from probe_session import probe_session

SKIP = {"aten.view", "aten._unsafe_view", "aten.empty", "aten.empty_strided", "aten.slice",
        "aten.select", "aten.as_strided", "aten.t", "aten.reshape", "aten.expand",
        "aten.unsqueeze", "aten.squeeze", "aten.permute", "aten.transpose", "aten.detach",
        "aten.alias", "aten.split", "aten.unbind", "aten.lift_fresh", "aten._to_copy",
        "aten.new_empty", "aten.empty_like", "aten.split_with_sizes", "aten.chunk",
        "aten.narrow", "aten.is_pinned", "aten._reshape_alias", "aten.sym_size",
        "aten.sym_stride", "aten.sym_numel", "aten.sym_storage_offset"}


class Log(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.c = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket).replace("aten::", "aten.")
        out = func(*args, **(kwargs or {}))
        dev = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
        if name not in SKIP and dev:
            where = [f"{f.filename.split('strata/')[-1]}:{f.lineno} {f.name}"
                     for f in traceback.extract_stack()[:-1] if "/strata/" in f.filename]
            shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)][:3]
            self.c[(name, " < ".join(where[-2:][::-1]), str(shapes))] += 1
        return out


s, one_step = probe_session("plain", 2)
log = Log()
with log:
    one_step()
torch.cuda.synchronize()
tot = sum(log.c.values())
print(f"aten ops on the device in one eager plain step: {tot}")
for (name, where, shapes), n in sorted(log.c.items(), key=lambda kv: -kv[1]):
    print(f"{n:4d}  {name:28s} {where}  {shapes}")
