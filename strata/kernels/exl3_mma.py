"""The EXL3 decode matmul as a CUDA kernel compiled at run time with NVRTC (exl3_mma.cu).

Triton gives no control of the tensor cores' operand registers: its fused kernel decodes a
tile per thread and moves it to the MMA layout through shared memory. The trellis layout is
made for MMA fragments — lane l of an m16n8k16 MMA holds exactly ring positions 8l … 8l + 7 of
a tile as its A fragment of Ŵᵀ — so this kernel computes y'ᵀ = Ŵᵀ·x'ᵀ with each lane decoding
its window straight into registers and 8 rows of x' as the MMA's n8, and finishes each
128-column block in the last program to arrive, like the Triton kernel. It follows
exl3.rotate_in and is launched early after it (programmatic dependent launch, through the
driver's cuLaunchKernelEx), as the Triton fused kernel is. `linear` serves exl3_linear, `moe`
exl3_moe_linear (rows: tiles of MOE_TILE_M pairs sharing an expert, for W weight sets) up to
MAX_PAIRS pairs, `moe_prefill` (a second kernel of the same source, exl3_mma_prefill) above:
tiles of PREFILL_TILE_M pairs whose x' rows are staged in shared memory for all of a
program's warps, each program running every split of its 128-column block and finishing it;
`linear_set` exl3_linear_set (a ragged set: weights of one input with their own widths,
splits and output dtypes in one 1-D grid, found through a table of per-weight rows).
The decode is integer work on the SM's ALU pipe (shifts, masks, byte permutes), which bounds
it: the k-loop is written for few such instructions (the compiled grouped loop: 341–405 per
k-step at K = 2–4, from 373–405 in session 34 and 598–614 in session 11;
bench/results/kernels.md records what each version measured).

Bits: identical to strata.kernels.exl3's kernels where their tl.dot runs each k16 step's
products in natural order (same split schedule, ascending k16 MMA chain per split — what
wgmma computes, and mma.sync with kWidth 2 — same Hadamard butterflies, no fused
multiply-add: `--fmad=false`); GPU tests compare them on Hopper, linear and grouped (the
transposed product included: the same products summed in the same k order), and elsewhere a
probe linear compares them once (exl3.cuda_order_reason). Used only where that holds and the
kernel applies (`why_not` is None): compute capability ≥ 8.0 (griddepcontrol only from 9.0,
where kernels launch early), M ≤ 16 rows (or ≤ MAX_PAIRS grouped pairs; any number for the
prefill kernel, whose shared memory the GPU must allow a block: up to K 3 on a 99 KiB part
such as sm_120), K ≤ 6, a 128-aligned output; everything else stays on the Triton kernels.
Compiled by torch's NVRTC helpers (those of `torch.cuda._compile_kernel`, torch ≥ 2.8): no
build step and no extra dependency; each variant's cubin is kept on disk for later processes
(`_compile`).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import warnings
from pathlib import Path

import torch

from strata.kernels import pdl

# False: every EXL3 linear on the Triton kernels (A/B measurements; STRATA_EXL3_MMA=0 in the
# environment does it in every process, ranks of a parallel run included).
ENABLED = os.environ.get("STRATA_EXL3_MMA", "1") != "0"
MAX_ROWS = 16  # two n8 groups of rows
# exl3_moe_linear: up to MAX_PAIRS (token, slot) pairs (decode steps and verify windows) in
# row tiles of MOE_TILE_M pairs sharing an expert (a decode window routes ≤ 6 to one expert)
MAX_PAIRS = 64
MOE_TILE_M = 8
# exl3_moe_linear above MAX_PAIRS: tiles of this many pairs (8 · the prefill kernel's RG; a
# 4,096-token chunk gives each of 384 experts ~64). Session 16: tiles of 32 slower (each
# expert decoded twice as often), of 96 and 128 no faster (one program an SM)
PREFILL_TILE_M = 64
PREFILL_MIN_BLOCKS = 2  # programs (of 8 warps) an SM must hold: registers ≤ 65536 / (256 · this)
# The prefill kernel's products on wgmma (sm_90a only, x' read from shared memory by the tensor
# cores) instead of mma.sync: session 40, H100, 32K prefill +5 % over mma.sync, same bits.
# STRATA_EXL3_WGMMA=0 keeps mma.sync on Hopper too
PREFILL_WGMMA = os.environ.get("STRATA_EXL3_WGMMA", "1") == "1"
# With wgmma: tiles decoded before their wgmmas are issued (1, 2 or 4). At 1 a warp waits for
# each wgmma before decoding the next tile; at 2 two decodes interleave. Session 45, H100: the
# MoE kernels of a 32K prefill −2.7 % (probe: gate + up −3.7 %, down −11.7 %), same bits; 4 no
# faster at tiles of 128 and spills at 64
PREFILL_WG_DEPTH = 2
_SOURCE = Path(__file__).with_name("exl3_mma.cu")
_OT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _compiler():
    return getattr(torch.cuda, "_compile_kernel", None)


@functools.lru_cache(maxsize=None)
def _device_limits(index: int | None) -> tuple[tuple[int, int], int]:
    """(compute capability, dynamic shared memory a block may opt in to, bytes)."""
    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), props.shared_memory_per_block_optin


def device_reason(cap: tuple[int, int], shared_max: int, K2: int, prefill: bool) -> str | None:
    """Why a GPU of capability `cap` allowing `shared_max` bytes of shared memory a block cannot
    run the kernel (the prefill one where asked) at K2, or None."""
    if cap < (8, 0):
        return f"compute capability {cap[0]}.{cap[1]} (mma.sync m16n8k16 and cp.async need 8.0)"
    if prefill and prefill_shared(K2) > shared_max:
        return (f"the prefill kernel needs {prefill_shared(K2)} bytes of shared memory a block "
                f"at K {K2 / 2:g}; this GPU allows {shared_max}")
    return None


def prefill_shared(K2: int, WG: int = 0) -> int:
    """exl3_mma_prefill's dynamic shared memory: three x' stages (TM rows × 256 B), the 8
    warps' three trellis stages (8 tiles of 16·K2 bytes), y' (TM rows of 132 fp32); with
    wgmma 1,024 bytes to align the stages."""
    return 3 * PREFILL_TILE_M * 256 + 8 * 3 * 8 * 16 * K2 + PREFILL_TILE_M * 132 * 4 + 1024 * WG


def fragment_order(xr: torch.Tensor) -> torch.Tensor:
    """x' [..., k_p] (natural order) as the decode kernel reads it: within each 128-block,
    column 16i + 8h + 2t + j (k16 step i, its half h, lane t's pair, element j) moves to
    32t + 4i + 2h + j, so lane t's B fragments of a k-step are 64 contiguous bytes (four
    16-byte loads). exl3.rotate_in(…, fragment_order=True) writes this directly."""
    c = torch.arange(128)
    dest = 32 * ((c % 8) // 2) + 4 * (c // 16) + 2 * ((c % 16) // 8) + c % 2
    blocks = xr.reshape(*xr.shape[:-1], -1, 128)
    out = torch.empty_like(blocks)
    out[..., dest.to(xr.device)] = blocks
    return out.reshape(xr.shape)


def why_not(x: torch.Tensor, K2: int, codebook_id: int, n_p: int, out_dtype: torch.dtype,
            bias: torch.Tensor | None, trellis: torch.Tensor, S: int,
            pairs: int | None = None, str_set: int = 0, prefill: bool = False,
            ragged: bool = False) -> str | None:
    """None where the kernel can run this call here, else the reason it cannot (a failed
    NVRTC compile included: the Triton kernels then run). Whether it gives the Triton kernels'
    bits on this GPU is exl3.cuda_order_reason's question, asked first by exl3. x: the input,
    [M, k_in] for exl3_linear; trellis: the (contiguous) trellis it reads, whose tiles it copies
    in 16-byte chunks; S: the weight's number of splits (exl3.split_schedule); `pairs`: the
    (token, slot) pairs of an exl3_moe_linear call (grouped into tiles of MOE_TILE_M rows; x
    then only gives the device), str_set its words from one weight set's trellis to the
    next; prefill: for moe_prefill (tiles of PREFILL_TILE_M pairs, any number of them);
    ragged: for one weight of a `linear_set` call (the compiled variant serves every output
    dtype)."""
    rows_ok = (pairs is not None and pairs > 0 if prefill
               else 0 < pairs <= MAX_PAIRS if pairs is not None
               else x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS)
    # (a tile is 16·K2 bytes: 16-byte aligned wherever the tensor and its sets are)
    aligned = trellis.data_ptr() % 16 == 0 and str_set % 4 == 0
    checks = (
        (ENABLED, "switched off (exl3_mma.ENABLED)"),
        (rows_ok, "no pairs" if prefill else f"pairs not in 1…{MAX_PAIRS}"
         if pairs is not None else f"rows not in 1…{MAX_ROWS}"),
        (K2 <= 12, "K > 6"),
        (bias is None or not prefill, "a bias (the prefill kernel has none)"),
        (aligned, "trellis not 16-byte aligned"),
        (n_p % 128 == 0, "output not 128-aligned"),
        (out_dtype in _OT, f"output dtype {out_dtype}"),
        (bias is None or bias.dtype in _OT, "bias dtype"),
        (x.is_cuda, "not on CUDA"),
        (not pdl.interpreting(), "TRITON_INTERPRET is set"),
        (_compiler() is not None, "this torch has no torch.cuda._compile_kernel (NVRTC)"),
    )
    for ok, reason in checks:
        if not ok:
            return reason
    reason = device_reason(*_device_limits(x.device.index), K2, prefill)
    if reason is not None:
        return reason
    key = (_prefill_key(K2, codebook_id, out_dtype, x.device.index) if prefill else
           _key(K2, codebook_id, out_dtype, bias,
                MOE_TILE_M if pairs is not None else x.shape[0], pairs is not None, S,
                x.device.index, ragged))
    if key not in _KERNELS:
        try:
            with torch.cuda.device(x.device.index):
                _KERNELS[key] = _compile(
                    "exl3_mma_prefill" if prefill else "exl3_mma_linear",
                    _arch(key[11] if prefill else 0) or "".join(
                        map(str, _device_limits(x.device.index)[0])),
                    _options(*key[:-1]))
        except Exception as e:  # NVRTC missing or refusing: remembered, Triton runs instead
            _KERNELS[key] = f"NVRTC: {type(e).__name__}: {e}".splitlines()[0][:300]
            warnings.warn(f"strata: EXL3 CUDA kernel unavailable ({_KERNELS[key]}); "
                          "the Triton kernels run instead")
    k = _KERNELS[key]
    return k if isinstance(k, str) else None


# (K2, CB, OT, BT, R16, G, NW, PF, RG, MINB, RS[, WG, WD for the prefill kernel], device index)
# → compiled kernel or why not
_KERNELS: dict = {}


def _compile(name: str, arch: str, options: list[str], rtc=None):
    """Kernel `name` of exl3_mma.cu for sm_`arch` with `options`. NVRTC takes seconds a variant
    and every process (a server start, each rank) compiles the variants it uses, so the cubin
    is kept on disk (cubin_dir(), a file per variant keyed by the source, kernel, target,
    options and torch's CUDA): a later process loads it instead; an entry that does not load
    is compiled again, and a directory that cannot be written only costs the saving. `rtc`:
    torch's NVRTC helpers (torch.cuda._utils, as torch.cuda._compile_kernel uses them)."""
    if rtc is None:
        from torch.cuda import _utils as rtc
    source = _SOURCE.read_text()
    if not hasattr(rtc, "_nvrtc_compile") or not hasattr(rtc, "_cuda_load_module"):
        return _compiler()(source, name, compute_capability=arch, nvcc_options=options)
    path = cubin_dir() / f"{cubin_key(source, name, arch, options)}.cubin"
    entry = read_cubin(path)
    if entry is not None:
        try:
            return rtc._cuda_load_module(entry[1], [entry[0]])[entry[0]]
        except Exception:  # (stale or damaged: compiled again below)
            pass
    out = rtc._nvrtc_compile(source, name, compute_capability=arch, nvcc_options=options)
    cubin, mangled = out if isinstance(out, tuple) else (out, name)  # (torch < 2.9: no name)
    write_cubin(path, mangled, cubin)
    return rtc._cuda_load_module(cubin, [mangled])[mangled]


def cubin_dir() -> Path:
    """$STRATA_CACHE (else the XDG cache)/exl3_mma."""
    from strata.cache import cache_dir
    return cache_dir() / "exl3_mma"


def cubin_key(source: str, name: str, arch: str, options: list[str]) -> str:
    """What a compiled variant depends on, hashed: the source, the kernel, the target, the
    options, and torch (its NVRTC: torch.version.cuda)."""
    parts = [source, name, arch, *options, torch.__version__, str(torch.version.cuda)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:40]


def write_cubin(path: Path, name: str, cubin: bytes) -> None:
    """One file: the kernel's (mangled) name's length (4 bytes, little-endian), the name, the
    cubin (strata.cache.write_cache_file: whole or absent)."""
    from strata.cache import write_cache_file
    write_cache_file(path, len(name.encode()).to_bytes(4, "little") + name.encode() + cubin)


def read_cubin(path: Path) -> tuple[str, bytes] | None:
    """(name, cubin) of a write_cubin file, or None (absent, unreadable or malformed)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    n = int.from_bytes(data[:4], "little") if len(data) >= 4 else -1
    if not 0 < n < 1024 or len(data) <= 4 + n:
        return None
    try:
        return data[4:4 + n].decode(), data[4 + n:]
    except UnicodeDecodeError:
        return None


def _key(K2: int, codebook_id: int, out_dtype: torch.dtype, bias: torch.Tensor | None,
         tile_rows: int, grouped: bool, S: int, index: int | None,
         ragged: bool = False) -> tuple:
    """exl3_mma_linear's compiled variant; NW: 8 warps a program for a weight of one split (a
    program a 128-column block, finished in shared memory), else 4 (two programs a block —
    always for ragged sets, whose weights' splits differ; the same bits either way). A
    ragged set's output dtypes are read per set (OT unused: 0)."""
    return (K2, codebook_id, 0 if ragged else _OT[out_dtype],
            -1 if bias is None else _OT[bias.dtype], int(tile_rows > 8), int(grouped),
            8 if S == 1 and not ragged else 4, 0, 0, 0, int(ragged), index)


def _prefill_key(K2: int, codebook_id: int, out_dtype: torch.dtype, index: int | None) -> tuple:
    """exl3_mma_prefill's compiled variant: 8 warps, RG groups of 8 pairs, wgmma or not."""
    wgmma = PREFILL_WGMMA and _device_limits(index)[0] == (9, 0)  # (sm_90a only)
    return (K2, codebook_id, _OT[out_dtype], -1, 0, 1, 8, 1, PREFILL_TILE_M // 8,
            PREFILL_MIN_BLOCKS, 0, int(wgmma), PREFILL_WG_DEPTH if wgmma else 1, index)


def _options(K2: int, CB: int, OT: int, BT: int, R16: int, G: int, NW: int, PF: int,
             RG: int, MINB: int, RS: int, WG: int = 0, WD: int = 1) -> list[str]:
    return [f"-DK2={K2}", f"-DCB={CB}", f"-DOT={OT}", f"-DBT={BT}", f"-DR16={R16}", f"-DG={G}",
            f"-DNW={NW}", f"-DPF={PF}", f"-DRS={RS}"] \
        + ([f"-DRG={RG}", f"-DMINB={MINB}", f"-DWG={WG}", f"-DWD={WD}"] if PF else []) \
        + ["--fmad=false"]


def _arch(WG: int) -> str | None:
    """NVRTC's target: the device's own (None), or sm_90a where wgmma is used."""
    return "90a" if WG else None


class _Attr(ctypes.Structure):  # CUlaunchAttribute: id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("n_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_SHARED_SET: set = set()  # (kernel id, bytes) whose opt-in is made


def _launch(kernel, grid, block, args, early: bool, shared: int = 0) -> None:
    """cuLaunchKernelEx on the current stream (captured by CUDA graphs like any launch);
    early: the kernel may start before the previous one ends (it waits in griddepcontrol).
    args: tensors (their addresses), floats (double), ctypes values as they are, ints (int).
    shared: dynamic shared memory bytes (above 48 KiB the function opts in first)."""
    from torch.cuda._utils import _get_gpu_runtime_library
    lib = _get_gpu_runtime_library()
    if shared > 48 << 10 and (id(kernel), shared) not in _SHARED_SET:
        rc = lib.cuFuncSetAttribute(kernel.func, _MAX_DYNAMIC_SHARED_SIZE_BYTES, shared)
        if rc != 0:
            raise RuntimeError(f"exl3_mma: cuFuncSetAttribute({shared} B shared) failed with "
                               f"CUDA error {rc}")
        _SHARED_SET.add((id(kernel), shared))
    keep, params = [], []  # (keep: the ctypes values stay alive through the call)
    for a in args:
        v = (ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor)
             else a if isinstance(a, ctypes._SimpleCData)
             else ctypes.c_double(a) if isinstance(a, float) else ctypes.c_int(a))
        keep.append(v)
        params.append(ctypes.cast(ctypes.byref(v), ctypes.c_void_p))
    attr = _Attr(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1
    cfg = _Config(grid=(ctypes.c_uint * 3)(*grid), block=(ctypes.c_uint * 3)(*block),
                  shared=shared,
                  stream=ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
                  attrs=ctypes.pointer(attr) if early else None, n_attrs=1 if early else 0)
    rc = lib.cuLaunchKernelEx(
        ctypes.byref(cfg), kernel.func, (ctypes.c_void_p * len(params))(*params), None)
    if rc != 0:
        raise RuntimeError(f"exl3_mma: cuLaunchKernelEx failed with CUDA error {rc}")


_L = ctypes.c_longlong  # (the kernel's 64-bit strides)
_NULL = ctypes.c_void_p(0)  # (no ragged-set table)


def linear(xr: torch.Tensor, trellis: torch.Tensor, svh: torch.Tensor, codebook_id: int,
           K2: int, out: torch.Tensor, part: torch.Tensor, counters: torch.Tensor,
           per_split: int, bias: torch.Tensor | None, inv: float, early: bool) -> torch.Tensor:
    """out [M, n_out] = H128(x'·Ŵ)·svh (+ bias) for x' [M, k_p] fp16 in fragment order
    (rotate_in's output with fragment_order=True, rows contiguous), given the int32 word view
    of the contiguous trellis [kt, nt, 16·K], the split schedule's per_split, a partials
    buffer part [S, M, n_p] fp32 (S = its first dim) and zeroed arrival counters (left
    zero). early: launched right after xr's rotate_in. The caller checked why_not (which
    compiled the kernel) for the same arguments."""
    M = xr.shape[0]
    kt, nt = trellis.shape[-3], trellis.shape[-2]
    n_p, S = 16 * nt, part.shape[0]
    key = _key(K2, codebook_id, out.dtype, bias, M, False, S, xr.device.index)
    _launch(_KERNELS[key], (n_p // (16 * key[6]), S, 1), (32 * key[6], 1, 1),
            [xr, trellis, part, counters, svh, bias if bias is not None else svh, out,
             part, part,  # (no row tiles)
             M, MAX_ROWS, 1, xr.stride(0), _L(0), _L(0), _L(0),
             part.stride(1), _L(part.stride(0)), _L(0), _L(0), _L(0), out.stride(0), _L(0),
             n_p, out.shape[1], kt * 16 // 128, per_split, nt * 4 * K2, float(inv),
             _NULL, 0], early)
    return out


def moe(xr: torch.Tensor, words: torch.Tensor, str_set: int, svh: torch.Tensor,
        ssvh_set: int, codebook_id: int, K2: int, out: torch.Tensor, part: torch.Tensor,
        counters: torch.Tensor, per_split: int, tile_rows: torch.Tensor,
        tile_expert: torch.Tensor, inv: float, early: bool) -> torch.Tensor:
    """exl3_moe_linear's grouped step on this kernel: out[w, p] = H128(x'[w, p]·Ŵ_e)·svh_e for
    each weight set w and pair p in a row tile of expert e, from x' [W, P, k_p] fp16 (the
    grouped rotate_in's output, in fragment order); words: set 0's experts [E, kt, nt, 4K]
    int32, str_set words to set w's (× w); svh set 0's [E, n_p], ssvh_set likewise; part
    [W, S, P, n_p] fp32; tile_rows [n_tiles, MOE_TILE_M] / tile_expert [n_tiles] from
    moe_grouping (block MOE_TILE_M); zeroed counters for W·n_tiles·n_p/128 blocks (left
    zero). The caller checked why_not(…, pairs=P)."""
    W, P, _ = xr.shape
    kt, nt = words.shape[-3], words.shape[-2]
    n_p, S, n_tiles = 16 * nt, part.shape[1], tile_expert.numel()
    if tile_rows.shape != (n_tiles, MOE_TILE_M) or not tile_rows.is_contiguous():
        raise ValueError(f"exl3_mma.moe: tile_rows must be [n_tiles, {MOE_TILE_M}] contiguous")
    key = _key(K2, codebook_id, out.dtype, None, MOE_TILE_M, True, S, xr.device.index)
    _launch(_KERNELS[key], (n_p // (16 * key[6]), S, W * n_tiles), (32 * key[6], 1, 1),
            [xr, words, part, counters, svh, svh, out, tile_rows, tile_expert,
             P, MOE_TILE_M, n_tiles, xr.stride(1), _L(xr.stride(0)), _L(words.stride(0)),
             _L(str_set), part.stride(2), _L(part.stride(1)), _L(part.stride(0)),
             _L(svh.stride(0)), _L(ssvh_set), out.stride(1), _L(out.stride(0)),
             n_p, out.shape[2], kt * 16 // 128, per_split, nt * 4 * K2, float(inv),
             _NULL, 0], early)
    return out


def moe_prefill(xr: torch.Tensor, words: torch.Tensor, str_set: int, svh: torch.Tensor,
                ssvh_set: int, codebook_id: int, K2: int, out: torch.Tensor, per_split: int,
                tile_rows: torch.Tensor, tile_expert: torch.Tensor, inv: float,
                early: bool) -> torch.Tensor:
    """exl3_moe_linear's grouped step for many pairs on exl3_mma_prefill: out[w, p] =
    H128(x'[w, p]·Ŵ_e)·svh_e as `moe` computes it, from the same arguments but tile_rows
    [n_tiles, PREFILL_TILE_M] (moe_grouping, block PREFILL_TILE_M) and no partials or
    counters: a program sums its block's splits itself. The caller checked why_not(…,
    pairs=P, prefill=True)."""
    W, P, _ = xr.shape
    kt, nt = words.shape[-3], words.shape[-2]
    n_p, n_tiles = 16 * nt, tile_expert.numel()
    if tile_rows.shape != (n_tiles, PREFILL_TILE_M) or not tile_rows.is_contiguous():
        raise ValueError(f"exl3_mma.moe_prefill: tile_rows must be [n_tiles, {PREFILL_TILE_M}] "
                         "contiguous")
    key = _prefill_key(K2, codebook_id, out.dtype, xr.device.index)
    _launch(_KERNELS[key], (n_p // 128, W * n_tiles, 1), (256, 1, 1),
            [xr, words, svh, out, tile_rows, tile_expert, n_tiles,
             xr.stride(1), _L(xr.stride(0)), _L(words.stride(0)), _L(str_set),
             _L(svh.stride(0)), _L(ssvh_set), out.stride(1), _L(out.stride(0)),
             out.shape[2], kt * 16 // 128, per_split, nt * 4 * K2, float(inv)], early,
            prefill_shared(K2, key[11]))
    return out


SET_ROW = 16  # int64 entries of a ragged set's row in linear_set's table (exl3_mma.cu)


def set_row(first_program: int, col_programs: int, S: int, per_split: int, row_words: int,
            n_out: int, out_dtype: torch.dtype, trellis: torch.Tensor, svh: torch.Tensor,
            out_offset: int, out_stride: int, part_offset: int, part_row: int,
            part_split: int, counter_offset: int) -> list[int]:
    """One weight's row of linear_set's table (the order exl3_mma.cu's SET_ROW documents):
    out_offset in bytes from the output buffer, part_offset in floats from the partials',
    counter_offset in ints from the counters'."""
    row = [first_program, col_programs, S, per_split, row_words, n_out, _OT[out_dtype],
           trellis.data_ptr(), svh.data_ptr(), out_offset, out_stride, part_offset, part_row,
           part_split, counter_offset]
    return row + [0] * (SET_ROW - len(row))


def linear_set(xr: torch.Tensor, table: torch.Tensor, programs: int, codebook_id: int,
               K2: int, out: torch.Tensor, part: torch.Tensor, counters: torch.Tensor,
               k_steps: int, inv: float, early: bool) -> None:
    """W weights of one input (one k_p, K and codebook; any widths, each on its own split
    schedule) in one launch: set w's output H128(x'[w]·Ŵ_w)·svh_w from x' [W, M, k_p] fp16
    (rotate_in of the input with each weight's suh, in fragment order), as `linear` computes
    it for that weight alone, bit for bit. table [W, SET_ROW] int64 (set_row per weight, on
    the device), programs: Σ_w column programs · splits; out: the byte buffer the rows'
    outputs live in, part: the fp32 partials' buffer, counters: zeroed (left zero). The
    caller checked why_not(…, ragged=True) for every weight."""
    W, M, _ = xr.shape
    key = _key(K2, codebook_id, torch.float32, None, M, False, 2, xr.device.index, ragged=True)
    _launch(_KERNELS[key], (programs, 1, 1), (32 * key[6], 1, 1),
            [xr, xr, part, counters, xr, xr, out, xr, xr,  # (per-set tensors: in the table)
             M, MAX_ROWS, 1, xr.stride(1), _L(xr.stride(0)), _L(0), _L(0),
             0, _L(0), _L(0), _L(0), _L(0), 0, _L(0),
             0, 0, k_steps, 0, 0, float(inv), table, W], early)
