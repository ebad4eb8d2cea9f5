"""The CUDA EXL3 kernel's CPU-checkable parts (strata/kernels/exl3_mma.{cu,py}).

The kernel itself needs an H200 (tests/gpu/test_kernels_exl3_gpu.py compares it bit for bit
with the Triton kernels). Here: the lane arithmetic it rests on — each MMA lane decodes ring
positions 8·lane … 8·lane + 7 of a tile from a window of three words — transcribed from
decode_tile / the kernel's prologue into Python and checked against the torch decoder; the
prefill kernel's shared-memory addressing (staging and ldmatrix); when it declines to run and
why; and the driver structures its launcher hands to cuLaunchKernelEx.
"""
from __future__ import annotations

import ctypes
import functools

import pytest
import torch

from strata.kernels import exl3_mma
from strata.quant.exl3 import codebook_lut, decode_trellis

M32 = 0xFFFFFFFF


def funnel(lo: int, hi: int, n: int) -> int:
    """shf.l.clamp.b32: the upper 32 bits of hi:lo << min(n, 32)."""
    return ((((hi << 32) | lo) << min(n, 32)) >> 32) & M32


def lane_values(words: list[int], lane: int, K2: int) -> list[int]:
    """The 8 states lane `lane` decodes, as exl3_mma.cu computes them."""
    WT = 4 * K2
    b0 = 4 * lane * K2 - 16
    w0, o = b0 >> 5, b0 & 31  # (Python's >> and & on negatives match two's complement)
    w = [words[(w0 + i + WT) % WT] for i in range(3)]
    A, B = funnel(w[1], w[0], o), funnel(w[2], w[1], o)
    AB = (A << 32) | B
    out = []
    for j in range(8):
        n = ((j + 1) * K2) // 2
        out.append((AB >> (48 - n)) & 0xFFFF)
    return out


def lane_offset(lane: int, K2: int) -> int:
    return (4 * K2 * lane - 16) & 31


def word_cost(b: int, K2: int) -> tuple[int, bool, bool, bool]:
    """exl3_mma.cu's word_cost: W_b's own instruction, and whether it needs A, B, w[2]."""
    if K2 % 8 == 0:  # STATIC_WINDOW: o = 16
        s = 48 - b
        return (0 if s % 32 == 0 else 1, False, False, s > 32)
    o_max = max(lane_offset(lane, K2) for lane in range(32))
    if b == 0:
        return (1, False, False, True)
    if o_max <= b <= 32:
        return (1, False, False, False)
    if b > 32:
        return (1, True, False, False)
    return (1, True, True, True)


