"""Fast EXL3 kernels (Triton): y' = x'·Ŵ straight from the trellis, the reconstruct + GEMM path for
long inputs, the 128-block Hadamard pre/post steps and an MoE kernel grouped by expert
(spec exl3.md §1–§2; the torch reference is strata.quant.exl3).

Entry points: `exl3_linear` (the whole layer), `exl3_moe_linear` (a step's expert pairs, one
launch for several weight sets such as gate + up), `exl3_linear_set` (linears of one input and
any widths in one launch, on the CUDA kernel), `exl3_matmul` / `exl3_partials` (y' only),
`reconstruct` (Ŵ fp16), `rotate_in` / `rotate_out` (the Hadamard steps).

Decode (`_decode_block`). A trellis tile is 16·K int16 = 8K u32 words (little-endian pairs,
MSB-first ring). One *unit* = 64 consecutive ring positions of a tile (p = 64u + q, u = 0..3);
in a unit every window starts at a bit offset that does not depend on u or on the tile, because
64 positions consume exactly 2K words (integer and half-integer K alike). So a unit reads the
2K + 1 consecutive words [2Ku − 1, 2Ku + 2K) (the first one wraps to the tile's last word for
u = 0) with one 32-bit load per word — never one load per weight — and extracts all 64 16-bit
states with compile-time shifts (a funnel of two words, or a bit-field of one), then applies the
codebook arithmetic (3INST / MCG: multiply(-add), one lop3 mask/xor, fp16 sum of the halves
(hadd2 on pairs); MUL1: multiply, byte sum + 0x6400 (= fp16 1024) in one dp4a on CUDA, one fp16
fma (1024 + b)·k1 + k0 — exact, then a single rounding as in the reference). Ring position bits
are (r0, r3, c3, r1, r2, c0 | c1, c2), so unit u holds the columns with (c2 c1) = u, all 16 rows;
the 64 values are assembled with tl.join (each thread keeps its unit in registers) and one
permute/reshape brings them to natural [k, n] order for tl.dot.
Compiled for sm_90 this is ~6.2 (MUL1) / ~7.2 (3INST, MCG) SASS lane-instructions per weight
in the main loop, loads, MMA and layout change included.

Tiles: the fused kernel computes [BLOCK_M = 64 rows] × [BLOCK_N = 64 columns] per program over
its split's k-steps of BLOCK_K = 128 (8×4 trellis tiles = 128 units = one per thread of 4
warps); grid (n_p/64, S, ⌈M/64⌉) or, grouped, (n_p/64, S, sets × expert tiles). Decode steps
use one or a few of the 64 rows: the MMA work is negligible beside the decode, and one tile
row per 64 rows is what prefill needs (Ŵ decoded once per 64 tokens).

Reduction order (batch invariance). Every product is tl.dot over fp16 operands with fp32
accumulation on [BLOCK_K = 128]-deep k-steps, in ascending k, each output element depending
only on its row of x', its column of Ŵ and the incoming accumulator. K is cut into a fixed
number S of splits chosen from (k_p, n_p) only (`split_schedule`); each split starts from zero
and the splits are added in ascending order from zero — by the last-arriving program of each
128-column block in the fused kernel (an arrival counter; it reads all partials back, so which
program arrives last does not matter), in rotate_out, or inside the GEMM kernel.
Within a k-step the tensor cores sum products in groups whose make-up depends on how the
compiler lowers tl.dot — measured on the H200 (scripts/exl3_diag*.py, bench/results/kernels.md):
mma.sync with the dot-operand kWidth 2 (Ŵ from memory) and wgmma (either operand path; B is
read from shared memory) give identical bits, but mma.sync with kWidth 4 — what Triton 3.6
picks for an operand assembled with tl.join, i.e. the decode — rounds differently. Hence:
  - on Hopper every kernel here runs wgmma: BLOCK_M = 64 and GEMM_BLOCK_M = 128 with 4 warps
    per warpgroup (unless DISABLE_MMA_V3 tells Triton otherwise: then as elsewhere);
  - elsewhere (mma.sync only) the GEMM joins Ŵ's column pairs before the dot (`JOIN_B`), so
    both paths get the decode's kWidth: 4 with Triton 3.6, 2 with 3.8 and 3.9 (compiled for
    sm_80/89/120 by tests/test_kernels_exl3.py; run on an H200 told not to use wgmma by the
    GPU suite, not on such a GPU);
  - `_check_dot_order` reads each compiled kernel's lowering and refuses a mix on one GPU.
So nothing depends on M, on which rows share a program, on the grid or on the path:
  - a row's output is bit-identical whatever M and whatever other rows (tokens, MoE pairs)
    share its tile;
  - the fused kernel (decode in registers) and the reconstruct + GEMM kernel (fp16 Ŵ from
    memory) give the same bits, and `exl3_linear` may switch between them by M.

Hadamard steps (`rotate_in`, `rotate_out` / the fused epilogue): x·suh → fp16 (bit-identical
to the reference), then an exact-order butterfly over each 128-block in fp32 (bits b0..b6,
a ± b), one multiply by 1/√128, fp16. The reference multiplies by the 128×128 matrix instead,
so the rotated values may differ from `strata.quant.exl3._rotate` in the last fp32 bits (≤ 1
fp16 ulp after the cast, in ~1 % of elements); every CUDA forward (decode, verify, prefill,
MoE) uses these kernels, so CUDA stays exact against itself.

Early launch (`PDL`, sm_90 and later): rotate_in lets the kernel after it start at once, and a
fused kernel launched right after its rotate_in (`exl3_linear`, `exl3_moe_linear`) decodes each
k-step's tile before it waits (griddepcontrol) for the rotation's end, so the rotation and the
launch overlap the decode; before its wait it reads only what was written before that
rotate_in began (the trellis, the expert groups), and it stores only after. Same bits.

Occupancy: each k-step's trellis words are loaded while the previous step decodes, and the
fused / grouped kernel is capped at FUSED_MAX_REGISTERS (4 programs of 4 warps per SM: a
~512-program decode launch in one wave). A decode-sized call's matmul — a dense linear's
≤ 16 rows, a grouped call's ≤ 64 pairs in tiles of 8 — runs in CUDA C instead
(strata.kernels.exl3_mma: each MMA lane decodes its own fragment window) where its bits are
these kernels' (`cuda_order_reason`: on Hopper, checked by the GPU suite; elsewhere where
Triton lowers tl.dot to mma.sync kWidth 2 and a probe linear agrees on the GPU).

Arrival counters (`_counters`) are one zeroed buffer per device and stream lane (the current
stream, or strata.streams' side stream), zero again after every launch; an eager first call
(the usual CUDA-graph warm-up) allocates them before a capture, and launches on one lane must
not overlap in time (each lane is one stream).

Everything runs on CPU under TRITON_INTERPRET=1 (tests/test_kernels_exl3.py).
"""
from __future__ import annotations

import functools
import math
import os
import re
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

import torch

from strata import streams
from strata.captures import hold
from strata.kernels import exl3_mma
from strata.kernels.moe_grouping import Routing

if TYPE_CHECKING:
    from strata.model.rope import InverseRope

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # CPU-only installs: the torch reference path is used
    triton = None

from strata.kernels import pdl as _early

if triton is not None:  # programmatic dependent launch (Hopper+; Triton ≥ 3.3)
    from strata.kernels.pdl import gdc_launch_dependents, gdc_wait

# The fused kernel after its rotate_in is launched early (programmatic dependent launch): its
# programs start, and decode their first weight tile, while the rotation and the launch are
# still in flight, then wait for x'. False: plain stream order (for A/B measurements).
PDL = True

CODEBOOK_IDS = {"3inst": 0, "mcg": 1, "mul1": 2}

# One fixed configuration (no autotuning): the reduction order depends on none of these except
# BLOCK_K (k-step depth) and the split schedule, which are the same for every kernel here, and
# on the dot lowering, which BLOCK_M ≥ 64 makes wgmma on Hopper (module doc).
BLOCK_K = 128          # k rows per step (8 trellis tiles)
BLOCK_N = 64           # fused / reconstruct: columns per program (4 tiles) → 128 units = 4 warps
BLOCK_M = 64           # fused: rows per program (one wgmma m64 block); MoE tiles use it too
NUM_WARPS = 4
GEMM_BLOCK_M = 128     # reconstruct path GEMM (wgmma on Hopper)
GEMM_BLOCK_N = 128
GEMM_NUM_WARPS = 8
GEMM_NUM_STAGES = 3
# GEMM operand tiles through TMA (host tensor descriptors) on Hopper: the same bits, the
# non-routed linears of a 4,096-row chunk in 2,271 µs instead of 2,652 (H100, session 49)
GEMM_TMA = True
ROT_ROWS = 16          # rows per program of the Hadamard kernels
FINISH_ROWS = 16       # fused output step: rows per sub-block (decode fills 1–6 of a tile's 64)
TARGET_PROGRAMS = 512  # split schedule: aim for this many programs in a single-row launch
# The split schedule of weights that run many to a grouped launch — the routed experts (≥ 6
# experts × 2 weight sets a decode step; strata.kernels.moe) and wo_a's 8 groups
# (strata.quant.groups) — whose every call, grouped or alone, passes it: each weight needs far
# fewer programs than a lone linear, and fewer splits mean fewer partials to write and sum.
# 64: experts 2 splits for gate / up (5120 → 2304), 1 for down; wo_a 4 (4096 → 1024) instead
# of 32. Session 17, routed experts against 512 (14 and 6 splits): DSpark windows +11–13 %,
# plain decode +3 %; 128 and 256 in between (kernels.md).
GROUPED_TARGET_PROGRAMS = 64
FUSED_MAX_ROWS = 64    # auto path: fused decode up to this many rows, reconstruct + GEMM above
GEMM_SLICE_BYTES = 64 << 20  # reconstructed Ŵ slice size bound (columns chunked to fit)
# Fused / grouped kernel: registers per thread. At ≤ 128 an SM holds 4 programs of 4 warps
# (as its shared memory allows), one wave of a ~512-program decode launch; left to itself the
# compiler took 134 (fused) and 161–234 (grouped) on the H200 — 3 or 2 programs per SM, a
# second partial wave (bench/results/kernels.md, session 11). None: the compiler's choice.
FUSED_MAX_REGISTERS = 128
MOE_SPLIT_LOOP_PAIRS = 64    # MoE: above this many pairs, programs loop over the K splits
# MoE split loop (many pairs: prefill, where the CUDA prefill kernel does not apply): pairs per
# expert tile, with NUM_WARPS per 64 of them. Each expert's weights are decoded once per tile
# of its pairs; 128 would decode each once at a 4,096-token chunk (experts average 64 pairs)
# but measured 2.7× slower than 64 (session 16: 25.0 against 9.2 ms for gate + up; the
# compiled loop spills). A wgmma's rows do not change its bits (the GEMM kernel's 128-row
# tiles give the fused kernel's), so any multiple of 64 keeps them.
MOE_LOOP_BLOCK_M = 64
# MoE: larger steps run in token chunks (bounded buffers). A prefill chunk's pairs (top-6) in
# one grouped call decode each expert's tiles once per chunk, not once per part of it: up to an
# 8,192-row chunk's 49,152 pairs (experts average 128), whose call's buffers at V4.1's shapes
# are ~2.4 GB (gate/up: x' in fp16, fp32 partials, outputs). With them in one call an 8,192-row
# chunk prefills 5 % faster than a 4,096-row one (H100, bench/results/performance.md, session
# 57); split in two calls of 24,576 it was not faster (sessions 47–53).
MOE_MAX_PAIRS = 49152

