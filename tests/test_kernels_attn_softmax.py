"""The attention's one-launch sink softmax (strata.kernels.attn_softmax) against the torch
steps of strata.model.attention.sparse_attention, under TRITON_INTERPRET=1 on CPU
(tests/gpu/test_kernels_fused_ops_gpu.py runs it compiled)."""
from __future__ import annotations

import os

import torch

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is first launched

from strata.kernels.attn_softmax import sink_softmax  # noqa: E402


def torch_steps(s, mask, sink, scale):
    T, H, _ = s.shape
    s = (s * scale).masked_fill(~mask[:, None, :], float("-inf"))
    s = torch.cat((s, sink.view(1, H, 1).expand(T, H, 1)), dim=-1)
    return torch.softmax(s, dim=-1)[..., :-1]


def test_matches_the_torch_steps_and_rows_stand_alone():
    g = torch.Generator().manual_seed(0)
    T, H, n = 5, 3, 40
    s = torch.randn(T, H, n, generator=g) * 30
    mask = torch.rand(T, n, generator=g) > 0.3
    mask[1] = False            # nothing visible: every probability 0, the sink takes it all
    mask[2] = True
    sink = torch.randn(H, generator=g) * 3
    sink[0] = 80.0             # a sink above every score
    got = sink_softmax(s, mask, sink, 0.125)
    want = torch_steps(s, mask, sink, 0.125)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-9)
    assert torch.equal(got[1], torch.zeros(H, n))
    assert torch.equal(sink_softmax(s[3:4], mask[3:4], sink, 0.125), got[3:4])
    # a transposed scores view (any strides) gives the same rows
    st = s.transpose(0, 1).contiguous().transpose(0, 1)
    assert torch.equal(sink_softmax(st, mask, sink, 0.125), got)