@functools.cache
def state_bases(K2: int) -> tuple[list[int], int]:
    """exl3_mma.cu's state_bases(): the word W_b each of a lane's 8 states is read from — the
    cheapest of the 3⁸ covers — and its cost."""
    static = K2 % 8 == 0
    o_max = max(lane_offset(lane, K2) for lane in range(32))
    offs = [48 - ((j + 1) * K2) // 2 for j in range(8)]
    best, best_key = None, None
    for code in range(3 ** 8):
        bases = [offs[j] - 8 * (code // 3 ** j % 3) for j in range(8)]
        if min(bases) < 0:
            continue
        words = list(dict.fromkeys(bases))
        costs = [word_cost(b, K2) for b in words]
        a, b, w2 = (any(c[i] for c in costs) for i in (1, 2, 3))
        cost = sum(c[0] for c in costs) + (a and (static or 32 not in words)) \
            + (b and (static or 0 not in words)) + w2
        regs = sum(not static and 0 < w < 32 and w >= o_max for w in words)
        if best_key is None or (cost, regs) < best_key:
            best, best_key = bases, (cost, regs)
    return best, best_key[0]


def lane_states(words: list[int], lane: int, K2: int) -> list[int]:
    """The 8 states as state<j> reads them: each from its word W_b (window_word) by a mask, a
    byte permute (__byte_perm(w, 0, 0x4421)) or a shift by 16."""
    WT = 4 * K2
    b0 = 4 * lane * K2 - 16
    w0, o = b0 >> 5, b0 & 31
    w = [words[(w0 + i + WT) % WT] for i in range(3)]
    A, B = funnel(w[1], w[0], o), funnel(w[2], w[1], o)
    o_max = max(lane_offset(ln, K2) for ln in range(32))
    out = []
    for j, b in enumerate(state_bases(K2)[0]):
        if K2 % 8 == 0:
            s = 48 - b
            word = w[s // 32] if s % 32 == 0 else funnel(w[1], w[0], s) if s < 32 else \
                funnel(w[2], w[1], s - 32)
        elif b == 0:
            word = B
        elif b >= 32:
            word = A >> (b - 32)
        elif b >= o_max:
            word = funnel(w[1], w[0], o + 32 - b)
        else:
            word = funnel(B, A, 32 - b)
        p = (48 - ((j + 1) * K2) // 2 - b) // 8
        out.append(word & 0xFFFF if p == 0 else (word >> 8) & 0xFFFF if p == 1 else word >> 16)
    return out


# the cover's cost (words, plus A, B and w[2]'s load where needed) for K2 = 3 … 12; with every
# word made from A and B, K2 = 5, 6, 8 cost 8, 11, 6 (A, B, w[2]'s load and 5, 8, 3 words)
COVER_COST = {3: 7, 4: 4, 5: 6, 6: 8, 7: 11, 8: 3, 9: 11, 10: 10, 11: 8, 12: 10}


@pytest.mark.parametrize("K2", range(3, 13))
def test_each_state_read_from_its_shared_word_is_the_lanes_state(K2):
    """state_bases' cover reads the same 8 states as the window's plain shifts (lane_values,
    checked against the torch decoder below), every lane, random tiles — and where its cost
    has no w[2] load, nothing depends on w[2]."""
    bases, cost = state_bases(K2)
    assert cost == COVER_COST[K2]
    reads_w2 = any(word_cost(b, K2)[2] or word_cost(b, K2)[3] for b in bases)
    g = torch.Generator().manual_seed(100 + K2)
    for _ in range(4):
        words = torch.randint(0, 2**32, (4 * K2,), generator=g, dtype=torch.int64).tolist()
        for lane in range(32):
            want = lane_values(words, lane, K2)
            assert lane_states(words, lane, K2) == want, lane
            if not reads_w2:  # the lane's third word changed: the same states
                w2 = ((4 * lane * K2 - 16) >> 5) + 2
                other = list(words)
                other[w2 % (4 * K2)] ^= 0xFFFFFFFF
                assert lane_states(other, lane, K2)[:8] == lane_states(words, lane, K2)


# decode_tile: fragment register a[r] = codebook2(s[i], s[j]) (low half s[i], high s[j])
FRAGMENT = {0: (0, 1), 1: (4, 5), 2: (2, 3), 3: (6, 7)}


@pytest.mark.parametrize("K2,codebook", [(4, "mul1"), (5, "mul1"), (6, "mcg"), (7, "mul1"),
                                         (8, "3inst"), (11, "mul1"), (12, "3inst")])
def test_lane_windows_are_the_mma_fragments(K2, codebook):
    """Lane l = 4g + t: register a[r], half h holds, by the m16n8k16 A-operand layout (PTX
    ISA: row g + 8·(r & 1), column 2t + h + 8·(r >> 1)), element [n, k] of Ŵᵀ — exactly
    decode_trellis's Ŵ[k, n] — for random tiles."""
    L = 8 * K2  # int16 per tile: 16·K
    g = torch.Generator().manual_seed(K2)
    trellis = torch.randint(-2**15, 2**15, (3, 2, L), generator=g, dtype=torch.int32).to(
        torch.int16)
    w_ref = decode_trellis(trellis, codebook)
    lut = codebook_lut(codebook)
    for tk in range(3):
        for tn in range(2):
            words = [v & M32 for v in trellis[tk, tn].contiguous().view(torch.int32).tolist()]
            for lane in range(32):
                gg, t = lane >> 2, lane & 3
                states = lane_values(words, lane, K2)
                for r, pair in FRAGMENT.items():
                    for h, j in enumerate(pair):
                        n = gg + 8 * (r & 1)
                        k = 2 * t + h + 8 * (r >> 1)
                        got = lut[states[j]]
                        want = w_ref[16 * tk + k, 16 * tn + n]
                        assert got.view(torch.int16) == want.view(torch.int16), (tk, tn, lane, r, h)


def test_it_declines_and_says_why(monkeypatch):
    x = torch.zeros(6, 256)
    tr = torch.zeros(16, 16, 20, dtype=torch.int16)  # (256 × 256 at 2.5 bits)

    def why(x, K2=5, n_p=256, trellis=tr, **kw):
        return exl3_mma.why_not(x, K2, 2, n_p, torch.float32, None, trellis, 8, **kw)

    assert why(x) == "not on CUDA"
    assert why(x, pairs=36) == "not on CUDA"
    # (shape reasons first: they hold on any device)
    assert why(torch.zeros(17, 256)) == "rows not in 1…16"
    assert why(x, pairs=65) == "pairs not in 1…64"
    assert why(x, K2=13) == "K > 6"
    assert why(x, n_p=192) == "output not 128-aligned"
    # the kernel copies 16-byte chunks of tiles: a view 4 bytes in, or sets 3 words apart, not
    assert why(x, trellis=tr.view(-1)[2:]) == "trellis not 16-byte aligned"
    assert why(x, pairs=36, str_set=3) == "trellis not 16-byte aligned"
    assert why(x, pairs=36, str_set=4) == "not on CUDA"
    # the prefill kernel: any number of pairs, no bias
    assert why(x, pairs=5000, prefill=True) == "not on CUDA"
    assert why(x, pairs=0, prefill=True) == "no pairs"
    assert exl3_mma.why_not(x, 5, 2, 256, torch.float32, torch.zeros(256), tr, 8, pairs=100,
                            prefill=True) == "a bias (the prefill kernel has none)"
    monkeypatch.setattr(exl3_mma, "ENABLED", False)
    assert "switched off" in why(x)


def test_which_gpus_can_run_it():
    """The device's part of why_not: mma.sync m16n8k16 and cp.async from sm_80; the prefill
    kernel's shared memory against the block limit — an H200's 227 KiB holds every K, an
    RTX PRO 6000's (sm_120) or an RTX 4090's 99 KiB up to K 3."""
    hopper, blackwell = ((9, 0), 232448), ((12, 0), 101376)
    assert exl3_mma.device_reason((7, 5), 65536, 5, False) == \
        "compute capability 7.5 (mma.sync m16n8k16 and cp.async need 8.0)"
    for K2 in range(2, 13):
        assert exl3_mma.device_reason(*hopper, K2, True) is None
        assert exl3_mma.device_reason(*blackwell, K2, False) is None
    assert exl3_mma.prefill_shared(6) == 101376
    assert exl3_mma.device_reason(*blackwell, 6, True) is None
    assert exl3_mma.device_reason(*blackwell, 7, True) == (
        "the prefill kernel needs 104448 bytes of shared memory a block at K 3.5; this GPU "
        "allows 101376")


def test_a_one_split_weight_gets_eight_warps_a_program(monkeypatch):
    """The compiled variant's NW: 8 warps — one program a 128-column block, finished in
    shared memory — for a weight of one split, else 4 (two programs a block, partials)."""
    monkeypatch.setattr(exl3_mma, "_device_limits", lambda index: ((9, 0), 232448))  # no GPU
    def nw(S):
        key = exl3_mma._key(5, 2, torch.float32, None, 6, False, S, 0)
        opts = exl3_mma._options(*key[:-1])
        return key[6], [o for o in opts if o.startswith("-DNW")], "-DPF=0" in opts
    assert nw(1) == (8, ["-DNW=8"], True)
    assert nw(2) == nw(14) == (4, ["-DNW=4"], True)
    # the prefill kernel: 8 warps, RG groups of 8 pairs, its register bound
    opts = exl3_mma._options(*exl3_mma._prefill_key(5, 2, torch.bfloat16, 0)[:-1])
    assert {"-DNW=8", "-DPF=1", f"-DRG={exl3_mma.PREFILL_TILE_M // 8}",
            f"-DMINB={exl3_mma.PREFILL_MIN_BLOCKS}"} <= set(opts)


def test_the_prefill_kernels_wgmma_form_is_its_own_variant(monkeypatch):
    """PREFILL_WGMMA compiles (and caches) a separate prefill variant: -DWG=1, for sm_90a
    (wgmma exists only there: other GPUs keep mma.sync — their limits mocked, no GPU here);
    without it (STRATA_EXL3_WGMMA=0) Hopper too runs mma.sync for the device's own target."""
    limits = {0: ((9, 0), 232448), 1: ((12, 0), 101376)}
    monkeypatch.setattr(exl3_mma, "_device_limits", limits.get)
    monkeypatch.setattr(exl3_mma, "PREFILL_WGMMA", False)
    base = exl3_mma._prefill_key(5, 2, torch.bfloat16, 0)
    monkeypatch.setattr(exl3_mma, "PREFILL_WGMMA", True)
    wg = exl3_mma._prefill_key(5, 2, torch.bfloat16, 0)
    assert base != wg
    assert {"-DWG=0", "-DWD=1"} <= set(exl3_mma._options(*base[:-1]))
    assert {"-DWG=1", f"-DWD={exl3_mma.PREFILL_WG_DEPTH}"} <= set(exl3_mma._options(*wg[:-1]))
    monkeypatch.setattr(exl3_mma, "PREFILL_WG_DEPTH", 4)  # (how many tiles decode at once)
    assert exl3_mma._prefill_key(5, 2, torch.bfloat16, 0) not in (base, wg)
    assert exl3_mma._arch(base[11]) is None and exl3_mma._arch(wg[11]) == "90a"
    assert exl3_mma._prefill_key(5, 2, torch.bfloat16, 1)[11] == 0
    assert exl3_mma.prefill_shared(5, wg[11]) == exl3_mma.prefill_shared(5) + 1024


def test_fragment_order_gives_each_lane_its_b_fragments():
    """load_x, transcribed: lane l = 4g + t reads 16-byte vectors v = 0…3 at half 32t + 8v of
    each 128-block of x' in fragment order, words (x, y, z, w) = steps 2v, 2v + 1 × (b0, b1).
    By the m16n8k16 B-operand layout (PTX ISA) step i's b0 holds k 16i + 2t, + 1 and b1 k
    16i + 2t + 8, + 9 (low half first) — of the natural x' row, for every block and lane."""
    g = torch.Generator().manual_seed(3)
    xr = torch.randint(-2**15, 2**15, (3, 256), generator=g, dtype=torch.int32).to(torch.int16)
    frag = exl3_mma.fragment_order(xr.view(torch.float16)).view(torch.int16)
    for row in range(3):
        for ks in range(2):
            nat = xr[row, 128 * ks:128 * ks + 128].tolist()
            blk = frag[row, 128 * ks:128 * ks + 128].tolist()
            for t in range(4):
                lane_halves = blk[32 * t:32 * t + 32]  # four 16-byte vectors
                words = [lane_halves[2 * w:2 * w + 2] for w in range(16)]
                for v in range(4):
                    for dv, i in ((0, 2 * v), (2, 2 * v + 1)):
                        assert words[4 * v + dv] == nat[16 * i + 2 * t:16 * i + 2 * t + 2]
                        assert words[4 * v + dv + 1] == nat[16 * i + 2 * t + 8:16 * i + 2 * t + 10]


def test_prefill_staging_and_ldmatrix_addresses():
    """exl3_mma_prefill's shared-memory x' tile, transcribed: thread chunk c = tid + 256j is
    row c / 16, 16-byte column c % 16, stored at column (c % 16) ^ (row % 8); lane l's
    ldmatrix.x4 address for row pair qp and k16 step i. Every chunk of the tile is staged once;
    each lane's address is matrix l / 8's row l % 8 — group 2qp + (l / 16), k half (l / 8) % 2,
    the m16n8k16 B fragment's (rows of x' = the MMA's n, 8 k values a row); and the 8 rows of
    one matrix fall in 8 distinct 16-byte columns of a 128-byte line (no bank conflict)."""
    TM = exl3_mma.PREFILL_TILE_M
    staged = {}
    for tid in range(256):
        for j in range(TM // 16):
            c = tid + 256 * j
            r, cc = c >> 4, c & 15
            staged[r * 256 + ((cc ^ (r & 7)) << 4)] = (r, cc)
    assert sorted(staged.values()) == [(r, cc) for r in range(TM) for cc in range(16)]
    for qp in range(TM // 16):
        for i in range(8):
            banks = {}
            for lane in range(32):
                lrow, half = 8 * (lane >> 4) + (lane & 7), (lane >> 3) & 1
                addr = (qp * 16 + lrow) * 256 + (((2 * i + half) ^ (lane & 7)) << 4)
                m = lane // 8
                assert staged[addr] == (8 * (2 * qp + m // 2) + lane % 8, 2 * i + m % 2)
                banks.setdefault(m, set()).add(addr % 128 // 16)
            assert all(len(b) == 8 for b in banks.values())


def test_launch_structures_match_the_driver_abi():
    """CUlaunchAttribute (id, 4 bytes padding, a 64-byte value union) and CUlaunchConfig as the
    CUDA 12/13 headers lay them out on 64-bit Linux."""
    assert ctypes.sizeof(exl3_mma._Attr) == 72
    assert exl3_mma._Attr.value.offset == 8
    C = exl3_mma._Config
    assert (C.grid.offset, C.block.offset, C.shared.offset, C.stream.offset, C.attrs.offset,
            C.n_attrs.offset, ctypes.sizeof(C)) == (0, 12, 24, 32, 40, 48, 56)


@pytest.mark.parametrize("TM", [64, 128])
def test_prefill_wgmma_staging_and_descriptors(TM):
    """exl3_mma_prefill's x' tile for wgmma (WG 1), transcribed: chunk c = tid + 256j is row
    r = c / 16, 16-byte column cc = c % 16, stored in half cc / 8's region (TM rows of 128
    bytes) at chunk (cc % 8) ^ (r % 8); the B descriptor of k16 step kk (x_desc_lo, x_desc).
    Every chunk is staged once; the descriptor's fields decode to start = region + 32·(kk % 4),
    stride 1,024, swizzle mode 1 (128 bytes), and reading it as the PTX ISA defines the 128-byte
    swizzled K-major layout — row n, 16-byte chunk h of the step at start + 128n + 16h (8-row
    groups a stride apart), address bits 4–6 XORed with bits 7–9 — gives row n's k values
    16kk + 8h … + 7 (the chunk 2kk + h) for every row, k16 step and stage; the instructions
    of wgmma<NQ> (64, 32 or 16 rows, each from its own row's start) read every row of the
    first 16·NQ once, in order. (The layout's
    definition is read from the ISA, not checked against hardware here: the GPU test does.)
    For tiles of 64 pairs (the default) and of 128 (the most the kernel takes)."""
    XS = TM * 256
    staged = {}
    for tid in range(256):
        for j in range(TM // 16):
            c = tid + 256 * j
            r, cc = c >> 4, c & 15
            staged[(cc >> 3) * (TM * 128) + r * 128 + (((cc & 7) ^ (r & 7)) << 4)] = (r, cc)
    assert sorted(staged.values()) == [(r, cc) for r in range(TM) for cc in range(16)]
    assert max(staged) < XS
    HI = (1024 >> 4) | (1 << 30)
    for base in (0, 1024 * 37, 227 * 1024 - 3 * XS):  # 1,024-aligned stage bases
        base -= base % 1024
        for stage in range(3):
            addr = base + stage * XS
            lo = ((addr & 0x3FFFF) >> 4) | (1 << 16)
            for kk in range(8):
                desc = (HI << 32) | (lo + (((kk >> 2) * (TM * 128) + (kk & 3) * 32) >> 4))
                start = (desc & 0x3FFF) << 4
                assert (desc >> 32) & 0x3FFF == 1024 >> 4 and desc >> 62 == 1
                assert (desc >> 16) & 0x3FFF == 1 and (desc >> 49) & 7 == 0
                assert start == addr + (kk >> 2) * (TM * 128) + (kk & 3) * 32
                for n in range(TM):
                    for h in range(2):
                        logical = start + (n // 8) * 1024 + (n % 8) * 128 + 16 * h
                        physical = logical ^ (((logical >> 7) & 7) << 4)
                        assert staged[physical - addr] == (n, 2 * kk + h)
                # wgmma<NQ>'s instructions (64 rows each, then 32, then 16) from q·16 rows on
                # at desc + q·128: every row 0 … 16·NQ − 1 read once, as the rows above
                for NQ in range(1, TM // 16 + 1):
                    n64 = NQ // 4 * 4
                    parts = [(q, 4) for q in range(0, n64, 4)]
                    parts += [(n64, 2)] if NQ - n64 >= 2 else []
                    parts += [(NQ - 1, 1)] if (NQ - n64) % 2 else []
                    rows = []
                    for q, size in parts:
                        start_q = ((desc + q * 128) & 0x3FFF) << 4
                        for n in range(16 * size):
                            logical = start_q + (n // 8) * 1024 + (n % 8) * 128
                            physical = logical ^ (((logical >> 7) & 7) << 4)
                            rows.append(staged[physical - addr][0])
                    assert rows == list(range(16 * NQ))


class _FakeRTC:
    """Stands in for torch.cuda._utils' NVRTC compile and module load, which need a GPU (none
    here; the GPU suite runs the real ones): a 'cubin' is the options' text, and loading one
    that does not start with b"opts:" fails as a damaged module would."""

    def __init__(self):
        self.compiles = 0

    def _nvrtc_compile(self, source, name, compute_capability=None, nvcc_options=None):
        self.compiles += 1
        return b"opts:" + " ".join([compute_capability, *nvcc_options]).encode(), name + "_m"

    def _cuda_load_module(self, cubin, names):
        if not cubin.startswith(b"opts:"):
            raise RuntimeError("CUDA error: device kernel image is invalid")
        return {n: ("kernel", n, cubin) for n in names}


def test_compiled_variants_are_kept_on_disk_for_later_processes(tmp_path, monkeypatch):
    """_compile: the first call compiles a variant and stores its cubin under
    $STRATA_CACHE/exl3_mma; a later call (a new process: the in-memory table empty) loads it
    without compiling; another option or target is another entry; a damaged entry is
    compiled again and replaced; an unwritable cache still returns the kernel."""
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path))
    rtc = _FakeRTC()
    opts = exl3_mma._options(*exl3_mma._key(5, 2, torch.float32, None, 6, False, 2, 0)[:-1])
    k = exl3_mma._compile("exl3_mma_linear", "90", opts, rtc)
    assert rtc.compiles == 1 and k[1] == "exl3_mma_linear_m"
    (entry,) = (tmp_path / "exl3_mma").glob("*.cubin")
    assert exl3_mma.read_cubin(entry) == ("exl3_mma_linear_m", k[2])
    assert exl3_mma._compile("exl3_mma_linear", "90", opts, rtc) == k and rtc.compiles == 1
    exl3_mma._compile("exl3_mma_linear", "120", opts, rtc)
    exl3_mma._compile("exl3_mma_linear", "90", opts + ["-DX=1"], rtc)
    assert rtc.compiles == 3 and len(list((tmp_path / "exl3_mma").glob("*.cubin"))) == 3
    exl3_mma.write_cubin(entry, "exl3_mma_linear_m", b"garbage")
    assert exl3_mma._compile("exl3_mma_linear", "90", opts, rtc) == k and rtc.compiles == 4
    assert exl3_mma.read_cubin(entry)[1] == k[2]
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("not a directory")
    assert exl3_mma._compile("exl3_mma_linear", "90", opts, rtc) == k and rtc.compiles == 5


def test_a_cubin_entry_reads_back_whole_or_not_at_all(tmp_path):
    """write_cubin / read_cubin: the name and the bytes back; a missing, short or malformed
    file (a name length past the end, a name that is not UTF-8) reads as None; the source or
    the target changes the key."""
    path = tmp_path / "k.cubin"
    assert exl3_mma.read_cubin(path) is None
    exl3_mma.write_cubin(path, "exl3_mma_prefill", b"\x7fELF" + bytes(range(256)))
    assert exl3_mma.read_cubin(path) == ("exl3_mma_prefill", b"\x7fELF" + bytes(range(256)))
    for bad in (b"", b"\x05\x00", (900).to_bytes(4, "little") + b"abc",
                (2).to_bytes(4, "little") + b"\xff\xfe" + b"cubin"):
        path.write_bytes(bad)
        assert exl3_mma.read_cubin(path) is None, bad
    key = exl3_mma.cubin_key("src", "exl3_mma_linear", "90", ["-DK2=5"])
    assert key != exl3_mma.cubin_key("src2", "exl3_mma_linear", "90", ["-DK2=5"])
    assert key != exl3_mma.cubin_key("src", "exl3_mma_linear", "90a", ["-DK2=5"])
    assert key == exl3_mma.cubin_key("src", "exl3_mma_linear", "90", ["-DK2=5"])