INV_SQRT128 = float(torch.tensor(1.0, dtype=torch.float32) / math.sqrt(128))


_interpreting = _early.interpreting


def _require_triton() -> None:
    if triton is None:
        raise RuntimeError("the EXL3 kernels need triton")


def k2_of(trellis: torch.Tensor) -> int:
    """2·K from the trellis' last dim (16·K int16, or 16·KA + 8 for K = KA + ½)."""
    from strata.quant.exl3 import bits_per_weight
    return int(round(2 * bits_per_weight(trellis.shape[-1])))


def split_schedule(k_p: int, n_p: int, target: int | None = None) -> tuple[int, int]:
    """(k-steps per split, number of splits S) for a k_p × n_p weight, aiming at `target`
    (default TARGET_PROGRAMS) programs for one row. A function of the shape (and the target a
    weight's caller always passes) only: every path and every M use it, which fixes each
    output element's summation order."""
    k_steps, n_blocks = k_p // BLOCK_K, max(1, n_p // BLOCK_N)
    want = max(1, min(k_steps, -(-(target or TARGET_PROGRAMS) // n_blocks)))
    per = -(-k_steps // want)
    return per, -(-k_steps // per)


def _check_shapes(trellis: torch.Tensor, codebook: str) -> tuple[int, int, int]:
    if trellis.dtype != torch.int16 or trellis.dim() < 3:
        raise ValueError(f"trellis must be int16 [.., kt, nt, 16·K], got {trellis.dtype} "
                         f"{list(trellis.shape)}")
    if codebook not in CODEBOOK_IDS:
        raise ValueError(f"unknown EXL3 codebook {codebook!r}")
    kt, nt = trellis.shape[-3], trellis.shape[-2]
    if (16 * kt) % BLOCK_K or (16 * nt) % BLOCK_N:
        raise ValueError(f"trellis {16 * kt}×{16 * nt}: dims must be multiples of "
                         f"{BLOCK_K}×{BLOCK_N} (EXL3 pads both to 128)")
    K2 = k2_of(trellis)
    if K2 % 2 and codebook != "mul1":
        raise ValueError(f"half-integer K = {K2 / 2} exists only with the mul1 codebook")
    return kt, nt, K2


if triton is not None:
    from strata.kernels.mhc import _round_out
    from strata.kernels.moe_ops import swiglu_values
    from strata.kernels.rope import rotate_pair_channel

    # the activation dtypes an inverse RoPE in rotate_in may round to (its ROPE_DT)
    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
                  torch.float32: tl.float32}

    # ---------------------------------------------------------------- trellis decode (device)

    @triton.jit
    def _unit_words(P, P0, NW: tl.constexpr):
        """The NW (= 2K + 1) words of each unit; word 0 through the wrapped pointer P0."""
        W = (tl.load(P0).to(tl.uint32, bitcast=True),)
        for i in tl.static_range(1, NW):
            W = W + (tl.load(P + i).to(tl.uint32, bitcast=True),)
        return W

    @triton.jit
    def _state(W, Q: tl.constexpr, K2: tl.constexpr):
        """16-bit state of ring position q of a unit: the window ending at bit E(q) (relative to
        the unit's first position) lies at bits [E(q) + 16, E(q) + 32) of the loaded words."""
        if K2 % 2 == 0:
            E: tl.constexpr = (Q + 1) * (K2 // 2)
        elif Q % 2 == 0:  # K = KA + ½: position p takes KA + (p odd) bits
            E: tl.constexpr = (Q // 2) * K2 + K2 // 2
        else:
            E: tl.constexpr = (Q // 2 + 1) * K2
        A: tl.constexpr = (E + 16) // 32
        O: tl.constexpr = (E + 16) % 32
        if O <= 16:
            s = (W[A] >> (16 - O)) & 0xFFFF
        else:
            s = ((W[A] << (O - 16)) | (W[A + 1] >> (48 - O))) & 0xFFFF
        return s

    @triton.jit
    def _codebook(s, CB: tl.constexpr, ASM: tl.constexpr):
        """CB(s) as fp16 (exl3.md §1.4), bit-exact."""
        if CB == 2:
            x = s * 0x83DCD12D
            # 0x6400 + Σ bytes (≤ 1020) is the fp16 bit pattern of 1024 + Σ bytes
            if ASM:
                b = tl.inline_asm_elementwise(  # the byte sum in one instruction
                    "dp4a.u32.u32 $0, $1, $2, $3;", "=r,r,r,r",
                    [x, tl.full(x.shape, 0x01010101, tl.uint32), tl.full(x.shape, 0x6400, tl.uint32)],
                    dtype=tl.uint32, is_pure=True, pack=1)
            else:
                t = (x & 0x00FF00FF) + ((x >> 8) & 0x00FF00FF)
                b = (t & 0xFFFF) + (t >> 16) + 0x6400
            f = b.to(tl.uint16).to(tl.float16, bitcast=True)
            # (1024 + b)·k1 + k0 exact, rounded once to fp16 (an fp16 fma, as exllamav3's hfma2)
            v = tl.fma(f, tl.full(f.shape, 0.0067672729492187500, tl.float16),  # fp16 0x1EEE
                       tl.full(f.shape, -10.3828125, tl.float16))  # fp16 0xC931
        else:
            if CB == 0:
                x = s * 89226354 + 64248484
            else:
                x = s * 0xCBAC1FED
            x = (x & 0x8FFF8FFF) ^ 0x3B603B60
            lo = (x & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
            hi = (x >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
            v = lo + hi  # exact sum, one fp16 rounding
        return v

    @triton.jit
    def _dec1(W, QP: tl.constexpr, K2: tl.constexpr, CB: tl.constexpr, ASM: tl.constexpr):
        """Value number QP of a unit in assembly order: QP bits (b0..b5) = (r3, r2, r1, r0, c3,
        c0), so the joined tensor reshapes to [.., 16 (row r), 2 (c3), 2 (c0)]."""
        R: tl.constexpr = 8 * (QP & 1) + 4 * ((QP >> 1) & 1) + 2 * ((QP >> 2) & 1) + ((QP >> 3) & 1)
        C3: tl.constexpr = (QP >> 4) & 1
        C0: tl.constexpr = (QP >> 5) & 1
        # ring position within the unit: bits (r0, r3, c3, r1, r2, c0)
        Q: tl.constexpr = ((R & 1) | ((R >> 3) & 1) << 1 | C3 << 2 | ((R >> 1) & 1) << 3
                           | ((R >> 2) & 1) << 4 | C0 << 5)
        return _codebook(_state(W, Q, K2), CB, ASM)

    @triton.jit
    def _dec2(W, QP: tl.constexpr, K2: tl.constexpr, CB: tl.constexpr, ASM: tl.constexpr):
        return tl.join(_dec1(W, QP, K2, CB, ASM), _dec1(W, QP + 1, K2, CB, ASM))

    @triton.jit
    def _dec4(W, QP: tl.constexpr, K2: tl.constexpr, CB: tl.constexpr, ASM: tl.constexpr):
        return tl.join(_dec2(W, QP, K2, CB, ASM), _dec2(W, QP + 2, K2, CB, ASM))

    @triton.jit
    def _dec8(W, QP: tl.constexpr, K2: tl.constexpr, CB: tl.constexpr, ASM: tl.constexpr):
        return tl.join(_dec4(W, QP, K2, CB, ASM), _dec4(W, QP + 4, K2, CB, ASM))

    @triton.jit
    def _dec16(W, QP: tl.constexpr, K2: tl.constexpr, CB: tl.constexpr, ASM: tl.constexpr):
        return tl.join(_dec8(W, QP, K2, CB, ASM), _dec8(W, QP + 8, K2, CB, ASM))

    @triton.jit
    def _dec32(W, QP: tl.constexpr, K2: tl.constexpr, CB: tl.constexpr, ASM: tl.constexpr):
        return tl.join(_dec16(W, QP, K2, CB, ASM), _dec16(W, QP + 16, K2, CB, ASM))

    @triton.jit
    def _dec64(W, K2: tl.constexpr, CB: tl.constexpr, ASM: tl.constexpr):
        return tl.join(_dec32(W, 0, K2, CB, ASM), _dec32(W, 32, K2, CB, ASM))

    @triton.jit
    def _block_words(tr_ptr, row_words, ks, nb, K2: tl.constexpr, BK: tl.constexpr,
                     BN: tl.constexpr):
        """The trellis words of block (ks, nb): one unit per thread, 2K + 1 words each.
        tr_ptr: int32 words of tile (0, 0); row_words: words between tile rows (nt·8K)."""
        TK: tl.constexpr = BK // 16
        TN: tl.constexpr = BN // 16
        WT: tl.constexpr = 4 * K2  # words per tile (8K)
        i = tl.arange(0, TK * TN * 4)
        tk = i // (TN * 4)
        tn = (i // 4) % TN
        u = i % 4
        base = ((ks * TK + tk).to(tl.int64) * row_words + (nb * TN + tn).to(tl.int64) * WT
                + u * K2 - 1)
        P = tr_ptr + base
        return _unit_words(P, P + tl.where(u == 0, WT, 0), K2 + 1)

    @triton.jit
    def _decode_block(tr_ptr, row_words, ks, nb, K2: tl.constexpr, CB: tl.constexpr,
                      ASM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
        """Ŵ[ks·BK : +BK, nb·BN : +BN] as fp16 [BK, BN] in natural order, decoded in registers."""
        return _decode_words(_block_words(tr_ptr, row_words, ks, nb, K2, BK, BN), K2, CB, ASM,
                             BK, BN)

    @triton.jit
    def _decode_words(W, K2: tl.constexpr, CB: tl.constexpr, ASM: tl.constexpr,
                      BK: tl.constexpr, BN: tl.constexpr):
        """The block of _block_words' W as fp16 [BK, BN] in natural order."""
        TK: tl.constexpr = BK // 16
        TN: tl.constexpr = BN // 16
        v = _dec64(W, K2, CB, ASM)                       # [units, 2, 2, 2, 2, 2, 2]
        v = tl.reshape(v, [TK, TN, 4, 16, 2, 2])         # (tk, tn, c2c1, r, c3, c0)
        v = tl.permute(v, (0, 3, 1, 4, 2, 5))            # (tk, r, tn, c3, c2c1, c0)
        return tl.reshape(v, [BK, BN])

    # ---------------------------------------------------------------- kernels

    @triton.jit
    def _split_acc(xrow, rmask, tr, row_words, nb, k_lo, k_hi, K2: tl.constexpr,
                   CB: tl.constexpr, ASM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, PDL: tl.constexpr):
        """Σ over k-steps [k_lo, k_hi) of tl.dot(x'[rows, step], Ŵ-decoded[step, cols]) from
        zero, in ascending k (one split's partial). PDL: each step's tile is decoded before
        waiting for the rotation that writes x' (the first wait blocks; later ones return)."""
        offs_k = tl.arange(0, BK)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        W = _block_words(tr, row_words, k_lo, nb, K2, BK, BN)
        for ks in range(k_lo, k_hi):
            # the next step's words load while this step decodes (the last step reloads its own)
            Wn = _block_words(tr, row_words, tl.minimum(ks + 1, k_hi - 1), nb, K2, BK, BN)
            b = _decode_words(W, K2, CB, ASM, BK, BN)
            W = Wn
            if PDL:
                gdc_wait()
            a = tl.load(xrow[:, None] + (ks * BK + offs_k)[None, :], mask=rmask[:, None],
                        other=0.0)
            acc = tl.dot(a, b, acc)
        return acc

    @triton.jit
    def _tile_rows(rows_ptr, tile, e, g, M, lanes, GROUPED: tl.constexpr, BM: tl.constexpr):
        """Row ids and mask of `lanes` of this program's row tile: grouped, pair ids from
        tile_rows (−1 padding, 0 where masked; none valid on an unused tile, expert e = −1);
        otherwise rows g·BM + lane < M."""
        if GROUPED:
            rows = tl.load(rows_ptr + tile * BM + lanes)
            rmask = (rows >= 0) & ((rows * 0 + e) >= 0)  # (not `& used`: interpreter dtype bug)
            rows = tl.where(rmask, rows, 0)
        else:
            rows = g * BM + lanes
            rmask = rows < M
        return rows, rmask

    @triton.jit
    def _fused_kernel(x_ptr, tr_ptr, part_ptr, rows_ptr, texp_ptr,
                      M, n_tiles, k_steps, per_split, row_words,
                      sx_row, sx_set, str_exp, str_set,
                      sp_set, sp_split, sp_row,
                      cnt_ptr, svh_ptr, bias_ptr, out_ptr, n_out, ssvh_e, ssvh_set,
                      so_set, so_row, inv,
                      K2: tl.constexpr, CB: tl.constexpr, ASM: tl.constexpr,
                      GROUPED: tl.constexpr, FUSE_OUT: tl.constexpr, HAS_BIAS: tl.constexpr,
                      SPLIT_LOOP: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      FR: tl.constexpr, PDL: tl.constexpr):
        """Partial y' of split s for one BN column block and BM rows: Σ over the split's
        k-steps of tl.dot(x'[rows, k-step], Ŵ-decoded[k-step, cols]) from zero.
        GROUPED: program axis 2 = set · n_tiles + tile; the tile's rows are pair ids
        (tile_rows, −1 padding) and its expert selects the trellis.
        FUSE_OUT: the last of the 2·S programs writing a 128-column block (an arrival counter,
        reset to 0 by it) finishes that block as rotate_out does, from the partials in
        ascending split order: the same bits whichever program arrives last. It works in
        sub-blocks of FR rows, only those holding valid rows (a decode tile has 1–6 of its BM):
        each row's arithmetic is the same whatever rows share its sub-block.
        SPLIT_LOOP (grid axis 1 = 1): one program runs the S splits itself, each from zero,
        adding them in ascending order from zero — the arithmetic of the GEMM kernel, so the
        same bits — and writes only the combined y' (no [S, ...] buffer; for many rows).
        PDL (launched right after its rotate_in, which lets it start early): before waiting
        it reads only what was written before that rotate_in began (the trellis, the expert
        groups); x' after the wait, and every store after it."""
        nb = tl.program_id(0)
        s = tl.program_id(1)
        g = tl.program_id(2)
        lanes = tl.arange(0, BM)
        if GROUPED:
            tile = g % n_tiles
            wset = (g // n_tiles).to(tl.int64)
            e = tl.load(texp_ptr + tile)
            used = e >= 0  # unused tiles (expert -1) do nothing
            rows, rmask = _tile_rows(rows_ptr, tile, e, g, M, lanes, GROUPED, BM)
            e64 = tl.maximum(e, 0).to(tl.int64)
            tr = tr_ptr + wset * str_set + e64 * str_exp
            xrow = x_ptr + wset * sx_set + rows.to(tl.int64) * sx_row
            prow = part_ptr + wset * sp_set + rows.to(tl.int64) * sp_row
            k_hi = tl.where(used, tl.minimum((s + 1) * per_split, k_steps), 0)
        else:
            wset = 0
            tile = 0
            e = 0
            e64 = 0
            rows, rmask = _tile_rows(rows_ptr, tile, e, g, M, lanes, GROUPED, BM)
            tr = tr_ptr
            xrow = x_ptr + rows.to(tl.int64) * sx_row
            prow = part_ptr + rows.to(tl.int64) * sp_row
            k_hi = tl.minimum((s + 1) * per_split, k_steps)
        offs_n = nb * BN + tl.arange(0, BN)
        if SPLIT_LOOP:  # this program runs every split in order: the combined y' (as split 0)
            k_end = tl.where(k_hi > 0, k_steps, 0)
            acc = tl.zeros([BM, BN], dtype=tl.float32)
            for k0 in range(0, k_end, per_split):
                acc = acc + _split_acc(xrow, rmask, tr, row_words, nb, k0,
                                       tl.minimum(k0 + per_split, k_steps),
                                       K2, CB, ASM, BM, BN, BK, PDL)
        else:
            acc = _split_acc(xrow, rmask, tr, row_words, nb, s * per_split, k_hi,
                             K2, CB, ASM, BM, BN, BK, PDL)
        if PDL:
            gdc_wait()  # (a program with no k-step of its own has not waited yet)
        tl.store(prow[:, None] + s.to(tl.int64) * sp_split + offs_n[None, :], acc,
                 mask=rmask[:, None])
        if FUSE_OUT:
            n_split = tl.num_programs(1)
            cnt = cnt_ptr + g.to(tl.int64) * (tl.num_programs(0) // 2) + nb // 2
            tl.debug_barrier()  # every thread's partial stores before the (release) arrival
            prev = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
            if prev == 2 * n_split - 1:
                tl.debug_barrier()
                tl.store(cnt, 0)
                # The valid rows are a prefix of the tile (rows g·BM + lane < M; a grouped
                # tile's pairs come before its −1 padding: group_by_expert), so only the
                # first ⌈n_valid / FR⌉ sub-blocks are finished, not BM mostly masked rows.
                tl.static_assert(BM % FR == 0)  # sub-blocks stay inside the tile
                if GROUPED:
                    n_valid = tl.sum(rmask.to(tl.int32), axis=0)
                else:
                    n_valid = tl.minimum(M - g * BM, BM)
                cols = (nb // 2) * 128 + tl.arange(0, 128)
                for sub in range(0, tl.cdiv(n_valid, FR)):
                    srows, smask = _tile_rows(rows_ptr, tile, e, g, M,
                                              sub * FR + tl.arange(0, FR), GROUPED, BM)
                    srows = srows.to(tl.int64)
                    _finish_block(part_ptr + wset * sp_set + srows * sp_row, smask, cols,
                                  n_split, sp_split,
                                  svh_ptr + wset * ssvh_set + e64 * ssvh_e + srows * 0,
                                  bias_ptr, out_ptr + wset * so_set + srows * so_row, n_out,
                                  inv, HAS_BIAS, FR)

    # per_split never a constant: with a 1 (wkv's and wo_a's schedules) the split-end branch
    # folds away and Triton's combine pass turns `total + tl.dot(a, b, 0)` into
    # `tl.dot(a, b, total)` — the chain summed onto the total, other bits (session 43)
    @triton.jit(do_not_specialize=["per_split"])
    def _gemm_kernel(x_ptr, w_ptr, x_desc, w_desc, y_ptr, M, k_steps, per_split, sx_row,
                     sw_row, sy_row, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     JOIN_B: tl.constexpr, TMA: tl.constexpr):
        """y'[rows, cols] = Σ_s (Σ_{k-steps of s} tl.dot(x', Ŵ)) with Ŵ fp16 from memory: the
        same k-steps, dot shape and split sums as the fused kernel + rotate_out.
        TMA: the operand tiles come through tensor descriptors (x_desc [BM, BK] of x', w_desc
        [BK, BN] of Ŵ; rows past M read as zeros) instead of the pointers.
        (int32 offsets from scalar bases advanced per step: a Ŵ slice is < 2³¹ elements)"""
        mb = tl.program_id(0)
        nb = tl.program_id(1)
        lanes = tl.arange(0, BM)
        rows = mb * BM + lanes
        rmask = rows < M
        offs_k = tl.arange(0, BK)
        a_off = tl.where(rmask, lanes, 0)[:, None] * sx_row + offs_k[None, :]
        b_off = offs_k[:, None] * sw_row + (nb * BN + tl.arange(0, BN))[None, :]
        b_off2 = offs_k[:, None] * sw_row + (nb * BN + 2 * tl.arange(0, BN // 2))[None, :]
        a_base = x_ptr + (mb * BM).to(tl.int64) * sx_row
        b_base = w_ptr
        # One loop over all k-steps, each split's chain added to the total where it ends: a
        # loop per split (1–2 k-steps for the narrow weights) restarts Triton's software
        # pipeline every split (wq_a, wkv at 210–270 TFLOPS on an H100, session 42)
        total = tl.zeros([BM, BN], dtype=tl.float32)
        part = tl.zeros([BM, BN], dtype=tl.float32)
        for ks in range(0, k_steps):
            if TMA:  # (Hopper: 14 % less time than the loads below at a prefill's shapes)
                a = x_desc.load([mb * BM, ks * BK])
                b = w_desc.load([ks * BK, nb * BN])
            else:
                a = tl.load(a_base + a_off, mask=rmask[:, None], other=0.0)
                if JOIN_B:  # Ŵ's column pairs joined, as the decode assembles its block
                    b0 = tl.load(b_base + b_off2)
                    b = tl.reshape(tl.join(b0, tl.load(b_base + b_off2 + 1)), [BK, BN])
                else:
                    b = tl.load(b_base + b_off)
            part = tl.dot(a, b, part)
            a_base += BK
            b_base += BK * sw_row
            if (ks + 1) % per_split == 0 or ks + 1 == k_steps:  # a split ends
                total = total + part
                part = tl.zeros([BM, BN], dtype=tl.float32)
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * sy_row + (nb * BN + tl.arange(0, BN))[None, :],
                 total, mask=rmask[:, None])

    @triton.jit
    def _reconstruct_kernel(tr_ptr, w_ptr, row_words, sw_row, nb0,
                            K2: tl.constexpr, CB: tl.constexpr, ASM: tl.constexpr,
                            BN: tl.constexpr, BK: tl.constexpr):
        """Ŵ fp16 [k_p, n] (columns from tile column nb0·BN/16 on) through _decode_block."""
        ks = tl.program_id(0)
        nb = tl.program_id(1)
        b = _decode_block(tr_ptr, row_words, ks, nb0 + nb, K2, CB, ASM, BK, BN)
        kk = ks * BK + tl.arange(0, BK)
        nn = nb * BN + tl.arange(0, BN)
        tl.store(w_ptr + kk.to(tl.int64)[:, None] * sw_row + nn[None, :], b)

    # ---------------------------------------------------------------- Hadamard steps

    @triton.jit
    def _fwht128(x, BR: tl.constexpr):
        """Unnormalised natural-order Sylvester H128 along dim 1 of [BR, 128] fp32: one
        butterfly (a + b, a − b) per index bit, b0 first; after each stage the processed bit
        moves to the top, so seven stages restore the order. A fixed expression per element."""
        for _ in tl.static_range(7):
            a, b = tl.split(tl.reshape(x, [BR, 64, 2]))
            x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), [BR, 128])
        return x

    @triton.jit
    def _rotate_in_kernel(x_ptr, suh_ptr, out_ptr, eidx_ptr,
                          R, x_per, k_in, sx_row, ssuh_e, ssuh_set, so_set, so_row, inv,
                          up_ptr, rw_ptr, sup_row, limit,
                          cos_ptr, sin_ptr, scs_row, TOK_PER: tl.constexpr, HD: tl.constexpr,
                          TAIL0: tl.constexpr, sign,
                          HAS_EIDX: tl.constexpr, BR: tl.constexpr, PDL: tl.constexpr,
                          FRAG: tl.constexpr, SWIGLU: tl.constexpr, ROPE: tl.constexpr,
                          ROPE_DT: tl.constexpr):
        """out[set, r, blk] = fp16(H128(fp16(x[r // x_per]·suh[set, e(r)])) · 1/√128)
        (x_per: rows of out per row of x — a token's k expert pairs read its one x row).
        SWIGLU: x is the gate, and the row rotated is moe_ops.swiglu_values(x, up, rw[r],
        limit) in x's dtype (up_ptr: the up projection, rows sup_row apart; rw_ptr: a
        routing weight per row) — the SwiGLU kernel's bits without its launch.
        ROPE: x holds heads of HD channels whose channels from TAIL0 on are RoPE-rotated
        pairs; the row rotated is x with those pairs rotated back by row r // TOK_PER of
        cos/sin (rows scs_row apart; sign −1: the inverse), rounded to ROPE_DT —
        strata.kernels.rope.apply_rope(x, cos, sin, inverse, ROPE_DT)'s bits without its
        launch and its copy of x. FRAG: each 128-block stored in the CUDA decode kernel's
        fragment order (exl3_mma.fragment_order). PDL: it waits for the kernel before it (it
        may itself be launched early), then lets the kernel after it start (which waits for
        this one's end before reading out)."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        cols = tl.program_id(1) * 128 + tl.arange(0, 128)
        wset = tl.program_id(2).to(tl.int64)
        rmask = rows < R
        xr = rows // x_per
        cmask = rmask[:, None] & (cols < k_in)[None, :]
        x = tl.load(x_ptr + xr.to(tl.int64)[:, None] * sx_row + cols[None, :],
                    mask=cmask, other=0.0).to(tl.float32)
        if SWIGLU:  # (columns past k_in: swiglu(0, 0) = 0, the zero extension's value)
            up = tl.load(up_ptr + xr.to(tl.int64)[:, None] * sup_row + cols[None, :],
                         mask=cmask, other=0.0).to(tl.float32)
            rw = tl.load(rw_ptr + xr, mask=rmask, other=0.0)[:, None]
            x = swiglu_values(x, up, rw, limit, x_ptr.dtype.element_ty).to(tl.float32)
        if ROPE:  # (a channel's pair partner is the channel next to it: column ^ 1)
            # (HD, TOK_PER compile-time: their divisions are shifts or multiplies, not an
            # integer division sequence per element)
            ch = cols % HD
            tail = cmask & (ch >= TAIL0)[None, :]
            partner = tl.load(x_ptr + xr.to(tl.int64)[:, None] * sx_row + (cols ^ 1)[None, :],
                              mask=tail, other=0.0).to(tl.float32)
            cs = (rows // TOK_PER).to(tl.int64)[:, None] * scs_row + ((ch - TAIL0) // 2)[None, :]
            c = tl.load(cos_ptr + cs, mask=tail, other=1.0)
            s = tl.load(sin_ptr + cs, mask=tail, other=0.0) * sign
            x = _round_out(tl.where(tail, rotate_pair_channel(x, partner, c, s, ch % 2 == 0),
                                    x), ROPE_DT).to(tl.float32)
        suh_row = suh_ptr + wset * ssuh_set
        if HAS_EIDX:
            e = tl.load(eidx_ptr + rows, mask=rmask, other=0)
            suh = tl.load(suh_row + e.to(tl.int64)[:, None] * ssuh_e + cols[None, :])
        else:
            suh = tl.load(suh_row + cols)[None, :]
        h = (x * suh.to(tl.float32)).to(tl.float16).to(tl.float32)
        h = _fwht128(h, BR) * inv
        if FRAG:  # column 16i + 8h + 2t + j → 32t + 4i + 2h + j
            c = tl.arange(0, 128)
            cols = (tl.program_id(1) * 128 + 32 * ((c % 8) // 2) + 4 * (c // 16)
                    + 2 * ((c % 16) // 8) + c % 2)
        tl.store(out_ptr + wset * so_set + rows.to(tl.int64)[:, None] * so_row + cols[None, :],
                 h.to(tl.float16), mask=rmask[:, None])

    @triton.jit
    def _finish_block(prow, rmask, cols, S, sp_split, svh_rows, bias_ptr, orow, n_out, inv,
                      HAS_BIAS: tl.constexpr, BR: tl.constexpr):
        """out[r, cols] = (H128(Σ_s part[s, r, cols]) · 1/√128) · svh[r] (+ bias) for one
        128-column block: partials summed in ascending s from zero, columns ≥ n_out dropped.
        prow / svh_rows / orow: [BR] row pointers (partials of split 0, svh, output)."""
        src = prow[:, None] + cols[None, :]
        y = tl.zeros([BR, 128], dtype=tl.float32)
        for s in range(0, S):
            y = y + tl.load(src + s * sp_split, mask=rmask[:, None], other=0.0,
                            cache_modifier=".cg")
        y = _fwht128(y, BR) * inv
        y = y * tl.load(svh_rows[:, None] + cols[None, :]).to(tl.float32)
        cmask = cols < n_out
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        tl.store(orow[:, None] + cols[None, :], y.to(orow.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])

    @triton.jit
    def _rotate_out_kernel(part_ptr, svh_ptr, bias_ptr, out_ptr, eidx_ptr,
                           R, S, n_out, sp_set, sp_split, sp_row, ssvh_e, ssvh_set,
                           so_set, so_row, inv,
                           HAS_BIAS: tl.constexpr, HAS_EIDX: tl.constexpr, BR: tl.constexpr):
        """out[set, r, blk] = (H128(Σ_s part[set, s, r, blk]) · 1/√128) · svh (+ bias)."""
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        cols = tl.program_id(1) * 128 + tl.arange(0, 128)
        wset = tl.program_id(2).to(tl.int64)
        rmask = rows < R
        rows64 = tl.where(rmask, rows, 0).to(tl.int64)
        e = rows64 * 0
        if HAS_EIDX:
            e = tl.load(eidx_ptr + rows64, mask=rmask, other=0).to(tl.int64)
        _finish_block(part_ptr + wset * sp_set + rows64 * sp_row, rmask, cols, S, sp_split,
                      svh_ptr + wset * ssvh_set + e * ssvh_e, bias_ptr,
                      out_ptr + wset * so_set + rows64 * so_row, n_out, inv, HAS_BIAS, BR)


# -------------------------------------------------------------------- launch helpers

_CHECKED: set = set()
_DOT_ORDER: dict = {}  # compute capability → (dot lowering, the kernel that set it)


def dot_lowering(compiled) -> str:
    """How a compiled kernel's tl.dot runs: 'wgmma', or 'mma.sync kWidth N' (from the TTGIR)."""
    asm = getattr(compiled, "asm", {})
    if "wgmma" in asm.get("ptx", ""):
        return "wgmma"
    widths = sorted(set(re.findall(r"kWidth = (\d+)", asm.get("ttgir", ""))))
    return f"mma.sync kWidth {','.join(widths) or '?'}"


def mma_v3_disabled() -> bool:
    """Whether Triton is told not to use wgmma (DISABLE_MMA_V3, read as Triton reads it)."""
    return os.environ.get("DISABLE_MMA_V3", "").lower() in ("1", "true", "on")


def _expects_wgmma(cap: tuple[int, int]) -> bool:
    return cap[0] == 9 and not mma_v3_disabled()


def _record_dot_order(cap: tuple[int, int], got: str, name: str) -> None:
    """The rule of `_check_dot_order` for one kernel lowered as `got` on capability `cap`."""
    if _expects_wgmma(cap) and got != "wgmma":
        raise RuntimeError(f"{name}: triton lowered tl.dot to {got} on sm_90; the EXL3 kernels "
                           "need wgmma there (BLOCK_M ≥ 64, 4 warps per warpgroup) for "
                           "bit-identical fused/GEMM/MoE results")
    first = _DOT_ORDER.setdefault(cap, (got, name))
    if first[0] != got:
        raise RuntimeError(f"{name}: triton lowered tl.dot to {got} but {first[1]} to "
                           f"{first[0]} on this GPU; the EXL3 paths would not give the same bits "
                           "(check this triton version's dot-operand layouts)")


def _check_dot_order(compiled, name: str, device: torch.device) -> None:
    """Exactness guard (module doc, "Reduction order"): every EXL3 kernel compiled for one kind
    of GPU must lower tl.dot the same way — on Hopper wgmma, elsewhere mma.sync with one
    kWidth — or the fused, GEMM and MoE paths would round differently. Refuse a mismatch."""
    if compiled is None or _interpreting():
        return
    key = (name, id(compiled))
    if key in _CHECKED:
        return
    _record_dot_order(torch.cuda.get_device_capability(device), dot_lowering(compiled), name)
    _CHECKED.add(key)


def _asm(t: torch.Tensor) -> bool:
    return t.is_cuda and not _interpreting()


def _join_b(t: torch.Tensor) -> bool:
    """GEMM operand B through a join (the decode's kWidth) where tl.dot is mma.sync, i.e. on
    any CUDA GPU but Hopper, whose wgmma reads B from shared memory in canonical order."""
    return t.is_cuda and not _interpreting() and not _expects_wgmma(
        torch.cuda.get_device_capability(t.device))


def _gemm_tma(t: torch.Tensor) -> bool:
    """The GEMM's operands through TMA (GEMM_TMA): on Hopper, whose wgmma reads them from
    shared memory as TMA leaves them, and in the interpreter (the CPU tests)."""
    return GEMM_TMA and (_interpreting() or (t.is_cuda and _expects_wgmma(
        torch.cuda.get_device_capability(t.device))))


def dot_order(cap: tuple[int, int]) -> str:
    """How this Triton lowers the EXL3 kernels' tl.dot on a GPU of capability `cap`: the fused
    kernel compiled in its one-row decode form, not launched (Triton keeps the compile in its
    cache). On Hopper it is wgmma by rule (`_record_dot_order` refuses anything else) unless
    DISABLE_MMA_V3 tells Triton otherwise."""
    return _dot_order(cap, mma_v3_disabled())


@functools.lru_cache(maxsize=None)
def _dot_order(cap: tuple[int, int], mma_v3_off: bool) -> str:
    if cap[0] == 9 and not mma_v3_off:
        return "wgmma"
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    pointers = {"x_ptr": "*fp16", "tr_ptr": "*i32", "part_ptr": "*fp32", "rows_ptr": "*fp16",
                "texp_ptr": "*fp16", "cnt_ptr": "*i32", "svh_ptr": "*fp16",
                "bias_ptr": "*fp32", "out_ptr": "*fp32", "inv": "fp32"}
    constexprs = dict(K2=5, CB=CODEBOOK_IDS["mul1"], ASM=True, GROUPED=False, FUSE_OUT=True,
                      HAS_BIAS=False, SPLIT_LOOP=False, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
                      FR=FINISH_ROWS, PDL=False)
    signature = {name: "constexpr" if name in constexprs else pointers.get(name, "i32")
                 for name in _fused_kernel.arg_names}
    compiled = triton.compile(
        ASTSource(fn=_fused_kernel, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", 10 * cap[0] + cap[1], 32),
        options=dict(num_warps=NUM_WARPS, num_stages=1, enable_fp_fusion=False,
                     maxnreg=FUSED_MAX_REGISTERS))
    return dot_lowering(compiled)


_MMA_ORDER: dict = {}  # device index → cuda_order_reason's answer


def cuda_order_reason(index: int) -> str | None:
    """None where the CUDA kernel (exl3_mma) gives this GPU's Triton EXL3 kernels' bits, else
    why not. Its products run k16 step after k16 step, each step's products in an MMA in
    natural order: the order of wgmma (Hopper: the GPU suite's bit tests) and of mma.sync with
    kWidth 2. Elsewhere this Triton must lower tl.dot to the latter (Triton 3.8 and 3.9 do on
    sm_80 … sm_120; 3.6 gives kWidth 4), and a probe linear run both ways must agree bit for
    bit on this GPU (once; not inside a CUDA graph capture, where the Triton kernels run
    until it has been made)."""
    known = _MMA_ORDER.get(index, ...)
    if known is not ...:
        return known
    cap = torch.cuda.get_device_capability(index)
    if _expects_wgmma(cap):
        reason = None
    else:
        try:
            order = dot_order(cap)
        except Exception as e:  # (this Triton cannot tell here: the Triton kernels run)
            order = f"an unknown order ({type(e).__name__}: {e})".splitlines()[0][:200]
        else:
            _record_dot_order(cap, order, "exl3 fused kernel (dot_order)")
        if order != "mma.sync kWidth 2":
            reason = (f"this Triton lowers the EXL3 kernels' tl.dot to {order} on sm_{cap[0]}"
                      f"{cap[1]} (the CUDA kernel's order is mma.sync kWidth 2's)")
        elif torch.cuda.is_current_stream_capturing():
            return "its probe against the Triton kernels is not run inside a graph capture"
        else:
            try:
                reason = _probe_reason(index)
            except RuntimeError as e:  # (a launch the driver refused: the Triton kernels run)
                reason = f"its probe failed ({e})".splitlines()[0][:300]
    _MMA_ORDER[index] = reason
    return reason


def _probe_reason(index: int) -> str | None:
    """One linear (1,024 → 256 at K 2.5, MUL1; several splits) of 1 and 6 rows on the CUDA
    kernel and on the Triton fused kernel: None where every output bit agrees."""
    dev = torch.device("cuda", index)
    g = torch.Generator().manual_seed(0)
    k, n, K2 = 1024, 256, 5
    trellis = torch.randint(-2 ** 15, 2 ** 15, (k // 16, n // 16, 8 * K2), generator=g,
                            dtype=torch.int32).to(torch.int16).to(dev)
    suh = (torch.randn(k, generator=g) * k ** -0.5).half().to(dev)
    svh = (torch.randn(n, generator=g) * 0.05).half().to(dev)
    x = torch.randn(6, k, generator=g).to(dev, torch.bfloat16)
    per, S = split_schedule(k, n)
    cb = CODEBOOK_IDS["mul1"]
    for M in (1, 6):
        why = exl3_mma.why_not(x[:M], K2, cb, n, torch.float32, None, trellis, S)
        if why is not None:
            return why
        got, want = (torch.empty((M, n), dtype=torch.float32, device=dev) for _ in range(2))
        _mma_linear(x[:M], trellis, suh, svh, cb, K2, per, S, None, got)
        _fused(rotate_in(x[:M], suh), trellis, "mul1", svh, None, want)
        if not torch.equal(got.view(torch.int32), want.view(torch.int32)):
            return (f"the CUDA kernel's bits differ from the Triton kernels' on this GPU "
                    f"(probe linear, {M} rows)")
    return None


def _mma_why_not(x: torch.Tensor, *args, **kwargs) -> str | None:
    """None where the CUDA kernel runs this call (exl3_mma.why_not's arguments) with the Triton
    kernels' bits: cuda_order_reason, then exl3_mma.why_not."""
    return (x.is_cuda and cuda_order_reason(x.device.index)) or exl3_mma.why_not(x, *args,
                                                                               **kwargs)


def _words(trellis: torch.Tensor) -> torch.Tensor:
    """The trellis as little-endian u32 pairs (int32 view), contiguous."""
    t = trellis if trellis.is_contiguous() else trellis.contiguous()
    return t.view(torch.int32)


def _pdl(device: torch.device) -> dict:
    """The launch option of a fused kernel that directly follows its rotate_in: early launch
    where it exists (compiled Triton with GDC and its launch option, CUDA, Hopper or later)."""
    return _early.launch(device, on=PDL)


def _rotate_launch(device: torch.device) -> dict:
    """rotate_in's PDL constexpr and launch option. It is launched early like the step's other
    small kernels (strata.kernels.pdl: it waits first) and lets the matmul after it start
    early (PDL above); gdc_wait in a kernel not launched early returns at once."""
    early = _early.launch(device)
    return {"PDL": bool(early or _pdl(device)), **early}


def _regs(t: torch.Tensor) -> dict:
    """The fused kernel's register cap as a launch option (compiled launches only)."""
    return {"maxnreg": FUSED_MAX_REGISTERS} if FUSED_MAX_REGISTERS and _asm(t) else {}


def _contig_rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _rope_args(rope: "InverseRope | None", x: torch.Tensor, rows: int,
               tok_per: int) -> tuple[tuple, dict]:
    """_rotate_in_kernel's RoPE arguments: none, or those of `rope` — x's rows rotated back
    before the rotation, a cos/sin row per tok_per of its `rows` rows."""
    if rope is None:
        return (x, x, 0, 1, 1, 0, 0.0), {"ROPE": False, "ROPE_DT": tl.float32}
    cos, sin = rope.cos.float().contiguous(), rope.sin.float().contiguous()
    rd2, hd, k_in = cos.shape[-1], rope.head_dim, x.shape[-1]
    if (cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] != -(-rows // tok_per)
            or k_in % hd or not 0 < 2 * rd2 <= hd or rope.dtype not in _TL_DTYPES):
        raise ValueError(f"exl3 rotate_in: an inverse RoPE of cos {list(cos.shape)} / sin "
                         f"{list(sin.shape)}, heads of {hd} and {rope.dtype} does not fit "
                         f"{rows} rows (a cos row per {tok_per}) of {k_in} channels")
    return ((cos, sin, cos.stride(0), tok_per, hd, hd - 2 * rd2, -1.0),
            {"ROPE": True, "ROPE_DT": _TL_DTYPES[rope.dtype]})


def rotate_in(x: torch.Tensor, suh: torch.Tensor, fragment_order: bool = False,
              rope: "InverseRope | None" = None) -> torch.Tensor:
    """x [M, k_in] (any float dtype, k_in ≤ k_p) → x' = H128(fp16(x·suh)) [M, k_p] fp16, each
    128-block in exl3_mma's fragment order if asked (the CUDA decode kernel's input); with
    `rope` (strata.model.rope.InverseRope, cos/sin rows per x row), x is first rope.apply(x)
    — the same bits, in this launch."""
    _require_triton()
    x = _contig_rows(x)
    M, k_in = x.shape
    kp = suh.numel()
    out = torch.empty((M, kp), dtype=torch.float16, device=x.device)
    if M == 0:
        return out
    rope_args, rope_kw = _rope_args(rope, x, M, 1)
    grid = (triton.cdiv(M, ROT_ROWS), kp // 128, 1)
    _rotate_in_kernel[grid](x, suh, out, x, M, 1, k_in, x.stride(0), 0, 0, 0, kp, INV_SQRT128,
                            x, x, 0, 0.0, *rope_args, HAS_EIDX=False, BR=ROT_ROWS,
                            FRAG=fragment_order, SWIGLU=False, **rope_kw, num_warps=4,
                            enable_fp_fusion=False, **_rotate_launch(x.device))
    return out


def rotate_out(part: torch.Tensor, svh: torch.Tensor, bias: torch.Tensor | None = None,
               out_features: int | None = None,
               out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """part [S, M, n_p] fp32 split partials → H128(Σ_s part)·svh (+ bias) [M, out_features]."""
    _require_triton()
    S, M, n_p = part.shape
    n_out = n_p if out_features is None else out_features
    out = torch.empty((M, n_out), dtype=out_dtype, device=part.device)
    if M == 0 or n_out == 0:
        return out
    grid = (triton.cdiv(M, ROT_ROWS), triton.cdiv(n_out, 128), 1)
    _rotate_out_kernel[grid](part, svh, bias if bias is not None else svh, out, part,
                             M, S, n_out, 0, part.stride(0), part.stride(1), 0, 0, 0,
                             out.stride(0), INV_SQRT128, HAS_BIAS=bias is not None,
                             HAS_EIDX=False, BR=ROT_ROWS, num_warps=4, enable_fp_fusion=False)
    return out


def reconstruct(trellis: torch.Tensor, codebook: str, n_start: int = 0,
                n_cols: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Ŵ[:, n_start : n_start + n_cols] fp16 from a trellis [kt, nt, 16·K], bit-identical to
    strata.quant.exl3.decode_trellis (n_start, n_cols multiples of 64)."""
    _require_triton()
    kt, nt, K2 = _check_shapes(trellis, codebook)
    n_cols = 16 * nt - n_start if n_cols is None else n_cols
    if n_start % BLOCK_N or n_cols % BLOCK_N or n_start + n_cols > 16 * nt:
        raise ValueError(f"reconstruct: columns [{n_start}, +{n_cols}) not 64-aligned in "
                         f"{16 * nt}")
    if out is None:
        out = torch.empty((16 * kt, n_cols), dtype=torch.float16, device=trellis.device)
    if n_cols == 0:
        return out
    words = _words(trellis)
    grid = ((16 * kt) // BLOCK_K, n_cols // BLOCK_N)
    _reconstruct_kernel[grid](words, out, nt * 4 * K2, out.stride(0), n_start // BLOCK_N,
                              K2=K2, CB=CODEBOOK_IDS[codebook], ASM=_asm(trellis),
                              BN=BLOCK_N, BK=BLOCK_K, num_warps=NUM_WARPS, num_stages=1)
    return out


_COUNTERS: dict = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for FUSE_OUT launches, one buffer per device and lane
    (strata.streams: a piece on the side stream runs beside the current stream's); every
    launch leaves them at zero again. A first eager call (CUDA-graph warm-up) allocates them
    before a capture, which then reuses them — and holds them (a larger buffer may replace
    them here while the graph lives)."""
    key = (str(device), streams.on_side(device))
    c = _COUNTERS.get(key)
    if c is None or c.numel() < n:
        c = torch.zeros(max(n, 4096, 0 if c is None else 2 * c.numel()), dtype=torch.int32,
                        device=device)
        _COUNTERS[key] = c
    hold(c)
    return c


def _fused(xr: torch.Tensor, trellis: torch.Tensor, codebook: str, svh=None, bias=None,
           out: torch.Tensor | None = None, sched_cols: int | None = None,
           after_rotate: bool = False, target_programs: int | None = None) -> torch.Tensor:
    """The fused kernel for x' [M, k_p]: split partials [S, M, n_p] (out None), or the finished
    linear written into out [M, n_out] (svh, bias) by the last program of each column block.
    `after_rotate`: xr's rotate_in is the last kernel launched before this one (early launch)."""
    kt, nt, K2 = _check_shapes(trellis, codebook)
    M = xr.shape[0]
    kp, n_p = 16 * kt, 16 * nt
    per, S = split_schedule(kp, sched_cols or n_p, target_programs)
    part = torch.empty((S, M, n_p), dtype=torch.float32, device=xr.device)
    if M == 0:
        return part if out is None else out
    grid = (n_p // BLOCK_N, S, triton.cdiv(M, BLOCK_M))
    words = _words(trellis)
    fuse = out is not None
    cnt = _counters(xr.device, grid[2] * (grid[0] // 2)) if fuse else part
    pdl = _pdl(xr.device) if after_rotate else {}
    c = _fused_kernel[grid](
        xr, words, part, xr, xr, M, 1, kp // BLOCK_K, per, nt * 4 * K2,
        xr.stride(0), 0, 0, 0, 0, part.stride(0), part.stride(1),
        cnt, svh if fuse else part, bias if bias is not None else part, out if fuse else part,
        out.shape[1] if fuse else 0, 0, 0, 0, out.stride(0) if fuse else 0, INV_SQRT128,
        K2=K2, CB=CODEBOOK_IDS[codebook], ASM=_asm(xr), GROUPED=False, FUSE_OUT=fuse,
        HAS_BIAS=bias is not None, SPLIT_LOOP=False, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
        FR=FINISH_ROWS, PDL=bool(pdl), num_warps=NUM_WARPS, num_stages=1,
        enable_fp_fusion=False, **pdl, **_regs(xr))
    _check_dot_order(c, "exl3 fused kernel", xr.device)
    return out if fuse else part


def _gemm_partials(xr: torch.Tensor, trellis: torch.Tensor, codebook: str,
                   sched_cols: int | None = None,
                   target_programs: int | None = None) -> torch.Tensor:
    """Reconstruct Ŵ in column slices (≤ GEMM_SLICE_BYTES) and run the fixed-order GEMM; the
    result is the combined y' as one 'split' [1, M, n_p]."""
    kt, nt, K2 = _check_shapes(trellis, codebook)
    M = xr.shape[0]
    kp, n_p = 16 * kt, 16 * nt
    per, _ = split_schedule(kp, sched_cols or n_p, target_programs)
    y = torch.empty((1, M, n_p), dtype=torch.float32, device=xr.device)
    if M == 0:
        return y
    slice_n = max(GEMM_BLOCK_N, (GEMM_SLICE_BYTES // (2 * kp)) // GEMM_BLOCK_N * GEMM_BLOCK_N)
    slice_n = min(slice_n, n_p)
    buf = torch.empty((kp, slice_n), dtype=torch.float16, device=xr.device)
    tma = _gemm_tma(xr)
    xd = TensorDescriptor.from_tensor(xr, [GEMM_BLOCK_M, BLOCK_K]) if tma else xr
    for n0 in range(0, n_p, slice_n):
        ns = min(slice_n, n_p - n0)
        w = reconstruct(trellis, codebook, n0, ns, out=buf[:, :ns])
        yv = y[0, :, n0:n0 + ns]
        grid = (triton.cdiv(M, GEMM_BLOCK_M), ns // GEMM_BLOCK_N)
        wd = TensorDescriptor.from_tensor(w, [BLOCK_K, GEMM_BLOCK_N]) if tma else w
        c = _gemm_kernel[grid](xr, w, xd, wd, yv, M, kp // BLOCK_K, per, xr.stride(0),
                               w.stride(0), yv.stride(0), BM=GEMM_BLOCK_M, BN=GEMM_BLOCK_N,
                               BK=BLOCK_K, JOIN_B=_join_b(xr), TMA=tma,
                               num_warps=GEMM_NUM_WARPS, num_stages=GEMM_NUM_STAGES)
        _check_dot_order(c, "exl3 gemm kernel", xr.device)
    return y


def exl3_partials(xr: torch.Tensor, trellis: torch.Tensor, codebook: str,
                  path: str = "auto", sched_cols: int | None = None,
                  target_programs: int | None = None) -> torch.Tensor:
    """Split partials of y' = x'·Ŵ: [S, M, n_p] fp32 (fused) or [1, M, n_p] (GEMM path, already
    summed in the same order). `rotate_out` finishes either identically. The split schedule
    (split_schedule) is the weight's: `sched_cols` the column count it is computed for (a
    column slice of a weight keeps the whole weight's, so its columns sum in the same order:
    tensor parallelism), `target_programs` its target (GROUPED_TARGET_PROGRAMS for a weight
    that also runs grouped)."""
    _require_triton()
    if xr.dtype != torch.float16 or xr.dim() != 2:
        raise ValueError(f"x' must be fp16 [M, k_p], got {xr.dtype} {list(xr.shape)}")
    xr = _contig_rows(xr)
    if xr.shape[1] != 16 * trellis.shape[-3]:
        raise ValueError(f"x' width {xr.shape[1]} ≠ k_p {16 * trellis.shape[-3]}")
    if path == "auto":
        path = "fused" if xr.shape[0] <= FUSED_MAX_ROWS else "gemm"
    if path == "fused":
        return _fused(xr, trellis, codebook, sched_cols=sched_cols,
                      target_programs=target_programs)
    if path == "gemm":
        return _gemm_partials(xr, trellis, codebook, sched_cols, target_programs)
    raise ValueError(f"path {path!r}: expected auto, fused or gemm")


def sum_partials(part: torch.Tensor) -> torch.Tensor:
    """Σ_s part[s] from zero in ascending s (the order rotate_out uses)."""
    y = torch.zeros_like(part[0])
    for s in range(part.shape[0]):
        y = y + part[s]
    return y


def exl3_matmul(xr: torch.Tensor, trellis: torch.Tensor, codebook: str,
                path: str = "auto") -> torch.Tensor:
    """y' = x'·Ŵ [M, n_p] fp32 for x' [M, k_p] fp16 already rotated (batch-invariant rows;
    fused and GEMM paths bit-identical)."""
    return sum_partials(exl3_partials(xr, trellis, codebook, path))


def exl3_linear(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                codebook: str, out_features: int | None = None,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
                path: str = "auto", sched_cols: int | None = None,
                target_programs: int | None = None,
                rope: "InverseRope | None" = None) -> torch.Tensor:
    """The EXL3 linear y = x·W (+ bias) on the kernels: x [..., k_in] → [..., out_features]
    (`sched_cols`, `target_programs`: the weight's split schedule, see exl3_partials;
    `rope`: x's rows are rotated back first, in the input rotation — rotate_in).
    Fused path: rotate_in + the fused kernel finishing each column block (2 launches; the
    second the CUDA kernel of exl3_mma where it applies, with the same bits);
    GEMM path: rotate_in + reconstruct + GEMM + rotate_out. Same bits either way."""
    _require_triton()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    M = x2.shape[0]
    n_out = svh.numel() if out_features is None else out_features
    if path == "auto":
        path = "fused" if M <= FUSED_MAX_ROWS else "gemm"
    if path == "fused":
        kt, nt, K2 = _check_shapes(trellis, codebook)
        y = torch.empty((M, n_out), dtype=out_dtype, device=x.device)
        # (any copy before the rotation: the early-launched kernel reads the trellis before it
        # waits, so nothing between the two launches may write what it reads)
        svh = _contig_rows(svh)
        trellis = trellis if trellis.is_contiguous() else trellis.contiguous()
        cb = CODEBOOK_IDS[codebook]
        per, S = split_schedule(16 * kt, sched_cols or 16 * nt, target_programs)
        if _mma_why_not(x2, K2, cb, 16 * nt, out_dtype, bias, trellis, S) is None:  # same bits
            _mma_linear(x2, trellis, suh, svh, cb, K2, per, S, bias, y, rope)
        else:
            xr = rotate_in(x2, suh, rope=rope)
            _fused(xr, trellis, codebook, svh, bias, y, sched_cols, after_rotate=True,
                   target_programs=target_programs)
    else:
        part = exl3_partials(rotate_in(x2, suh, rope=rope), trellis, codebook, path,
                             sched_cols, target_programs)
        y = rotate_out(part, svh, bias, n_out, out_dtype)
    return y.reshape(*lead, n_out)


def _mma_linear(x2: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                cb: int, K2: int, per: int, S: int, bias: torch.Tensor | None,
                y: torch.Tensor, rope: "InverseRope | None" = None) -> None:
    """exl3_linear's fused path on the CUDA kernel into y [M, n_out] (the caller asked
    _mma_why_not): rotate_in in fragment order, then exl3_mma.linear, launched early after it."""
    M, n_p = x2.shape[0], 16 * trellis.shape[1]
    part = torch.empty((S, M, n_p), dtype=torch.float32, device=x2.device)
    words, cnt = _words(trellis), _counters(x2.device, n_p // 128)
    xr = rotate_in(x2, suh, fragment_order=True, rope=rope)
    exl3_mma.linear(xr, words, svh, cb, K2, y, part, cnt, per, bias, INV_SQRT128,
                    early=bool(_pdl(x2.device)))


# ------------------------------------------------------- linears of one input (ragged sets)

@dataclass
class SetWeight:
    """One linear of an exl3_linear_set call: its stored tensors, output width and dtype,
    and its split schedule (exl3_linear's sched_cols / target_programs)."""
    trellis: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor
    out_features: int
    out_dtype: torch.dtype
    sched_cols: int | None = None
    target_programs: int | None = None


@dataclass
class _SetPlan:
    """What an exl3_linear_set call of M rows needs besides its input, made once (graph
    warm-ups make it before a capture): the table, buffer sizes and the outputs' places."""
    table: torch.Tensor                        # [W, SET_ROW] int64 on the device
    suh: torch.Tensor                          # set 0's suh, the others at ssuh_set
    ssuh_set: int
    keep: list                                 # the suh (and a stacked copy where needed)
    programs: int
    out_bytes: int
    views: list[tuple[int, torch.dtype, int]]  # per weight: byte offset, dtype, width
    part_floats: int
    counters: int


# Plans kept, the least recently used dropped first: a model's working set is its sets ×
# the row counts it runs (the full model's decode and verify windows: ~1,500); past it, an
# eager call rebuilds its plan (a table upload). A captured graph holds the plans it read.
# The limit must exceed one region's plans (a step: ~220 sets in the full model), so that a
# capture finds every plan its warm-up made: a capture that missed would take another path
# than its warm-up, whose lazily built state (quant/groups._fixed_routing) it would then
# make inside the capture (a cache cut to one plan faults the replay on the H200).
SET_PLANS_KEPT = 4096
_SET_PLANS: OrderedDict[tuple, _SetPlan | None] = OrderedDict()


def _set_plan(x2: torch.Tensor, weights: Sequence[SetWeight], codebook: str):
    """The plan of a ragged-set call, or None where the CUDA kernel does not run it (both
    remembered)."""
    M = x2.shape[0]
    key = (M, x2.device, codebook) + tuple(
        (w.trellis.data_ptr(), tuple(w.trellis.shape), w.suh.data_ptr(), w.svh.data_ptr(),
         w.out_features, w.out_dtype, w.sched_cols, w.target_programs) for w in weights)
    if key in _SET_PLANS:
        _SET_PLANS.move_to_end(key)
        plan = _SET_PLANS[key]
        if plan is not None:
            hold(plan)  # (its table's addresses go into a graph being captured)
        return plan
    if torch.cuda.is_current_stream_capturing():  # (the table's upload waits: not in a capture)
        return None
    while len(_SET_PLANS) >= SET_PLANS_KEPT:
        _SET_PLANS.popitem(last=False)
    plan = _SET_PLANS[key] = _make_set_plan(x2, weights, codebook)
    return plan


def _make_set_plan(x2: torch.Tensor, weights: Sequence[SetWeight], codebook: str):
    M = x2.shape[0]
    cb = CODEBOOK_IDS[codebook]
    kt, _, K2 = _check_shapes(weights[0].trellis, codebook)
    rows, views = [], []
    programs = out_bytes = part_floats = counters = 0
    for w in weights:
        wkt, nt, wK2 = _check_shapes(w.trellis, codebook)
        n_p = 16 * nt
        per, S = split_schedule(16 * kt, w.sched_cols or n_p, w.target_programs)
        if (wkt, wK2) != (kt, K2) or w.trellis.dim() != 3 or not w.trellis.is_contiguous() \
                or w.suh.shape != (16 * kt,) or w.svh.shape != (n_p,) \
                or w.out_features > n_p or not w.svh.is_contiguous() or _mma_why_not(
                    x2, K2, cb, n_p, w.out_dtype, None, w.trellis, S, ragged=True) is not None:
            return None
        cols = n_p // 64  # (4 warps a program: 64 columns)
        out_bytes = -(-out_bytes // 16) * 16
        rows.append(exl3_mma.set_row(programs, cols, S, per, nt * 4 * K2, w.out_features,
                                     w.out_dtype, w.trellis, w.svh, out_bytes, w.out_features,
                                     part_floats, n_p, M * n_p, counters))
        views.append((out_bytes, w.out_dtype, w.out_features))
        programs += cols * S
        out_bytes += M * w.out_features * w.out_dtype.itemsize
        part_floats += S * M * n_p
        counters += n_p // 128
    suhs = [w.suh for w in weights]
    # The weights' suh stay referenced by the plan: their addresses (in its key) cannot be
    # another tensor's while it lives, so a stacked copy of their values cannot go stale.
    keep = list(suhs)
    step = _set_stride(suhs, "suh") if all(t.is_contiguous() for t in suhs) else None
    if step is None:  # not evenly spaced: one stacked copy, kept with the plan
        keep.append(torch.stack(suhs))
        suhs, step = [keep[-1][0]], keep[-1].stride(0)
    table = torch.tensor(rows, dtype=torch.int64).to(x2.device)
    return _SetPlan(table, suhs[0], step, keep, programs, out_bytes, views, part_floats,
                    counters)


def exl3_linear_set(x: torch.Tensor, weights: Sequence[SetWeight],
                    codebook: str) -> list[torch.Tensor] | None:
    """Several EXL3 linears of one input x [..., k_in] — one k_p, K and codebook, any output
    widths and dtypes, no bias — in two launches on the CUDA decode kernel: one rotate_in
    with every weight's suh, one exl3_mma.linear_set. Each output [..., out_features] is bit
    for bit exl3_linear's for its weight (the same rotation, split schedule, k-steps and
    output step). None where that kernel does not run the call (cuda_order_reason, more
    than exl3_mma.MAX_ROWS rows, a weight it cannot read…): the caller runs each linear."""
    _require_triton()
    lead = x.shape[:-1]
    x2 = _contig_rows(x.reshape(-1, x.shape[-1]))
    M, k_in = x2.shape
    if not weights or M == 0 or M > exl3_mma.MAX_ROWS:
        return None
    plan = _set_plan(x2, weights, codebook)
    if plan is None:
        return None
    W, dev = len(weights), x.device
    kp = plan.suh.numel()
    xr = torch.empty((W, M, kp), dtype=torch.float16, device=dev)
    # (the set kernel's buffers before the rotation: it directly follows it, early)
    out = torch.empty(plan.out_bytes, dtype=torch.uint8, device=dev)
    part = torch.empty(plan.part_floats, dtype=torch.float32, device=dev)
    cnt = _counters(dev, plan.counters)
    rope_args, rope_kw = _rope_args(None, x2, M, 1)
    _rotate_in_kernel[(triton.cdiv(M, ROT_ROWS), kp // 128, W)](
        x2, plan.suh, xr, x2, M, 1, k_in, x2.stride(0), 0, plan.ssuh_set, xr.stride(0), kp,
        INV_SQRT128, x2, x2, 0, 0.0, *rope_args, HAS_EIDX=False, BR=ROT_ROWS, FRAG=True,
        SWIGLU=False, **rope_kw, num_warps=4, enable_fp_fusion=False, **_rotate_launch(dev))
    exl3_mma.linear_set(xr, plan.table, plan.programs, CODEBOOK_IDS[codebook],
                        k2_of(weights[0].trellis), out, part, cnt, kp // 128, INV_SQRT128,
                        early=bool(_pdl(dev)))
    return [out[o:o + M * n * dt.itemsize].view(dt).view(*lead, n)
            for o, dt, n in plan.views]


# -------------------------------------------------------------------- MoE (grouped by expert)

@dataclass
class _Sets:
    keep: list             # every set's tensors (kept alive through the launches)
    trellis: torch.Tensor  # set 0's [E, kt, nt, L] (int32 word view)
    str_set: int           # words from set 0's trellis to set w's (multiplied by w)
    suh: torch.Tensor
    ssuh_set: int
    svh: torch.Tensor
    ssvh_set: int


def _set_stride(ts: Sequence[torch.Tensor], what: str) -> int:
    """Element distance between consecutive stacks, which must be evenly spaced (a stacked
    [W, E, ...] tensor, or separate stacks addressed relative to the first)."""
    if len(ts) == 1:
        return 0
    es = ts[0].element_size()
    d = [(t.data_ptr() - ts[0].data_ptr()) for t in ts]
    if any(x % es for x in d):
        raise ValueError(f"{what}: stacks not aligned to their element size")
    step = d[1] // es
    if any(d[w] // es != w * step for w in range(len(ts))):
        return None  # not evenly spaced: caller copies
    return step


def _stack_sets(weights: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> _Sets:
    trs = [_words(w[0]) for w in weights]
    suhs = [_contig_rows(w[1]) for w in weights]
    svhs = [_contig_rows(w[2]) for w in weights]
    for group, name in ((trs, "trellis"), (suhs, "suh"), (svhs, "svh")):
        if any(t.shape != group[0].shape or t.dtype != group[0].dtype
               or t.device != group[0].device for t in group):
            raise ValueError(f"exl3_moe_linear: the weight sets' {name} differ in shape/dtype")
    strides = [_set_stride(g, n) for g, n in ((trs, "trellis"), (suhs, "suh"), (svhs, "svh"))]
    if any(s is None for s in strides):  # unevenly spaced: one stacked copy (each)
        trs = list(torch.stack(trs)) if strides[0] is None else trs
        suhs = list(torch.stack(suhs)) if strides[1] is None else suhs
        svhs = list(torch.stack(svhs)) if strides[2] is None else svhs
        strides = [_set_stride(g, n) for g, n in ((trs, "trellis"), (suhs, "suh"),
                                                  (svhs, "svh"))]
    return _Sets([trs, suhs, svhs], trs[0], strides[0], suhs[0], strides[1], svhs[0],
                 strides[2])


@dataclass(frozen=True)
class SwiGLU:
    """A down projection's input made where its rotation reads it (exl3_moe_linear's
    `swiglu`): x, the call's input, is the gate [T, k, I]; `up` the up projection, of x's
    shape and dtype; `weight` [T, k] each pair's routing weight. The rows multiplied are
    moe_ops.swiglu(x, up, limit, x.dtype, weight)'s — the same bits, without its launch
    and its [T, k, I] buffer."""
    up: torch.Tensor
    weight: torch.Tensor
    limit: float


def exl3_moe_linear(x: torch.Tensor, idx: torch.Tensor,
                    weights: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                    codebook: str, out_features: int | None = None,
                    out_dtype: torch.dtype = torch.float32,
                    routing: Routing | None = None,
                    target_programs: int | None = None,
                    swiglu: SwiGLU | None = None,
                    rope: "InverseRope | None" = None) -> list[torch.Tensor]:
    """EXL3 expert linears for a step's (token, slot) pairs, grouped by expert.

    Contract (for the MoE wiring, strata.model.moe):
    x: [T, k_in] (each token's input, shared by its k slots — w1/w3) or [T, k, k_in] (one input
       per pair — w2 after the activation and routing weight); any float dtype, k_in ≤ k_p
       (zero-extended).
    idx: [T, k] expert ids (int, on x's device).
    weights: W ≥ 1 weight sets of one shape/K/codebook, e.g. [w1, w3] for gate and up in one
       launch, [w2] for down; each set is (trellis [E, kt, nt, 16·K] int16 contiguous,
       suh [E, k_p] fp16, svh [E, n_p] fp16) — the layer's experts stacked once at load time.
       Sets are addressed relative to the first one's storage (pointer distance), so separate
       stacks cost nothing for W ≤ 2 (or evenly spaced ones, e.g. views of one [W, E, ...]
       tensor); otherwise they are stacked into one copy per call.
    codebook: '3inst' | 'mcg' | 'mul1' (shared by all sets; half-integer K needs mul1).
    out_features: trim the outputs to this width (default n_p).
    out_dtype: of the outputs (default fp32).
    routing: a strata.kernels.moe_grouping.Routing(idx, E) shared by a step's launches (each
       grouping made once, for the tile size the kernel that runs needs); made here when None.
    target_programs: the split schedule's target (split_schedule; default TARGET_PROGRAMS, a
       lone linear's); the same for a weight on every call, grouped or alone
       (GROUPED_TARGET_PROGRAMS for the routed experts and wo_a's groups).
    swiglu: x [T, k, I] is a gate, the input its SwiGLU with these (SwiGLU), computed in the
       rotation.
    rope: x's rows are rotated back first, in the rotation (strata.model.rope.InverseRope,
       cos/sin [T, ·]: a token's k pairs share its row) — wo_a's groups' attention output.
    Returns W tensors [T, k, out_features]: y[w][t, s] = x_t·W_{w, idx[t,s]} — no routing
    weight, activation or slot sum is applied here.

    Exactness: each pair's row is bit-identical to exl3_linear(x_t, trellis[e], suh[e], svh[e])
    for its expert e under the same split schedule (exl3_linear's target_programs; same
    rotations, k-steps, MMA shape and output step), whatever other pairs share its tile:
    batch-invariant, so decode, verify and prefill agree.
    Cost: two launches (the grouped Hadamard-in for all sets and pairs, then the grouped decode
    kernel, which also finishes the output Hadamard·svh); each selected expert's tiles are
    decoded once per tile of pairs routed to it, for every set: tiles of BLOCK_M (64) on the
    Triton kernel, where they apply (_mma_why_not: the same bits) of exl3_mma.MOE_TILE_M (8) on
    the CUDA kernel up to exl3_mma.MAX_PAIRS pairs and of exl3_mma.PREFILL_TILE_M (64) on its
    prefill kernel above. Everything stays on the
    device with static shapes (group_by_expert included), so the call can be captured in a
    CUDA graph.
    """
    _require_triton()
    W = len(weights)
    if W == 0:
        raise ValueError("exl3_moe_linear: no weight sets")
    tr0, suh0, svh0 = weights[0]
    if tr0.dim() != 4 or suh0.dim() != 2 or svh0.dim() != 2:
        raise ValueError("exl3_moe_linear: expected trellis [E, kt, nt, L], suh [E, k_p], "
                         "svh [E, n_p]")
    E = tr0.shape[0]
    kt, nt, K2 = _check_shapes(tr0, codebook)
    kp, n_p = 16 * kt, 16 * nt
    if suh0.shape != (E, kp) or svh0.shape != (E, n_p):
        raise ValueError(f"exl3_moe_linear: suh {list(suh0.shape)} / svh {list(svh0.shape)} "
                         f"do not match trellis {list(tr0.shape)}")
    T, k = idx.shape
    if x.shape[0] != T or (x.dim() == 3 and x.shape[1] != k) or x.dim() not in (2, 3):
        raise ValueError(f"exl3_moe_linear: x {list(x.shape)} does not match idx {[T, k]}")
    if swiglu is not None and (x.dim() != 3 or swiglu.up.shape != x.shape
                               or swiglu.up.dtype != x.dtype
                               or tuple(swiglu.weight.shape) != (T, k)):
        raise ValueError(f"exl3_moe_linear: a SwiGLU input needs the gate [T, k, I] and an up "
                         f"projection of its shape and dtype, weights [T, k]: gate "
                         f"{list(x.shape)} {x.dtype}, up {list(swiglu.up.shape)} "
                         f"{swiglu.up.dtype}, weights {list(swiglu.weight.shape)}")
    n_out = n_p if out_features is None else out_features
    chunk = max(1, MOE_MAX_PAIRS // max(k, 1))
    if T > chunk:  # bounded buffers; rows are batch-invariant, so chunking changes no bit
        parts = [exl3_moe_linear(x[t:t + chunk], idx[t:t + chunk], weights, codebook,
                                 out_features, out_dtype, target_programs=target_programs,
                                 swiglu=None if swiglu is None else SwiGLU(
                                     swiglu.up[t:t + chunk], swiglu.weight[t:t + chunk],
                                     swiglu.limit),
                                 rope=None if rope is None else replace(
                                     rope, cos=rope.cos[t:t + chunk],
                                     sin=rope.sin[t:t + chunk]))
                 for t in range(0, T, chunk)]
        return [torch.cat([p[w] for p in parts]) for w in range(W)]
    P = T * k
    dev = x.device
    if P == 0:
        return [torch.empty((T, k, n_out), dtype=out_dtype, device=dev) for _ in range(W)]
    cb = CODEBOOK_IDS[codebook]
    sets = _stack_sets(weights)
    per, S = split_schedule(kp, n_p, target_programs)
    mma = _mma_why_not(x, K2, cb, n_p, out_dtype, None, sets.trellis, S, pairs=P,
                       str_set=sets.str_set) is None
    mma_prefill = (not mma and P > exl3_mma.MAX_PAIRS
                   and _mma_why_not(x, K2, cb, n_p, out_dtype, None, sets.trellis, S,
                                    pairs=P, str_set=sets.str_set, prefill=True) is None)
    split_loop = P > MOE_SPLIT_LOOP_PAIRS and not mma
    block_m = (exl3_mma.MOE_TILE_M if mma else exl3_mma.PREFILL_TILE_M if mma_prefill
               else MOE_LOOP_BLOCK_M if split_loop else BLOCK_M)
    if routing is None:
        routing = Routing(idx, E)
    elif routing.idx.shape != idx.shape or routing.n_experts != E:
        raise ValueError(f"exl3_moe_linear: routing for ids {list(routing.idx.shape)} over "
                         f"{routing.n_experts} experts, called with {[T, k]} over {E}")
    groups = routing.groups(block_m)
    eidx = idx.reshape(-1)  # (int64 or int32 ids, read as they are: no cast launch)
    if eidx.dtype not in (torch.int32, torch.int64):
        eidx = eidx.to(torch.int32)
    if x.dim() == 2:  # one x row per token, read by its k pairs
        xin, x_per = _contig_rows(x), k
    else:
        xin, x_per = _contig_rows(x.reshape(P, x.shape[-1])), 1
    k_in = xin.shape[1]
    up = rw = xin
    if swiglu is not None:  # (x is [T, k, I]: one row per pair, as xin)
        up = _contig_rows(swiglu.up.reshape(P, k_in))
        rw = swiglu.weight.reshape(-1).float().contiguous()
    rope_args, rope_kw = _rope_args(rope, xin, P, k)
    # 1. x' per (set, pair) with the pair's expert's suh
    xr = torch.empty((W, P, kp), dtype=torch.float16, device=dev)
    # 2.'s buffers first: the grouped kernel directly follows this one (early launch)
    part = (None if mma_prefill else
            torch.empty((W, 1 if split_loop else S, P, n_p), dtype=torch.float32, device=dev))
    out = torch.empty((W, P, n_out), dtype=out_dtype, device=dev)
    n_tiles = groups.tile_expert.numel()
    grid = (n_p // BLOCK_N, 1 if split_loop else S, W * n_tiles)
    cnt = part if split_loop or mma_prefill else _counters(dev, grid[2] * (grid[0] // 2))
    pdl = _pdl(dev)
    _rotate_in_kernel[(triton.cdiv(P, ROT_ROWS), kp // 128, W)](
        xin, sets.suh, xr, eidx, P, x_per, k_in, xin.stride(0),
        sets.suh.stride(0), sets.ssuh_set, xr.stride(0), xr.stride(1), INV_SQRT128,
        up, rw, up.stride(0), 0.0 if swiglu is None else float(swiglu.limit), *rope_args,
        HAS_EIDX=True, BR=ROT_ROWS, FRAG=mma, SWIGLU=swiglu is not None, **rope_kw,
        num_warps=4, enable_fp_fusion=False, **_rotate_launch(dev))
    if mma:  # 2. the CUDA kernel over tiles of ≤ MOE_TILE_M pairs: decode's few pairs
        exl3_mma.moe(xr, sets.trellis, sets.str_set, sets.svh, sets.ssvh_set, cb, K2, out, part,
                     cnt, per, groups.tile_rows, groups.tile_expert, INV_SQRT128, bool(pdl))
        return [out[w].view(T, k, n_out) for w in range(W)]
    if mma_prefill:  # 2. the CUDA kernel over tiles of ≤ PREFILL_TILE_M pairs: many pairs
        exl3_mma.moe_prefill(xr, sets.trellis, sets.str_set, sets.svh, sets.ssvh_set, cb, K2,
                             out, per, groups.tile_rows, groups.tile_expert, INV_SQRT128,
                             bool(pdl))
        return [out[w].view(T, k, n_out) for w in range(W)]
    # 2. the grouped kernel over tiles of ≤ BLOCK_M pairs sharing an expert. Few pairs
    #    (decode): one program per split, the last of each (tile, 128 columns) finishing
    #    the block (Σ_s, output Hadamard, the pair's expert's svh) into out. Many pairs: each
    #    program runs its splits in order and writes y', then the grouped output step. Same
    #    bits.
    c = _fused_kernel[grid](
        xr, sets.trellis, part, groups.tile_rows, groups.tile_expert,
        P, n_tiles, kp // BLOCK_K, per, nt * 4 * K2,
        xr.stride(1), xr.stride(0), sets.trellis.stride(0), sets.str_set,
        part.stride(0), part.stride(1), part.stride(2),
        cnt, sets.svh, part, out, n_out, sets.svh.stride(0), sets.ssvh_set,
        out.stride(0), out.stride(1), INV_SQRT128,
        K2=K2, CB=cb, ASM=_asm(xr), GROUPED=True,
        FUSE_OUT=not split_loop, HAS_BIAS=False, SPLIT_LOOP=split_loop,
        BM=block_m, BN=BLOCK_N, BK=BLOCK_K, FR=FINISH_ROWS, PDL=bool(pdl),
        num_warps=NUM_WARPS * block_m // BLOCK_M, num_stages=1, enable_fp_fusion=False,
        **pdl, **_regs(xr))
    _check_dot_order(c, "exl3 grouped kernel", x.device)
    if split_loop:
        _rotate_out_kernel[(triton.cdiv(P, ROT_ROWS), triton.cdiv(n_out, 128), W)](
            part, sets.svh, sets.svh, out, eidx, P, 1, n_out, part.stride(0), part.stride(1),
            part.stride(2), sets.svh.stride(0), sets.ssvh_set, out.stride(0), out.stride(1),
            INV_SQRT128, HAS_BIAS=False, HAS_EIDX=True, BR=ROT_ROWS, num_warps=4,
            enable_fp_fusion=False)
    return [out[w].view(T, k, n_out) for w in range(W)]
