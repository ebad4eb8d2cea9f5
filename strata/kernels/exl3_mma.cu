// EXL3 linear for decode-sized inputs (M ≤ 16 rows) after its rotate_in (x' = H128(fp16(x·suh))):
// x'·Ŵ with Ŵ decoded straight into m16n8k16 MMA fragments → split partials → the last program
// of each 128-column block sums them, Hadamard, ·svh (+ bias). Launched early (programmatic
// dependent launch) after rotate_in: each program copies and decodes its first k-step's
// trellis tiles, then waits for x'; after its k-loop it lets the next kernel launch early.
// Compiled at run time with NVRTC (strata/kernels/exl3_mma.py); no header is included, so
// half-precision work is done on bit patterns with PTX.
//
// Compile-time constants (-D): K2 = 2K (bits per weight × 2), CB (0 3INST, 1 MCG, 2 MUL1),
// OT (out: 0 fp32, 1 bf16, 2 fp16), BT (bias: -1 none, else as OT),
// R16 (1: up to 16 rows; 0: up to 8 — one n8 group of x' rows),
// PF (1: the prefill kernel exl3_mma_prefill below, with RG groups of 8 rows and at least MINB
// programs an SM — its register bound, its MMAs wgmma where WG is 1 (sm_90a; WD tiles decoded
// before their wgmmas are issued), else mma.sync; 0: exl3_mma_linear),
// G (1: grouped — the rows of a program are a tile of (token, slot) pairs sharing one expert,
// from strata.kernels.moe_grouping, for W weight sets at once: exl3.exl3_moe_linear),
// RS (1: ragged sets — W weights of one input and one k_p but any widths, each on its own
// split schedule, in a 1-D grid described by a table: exl3.exl3_linear_set; 0: not),
// NW (warps per program, 4 or 8: a program covers 16·NW columns; with 8 — chosen for a weight
// of one split, S = 1 — one program per 128-column block finishes its block from shared
// memory, without the partials' round trip through global memory and the arrival count).
//
// Why the fragments need no exchange between lanes: a 16×16 trellis tile's ring position p has
// bits (r0, r3, c3, r1, r2, c0, c1, c2) of its row r and column c. The kernel computes the
// transposed product y'ᵀ = Ŵᵀ·x'ᵀ with Ŵᵀ's 16×16 tile as an m16n8k16 MMA's A operand and 8
// rows of x' as its n8: lane l = 4g + t holds A elements at Ŵ rows (k) 2t + {0, 1} + {0, 8} and
// columns g + {0, 8} — exactly positions 8l … 8l + 7, a contiguous window of the tile's
// bitstream (position p's 16-bit state ends at bit ⌊(p + 1)·K2 / 2⌋, tail-biting). One MMA per
// tile and 8 rows: no zero rows padding a decode's few rows to the MMA's 16.
//
// Bits: the same as the Triton kernels of strata/kernels/exl3.py wherever their tl.dot puts
// each k16 step's products in an MMA in natural order — wgmma on Hopper (an MMA chain over
// ascending k16 steps rounds as wgmma does, measured in session 3), mma.sync with kWidth 2
// elsewhere (exl3.cuda_order_reason decides): each split sums its k16 steps in ascending order
// from zero, the splits (strata's split_schedule) are added in ascending order from zero, and
// the Hadamard steps use the same butterfly order.

#define WT (4 * K2)        // 32-bit words per tile (16·K int16)
#define PER_BLOCK (8 / NW)  // programs per 128-column block
#if NW != 4 && NW != 8
#error "exl3_mma: NW is 4 or 8"
#endif
#if !PF
#define RG (R16 ? 2 : 1)   // groups of 8 rows (an MMA's n8)
#endif
// A lane's window (16 bits before its 8 positions, then 8·K bits) starts anywhere in a word:
// three words hold it and, shifted to start at bit 0, two words (8K + 16 ≤ 64) for K ≤ 6 (V4.1
// quants' head). Larger K (EXL3 allows up to 8) stays on the Triton kernel.
#if K2 > 12
#error "exl3_mma: K > 6"
#endif

typedef unsigned int u32;

// Programmatic dependent launch (griddepcontrol) exists from sm_90; below it no kernel is
// launched early (strata.kernels.pdl), so there is nothing to wait for or release.
__device__ __forceinline__ void gdc_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void gdc_release() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ unsigned short f2h(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

#if BT >= 0
__device__ __forceinline__ float load_bias(const void* p, long long i) {
#if BT == 0
    return ((const float*)p)[i];
#elif BT == 1
    return __uint_as_float(((u32)((const unsigned short*)p)[i]) << 16);
#else
    return h2f(((const unsigned short*)p)[i]);
#endif
}
#endif

// element i of an output of dtype ot (0 fp32, 1 bf16, 2 fp16: OT's codes)
__device__ __forceinline__ void store_as(void* p, long long i, float v, int ot) {
    if (ot == 0) {
        ((float*)p)[i] = v;
    } else if (ot == 1) {
        unsigned short b;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(v));
        ((unsigned short*)p)[i] = b;
    } else {
        ((unsigned short*)p)[i] = f2h(v);
    }
}

__device__ __forceinline__ void store_out(void* p, long long i, float v) {
    store_as(p, i, v, OT);  // (a constant: the branches fold)
}

// Unnormalised natural-order Sylvester H128 over a warp's 128 values (lane holds 4 consecutive:
// index 4·lane + j): one butterfly (a + b, a − b) per index bit, bit 0 first — the order of
// exl3.py's _fwht128, so the same fp32 operations on every element.
__device__ __forceinline__ void fwht128(float (&v)[4], int lane) {
    float a0 = v[0], a1 = v[1], a2 = v[2], a3 = v[3];
    v[0] = a0 + a1; v[1] = a0 - a1; v[2] = a2 + a3; v[3] = a2 - a3;
    a0 = v[0]; a1 = v[1]; a2 = v[2]; a3 = v[3];
    v[0] = a0 + a2; v[2] = a0 - a2; v[1] = a1 + a3; v[3] = a1 - a3;
#pragma unroll
    for (int m = 1; m < 32; m <<= 1) {
        const bool hi = lane & m;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float p = __shfl_xor_sync(0xffffffffu, v[j], m);
            v[j] = hi ? p - v[j] : v[j] + p;
        }
    }
}

// fp16 pair (lo = position j, hi = position j + 1) of two 16-bit trellis states; xc holds
// 0x3B603B60 in a register, so each (x & mask) ^ xc is one LOP3 (with two immediates the
// compiler emits two)
__device__ __forceinline__ u32 codebook2(u32 s0, u32 s1, u32 xc) {
#if CB == 2
    u32 b0, b1, r;
    // byte sum + 0x6400 = the fp16 bits of 1024 + Σ bytes, then (1024 + b)·k1 + k0 in one fma
    asm("dp4a.u32.u32 %0, %1, %2, %3;" : "=r"(b0) : "r"(s0 * 0x83DCD12Du), "r"(0x01010101u), "r"(0x6400u));
    asm("dp4a.u32.u32 %0, %1, %2, %3;" : "=r"(b1) : "r"(s1 * 0x83DCD12Du), "r"(0x01010101u), "r"(0x6400u));
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(__byte_perm(b0, b1, 0x5410)),
        "r"(0x1EEE1EEEu), "r"(0xC931C931u));
    return r;
#else
#if CB == 0
    u32 x0 = s0 * 89226354u + 64248484u, x1 = s1 * 89226354u + 64248484u;
#else
    u32 x0 = s0 * 0xCBAC1FEDu, x1 = s1 * 0xCBAC1FEDu;
#endif
    asm("lop3.b32 %0, %1, 0x8FFF8FFF, %2, 0x6A;" : "=r"(x0) : "r"(x0), "r"(xc));  // (a & b) ^ c
    asm("lop3.b32 %0, %1, 0x8FFF8FFF, %2, 0x6A;" : "=r"(x1) : "r"(x1), "r"(xc));
    // each value is the sum of its word's two halves: one fp16 add per word (an HADD2 reading
    // its operand's halves), then one byte permute to pair the sums — rather than two permutes
    // and one paired add. Same adds, same bits, one instruction moved off the integer pipe
    // (16 lanes a cycle), which also carries the LOP3s and the states' shifts and permutes:
    // at K 2, 28 of a tile's 46 instructions before, 24 after
    u32 r;
    asm("{ .reg .f16 l0, h0, l1, h1, v0, v1;\n\t"
        "mov.b32 {l0, h0}, %1;\n\tmov.b32 {l1, h1}, %2;\n\t"
        "add.rn.f16 v0, l0, h0;\n\tadd.rn.f16 v1, l1, h1;\n\t"
        "mov.b32 %0, {v0, v1}; }" : "=r"(r) : "r"(x0), "r"(x1));
    return r;
#endif
}

// codebook2's xc: the constant in a register (an asm move the compiler does not fold back
// into immediates)
__device__ __forceinline__ u32 xor_constant() {
    u32 xc;
    asm volatile("mov.b32 %0, 0x3B603B60;" : "=r"(xc));
    return xc;
}

// the svh (and bias, BT ≥ 0) of output columns c0 … c0 + 3
__device__ __forceinline__ void load_scales(const unsigned short* sv, const void* bias, int c0,
                                            int n_out, float (&scale)[4], float* shift) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        scale[j] = h2f(sv[c0 + j]);
#if BT >= 0
        shift[j] = c0 + j < n_out ? load_bias(bias, c0 + j) : 0.f;
#endif
    }
}

// a zeroed accumulator of RG row groups
__device__ __forceinline__ void zero(float (&acc)[RG][4]) {
#pragma unroll
    for (int q = 0; q < RG; ++q)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[q][j] = 0.f;
}

// upper 32 bits of the 64-bit hi:lo shifted left by n (0 ≤ n ≤ 32)
__device__ __forceinline__ u32 funnel(u32 lo, u32 hi, u32 n) {
    u32 d;
    asm("shf.l.clamp.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(lo), "r"(hi), "r"(n));
    return d;
}

// Where each of a lane's 8 states is taken from. The window's 64 bits are A:B (A = bits 32–63);
// position 8·lane + j's state is bits [off(j), off(j) + 16). A state at a byte offset of a
// 32-bit word is one instruction (a mask, a byte permute, or a shift right by 16), not the
// shift and mask an arbitrary offset costs; so each state is read from a word W_b = bits b …
// b + 31 of A:B with off − b ∈ {0, 8, 16}, the words shared between states of one residue mod 8
// (K 2: the 8 states from A and three shifts of it — 11 integer instructions, not 16).
__device__ constexpr int state_off(int j) { return 48 - ((j + 1) * K2) / 2; }

// The window starts o = (4·K2·lane − 16) mod 32 bits into the lane's first word, so W_b is bits
// [o + 32 − b, o + 64 − b) of the tile's words w[0]:w[1]:w[2] (w[0] first, most significant). A
// word is made (window_word) by one instruction from A or B (A = W_32, B = W_0, each a funnel
// shift of two of the w), or — where that range starts in [0, 32] for every lane, i.e. b from
// the largest lane offset O_MAX up to 32 — straight from w[0] and w[1] by one funnel shift of
// o + 32 − b (a per-lane constant, kept in a register). With K2 a multiple of 8 every lane has
// o = 16 (STATIC_WINDOW): the shifts are constants and W_16 is w[1] itself.
__device__ constexpr int lane_offset(int lane) { return (4 * K2 * lane - 16) & 31; }

__device__ constexpr int max_offset() {
    int m = 0;
    for (int lane = 0; lane < 32; ++lane) m = lane_offset(lane) > m ? lane_offset(lane) : m;
    return m;
}

#define STATIC_WINDOW (K2 % 8 == 0)
#define O_MAX max_offset()

// what W_b takes: its own instruction (none for a whole word), and A, B, w[2]'s shared load
struct WordCost {
    int own;
    bool a, b, w2;
};

__device__ constexpr WordCost word_cost(int b) {
    if (STATIC_WINDOW) {
        const int s = 48 - b;  // (o = 16)
        return {s % 32 == 0 ? 0 : 1, false, false, s > 32};
    }
    if (b == 0) return {1, false, false, true};                 // B
    if (b >= O_MAX && b <= 32) return {1, false, false, false};  // from w[0], w[1] (A: b = 32)
    if (b > 32) return {1, true, false, false};                  // A shifted
    return {1, true, true, true};                                // A and B funnelled
}

struct Bases {
    int b[8];
};

// The cheapest cover of the 8 states — of all 3⁸ choices of off, off − 8 or off − 16 for each:
// the words made, A and B where a word needs them and is not one of them, and w[2]'s shared
// load where anything reads it; on a tie, fewer per-lane shift registers, then the first.
// Against the cover that made every word from A and B: K 2 the same (A and three shifts of
// it); K 2.5 A and 5 words, not A, B and 5 words; K 3 8 words from w[0], w[1], not A, B and 8;
// K 4 w[1] and 3 words, not A, B and 3 — and for those three K no state reads w[2], so its
// shared load goes too (compiled k-loop, MUL1: −4, −6, −7 %).
__device__ constexpr Bases state_bases() {
    Bases best{};
    int best_cost = 1 << 30, best_regs = 0;
    for (int code = 0; code < 6561; ++code) {
        Bases c{};
        bool ok = true;
        for (int j = 0, x = code; j < 8; ++j, x /= 3) {
            c.b[j] = state_off(j) - 8 * (x % 3);
            ok = ok && c.b[j] >= 0;
        }
        if (!ok) continue;
        int cost = 0, regs = 0;
        bool a = false, b = false, w2 = false, has_a = false, has_b = false;
        for (int j = 0; j < 8; ++j) {
            bool seen = false;
            for (int i = 0; i < j; ++i) seen = seen || c.b[i] == c.b[j];
            if (seen) continue;
            const WordCost wc = word_cost(c.b[j]);
            cost += wc.own;
            a = a || wc.a;
            b = b || wc.b;
            w2 = w2 || wc.w2;
            has_a = has_a || (!STATIC_WINDOW && c.b[j] == 32);
            has_b = has_b || (!STATIC_WINDOW && c.b[j] == 0);
            regs += !STATIC_WINDOW && c.b[j] > 0 && c.b[j] < 32 && c.b[j] >= O_MAX;
        }
        cost += (a && !has_a) + (b && !has_b) + w2;
        if (cost < best_cost || (cost == best_cost && regs < best_regs)) {
            best = c;
            best_cost = cost;
            best_regs = regs;
        }
    }
    return best;
}

constexpr Bases STATE_BASES = state_bases();  // (searched once, not per state)

// W_b (b a constant; above bit 63 of A:B, zeros or the bits before the window: no state reads
// them), as word_cost says it is made
template <int b>
__device__ __forceinline__ u32 window_word(const u32 (&w)[3], u32 A, u32 B, u32 o) {
    if constexpr (STATIC_WINDOW) {
        constexpr int s = 48 - b;
        if constexpr (s % 32 == 0) return w[s / 32];
        else if constexpr (s < 32) return funnel(w[1], w[0], s);
        else return funnel(w[2], w[1], s - 32);
    } else if constexpr (b == 0) return B;
    else if constexpr (b == 32) return A;
    else if constexpr (b > 32) return A >> (b - 32);
    else if constexpr (b >= O_MAX) return funnel(w[1], w[0], o + (32 - b));
    else return funnel(B, A, 32 - b);
}

// position 8·lane + j's 16-bit state, one instruction from its word
template <int j>
__device__ __forceinline__ u32 state(const u32 (&ws)[3], u32 A, u32 B, u32 o) {
    constexpr int b = STATE_BASES.b[j], p = (state_off(j) - b) / 8;
    const u32 w = window_word<b>(ws, A, B, o);
    if constexpr (p == 0) return w & 0xFFFFu;
    else if constexpr (p == 1) return __byte_perm(w, 0, 0x4421);
    else return w >> 16;
}

// This lane's A fragment of one 16×16 tile of Ŵᵀ (rows = Ŵ's columns g, g + 8; columns = Ŵ's
// rows) from the three words holding its window (the window starts o bits into w[0])
__device__ __forceinline__ void decode_tile(const u32 (&w)[3], u32 o, u32 xc, u32 (&a)[4]) {
    // window bits 0..63 (not computed where no state's word needs them)
    const u32 A = funnel(w[1], w[0], o), B = funnel(w[2], w[1], o);
    // positions in pairs: Ŵ rows (k) 2t, 2t + 1 (bit r0) at column g; the rows + 8 (r3); both
    // at column g + 8 (c3). Fragment: a[0] (k 2t…, column g), a[1] (k 2t…, g + 8),
    // a[2] (k 2t + 8…, g), a[3] (k 2t + 8…, g + 8).
    a[0] = codebook2(state<0>(w, A, B, o), state<1>(w, A, B, o), xc);
    a[2] = codebook2(state<2>(w, A, B, o), state<3>(w, A, B, o), xc);
    a[1] = codebook2(state<4>(w, A, B, o), state<5>(w, A, B, o), xc);
    a[3] = codebook2(state<6>(w, A, B, o), state<7>(w, A, B, o), xc);
}

__device__ __forceinline__ void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Each warp stages its tile column's k-steps in shared memory, two buffers of 8 tiles (8·WT
// words, in the trellis's own order) filled by cp.async in 16-byte chunks: the global address
// of a chunk is a per-lane offset plus one step per k-step, and a lane's three words of tile i
// are then shared loads at i·WT past three per-lane addresses — no 64-bit address arithmetic
// per tile and word, which the loads straight from global memory cost (~9 instructions a tile,
// the trellis's k-stride being known only at run time).
#define CHUNKS (8 * K2)  // 16-byte chunks of a k-step's 8 tiles: 8 · WT / 4 (≤ 96)
#define LANE_CHUNKS ((CHUNKS + 31) / 32)

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// this lane's chunks (lane, lane + 32, …), from src, into the buffer at shared address dst
// (the caller commits the group)
__device__ __forceinline__ void stage_chunks(const u32* const (&src)[LANE_CHUNKS], u32 dst,
                                             int lane) {
#pragma unroll
    for (int c = 0; c < LANE_CHUNKS; ++c)
        if (lane + 32 * c < CHUNKS)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                         :: "r"(dst + 16 * (lane + 32 * c)), "l"(src[c]) : "memory");
}

// k-step ks's chunks: at goff past the k-step's first tile
__device__ __forceinline__ void stage_w(const u32* __restrict__ col, long long step_words,
                                        int ks, const long long (&goff)[LANE_CHUNKS], u32 dst,
                                        int lane) {
    const u32* src[LANE_CHUNKS];
#pragma unroll
    for (int c = 0; c < LANE_CHUNKS; ++c) src[c] = col + ks * step_words + goff[c];
    stage_chunks(src, dst, lane);
}

__device__ __forceinline__ void commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// this lane's chunks of every k-step, relative to the k-step's first tile: chunk lane + 32c is
// part (lane + 32c) % K2 of tile (lane + 32c) / K2 of the 8 (a k-step is 8 tiles down the column)
__device__ __forceinline__ void chunk_offsets(int lane, int row_words,
                                              long long (&goff)[LANE_CHUNKS]) {
#pragma unroll
    for (int c = 0; c < LANE_CHUNKS; ++c)
        goff[c] = (long long)((lane + 32 * c) / K2) * row_words + 4 * ((lane + 32 * c) % K2);
}

// The three words holding this lane's window of every tile (bits [4·lane·K2 − 16, …),
// wrapping for lane 0): their indexes within a tile, and the window's bit offset in the first
struct Window {
    int wa, wb, wc;
    u32 o;
};

__device__ __forceinline__ Window lane_window(int lane) {
    const int b0 = 4 * lane * K2 - 16;
    const int w0 = b0 >> 5;
    return {(w0 + WT) % WT, (w0 + 1 + WT) % WT, (w0 + 2 + WT) % WT, (u32)(b0 & 31)};
}

#if !PF
// this lane's B fragments (x'ᵀ: k × 8 rows) of the 8 k16 steps of k-step ks for each group of
// 8 tile rows: x' row xq[q] (row 8q + g of the tile), k 2t, 2t + 1 and 2t + 8, 2t + 9. x' comes
// in fragment order (exl3_mma.fragment_order: within each 128-block, lane t's 16 words for the
// 8 steps are contiguous at 32·t), so they are four 16-byte loads — with 16 4-byte loads a
// 6-row step's x' cost 6× the L1 wavefronts of one row's.
// (A row the tile lacks reads some valid row: an MMA's output column depends on its own B
// column only, and such rows are never stored.) x' is written by the kernel this one waits
// for (gdc_wait), so it is read with plain loads that stay below the wait in program order:
// the read-only (.nc) loads a C++ read through the __restrict__ pointer compiles to were
// moved above the wait by ptxas once the first k-step's decode stood before it (wrong tokens
// in graphed decode; tests/gpu: test_a_graphed_early_launch_reads_its_own_replays_input).
__device__ __forceinline__ void load_x(const unsigned short* const (&xp)[RG],
                                       u32 (&x)[RG][8][2]) {
#pragma unroll
    for (int q = 0; q < RG; ++q) {
        const unsigned short* const p = xp[q];  // (x' row xq[q], k-step ks: + 128·ks + 32t)
#pragma unroll
        for (int v = 0; v < 4; ++v)  // steps 2v, 2v + 1: (k 2t…, k 2t + 8…) each
            asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(x[q][2 * v][0]), "=r"(x[q][2 * v][1]),
                           "=r"(x[q][2 * v + 1][0]), "=r"(x[q][2 * v + 1][1])
                         : "l"(p + 8 * v));
    }
}

// the next k-step's x' (xn) becomes this one's
__device__ __forceinline__ void take(u32 (&x)[RG][8][2], const u32 (&xn)[RG][8][2]) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int q = 0; q < RG; ++q) {
            x[q][i][0] = xn[q][i][0];
            x[q][i][1] = xn[q][i][1];
        }
}

// Row r (0 ≤ r < 16) of this program's row tile: its row of x', the partials and the output
// (a pair id when grouped, r itself otherwise), or −1 where the tile has no row r. A grouped
// tile's pairs come before its −1 padding (moe_grouping), so valid rows are a prefix.
__device__ __forceinline__ int tile_row(const int* __restrict__ rows, int tile, int tile_m,
                                        int M, int r) {
#if G
    return r < tile_m ? rows[tile * tile_m + r] : -1;
#else
    return r < M ? r : -1;
#endif
}

// A ragged set's row of the table (RS): its first program, column programs (per split),
// splits, k-steps per split, trellis row words, output width, output dtype (OT's codes),
// then its trellis and svh addresses, its output's byte offset from `out` and row stride,
// its partials' offset from `part`, their row and split strides, its counters' offset from
// `cnt`.
#define SET_ROW 16

// Grid (n_p / (16·NW), S, W · n_tiles); NW warps, warp w owns the tile column NW·blockIdx.x
// + w; block y = split; block z = weight set · n_tiles + row tile (ungrouped: one set, one
// tile of M rows). RS: a 1-D grid, every set's programs (split-major) one after another,
// found through `sets` (n_sets rows; set w's x' at xr + w·sx_set). Strides count elements of
// what they step through (32-bit words for the trellis).
extern "C" __global__ void __launch_bounds__(32 * NW, 16 / NW)
exl3_mma_linear(const unsigned short* __restrict__ xr, const u32* __restrict__ trellis,
                float* __restrict__ part, int* __restrict__ cnt,
                const unsigned short* __restrict__ svh, const void* __restrict__ bias,
                void* __restrict__ out, const int* __restrict__ rows,
                const int* __restrict__ texp, int M, int tile_m, int n_tiles,
                int sxr, long long sx_set, long long str_exp, long long str_set,
                int sp_row, long long sp_split, long long sp_set,
                long long ssvh_e, long long ssvh_set, int so, long long so_set,
                int n_p, int n_out, int k_steps, int per_split, int row_words, double inv_d,
                const long long* __restrict__ sets, int n_sets) {
    __shared__ int last;
    const float inv = (float)inv_d;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
#if RS
    int ws = 0;  // this program's set (a few sets: a scan of their first programs)
    while (ws + 1 < n_sets && (long long)blockIdx.x >= sets[(ws + 1) * SET_ROW]) ++ws;
    const long long* const sr = sets + ws * SET_ROW;
    const int ncp = (int)sr[1];  // column programs per split
    const int local = blockIdx.x - (int)sr[0];
    const int nb = local % ncp, s = local / ncp, S = (int)sr[2];
    per_split = (int)sr[3];
    row_words = (int)sr[4];
    n_out = (int)sr[5];
    const int ot = (int)sr[6];
    trellis = (const u32*)sr[7];
    svh = (const unsigned short*)sr[8];
    out = (void*)((char*)out + sr[9]);
    so = (int)sr[10];
    part = part + sr[11];
    sp_row = (int)sr[12];
    sp_split = sr[13];
    cnt = cnt + sr[14];
    const int tile = 0;
    const long long set = ws;  // (x' only: the set's other tensors are addressed above)
#else
    const int nb = blockIdx.x, s = blockIdx.y, S = gridDim.y, ncp = gridDim.x;
    const int tile = blockIdx.z % n_tiles;
    const long long set = blockIdx.z / n_tiles;
#endif
#if G
    // (the groups were written before the rotate_in this launch may overlap: readable now)
    const int e = texp[tile];
    if (e < 0) return;  // an unused tile: none of its programs writes or counts
#else
    const int e = 0;
#endif
    const int k_lo = s * per_split;
    const int k_hi = min(k_lo + per_split, k_steps);
    // this warp's tile column of this set's (expert's) trellis
    const u32* col = trellis + set * str_set + e * str_exp + (long long)(nb * NW + warp) * WT;
    float* const ps = part + set * sp_set;
    const unsigned short* const x0 = xr + set * sx_set;  // (row 0: every tile's sets have it)
    const unsigned short* xq[RG];
#pragma unroll
    for (int q = 0; q < RG; ++q) {
        const int r = tile_row(rows, tile, tile_m, M, 8 * q + g);
        xq[q] = r >= 0 ? x0 + (long long)r * sxr : x0;
    }

    const Window win = lane_window(lane);
    long long goff[LANE_CHUNKS];
    chunk_offsets(lane, row_words, goff);
    const long long step_words = 8LL * row_words;
    __shared__ __align__(16) u32 stage[NW][2][8 * WT];
    const u32 sbuf[2] = {smem_addr(&stage[warp][0][0]), smem_addr(&stage[warp][1][0])};

    // y'ᵀ of this warp's 16 columns × each row group: columns g, g + 8 × rows 8q + 2t, + 1
    float acc[RG][4];
    zero(acc);
    const u32 xc = xor_constant();
    u32 x[RG][8][2];
    // this lane's trellis chunks and x' words of the k-step being fetched, moved on a k-step at
    // a time: one 64-bit add a pointer and k-step, where the addresses made from ks took a
    // multiply and adds a chunk
    const u32* wsrc[LANE_CHUNKS];
#pragma unroll
    for (int c = 0; c < LANE_CHUNKS; ++c) wsrc[c] = col + k_lo * step_words + goff[c];
    const unsigned short* xp[RG];
#pragma unroll
    for (int q = 0; q < RG; ++q) xp[q] = xq[q] + k_lo * 128 + 32 * t;
    stage_chunks(wsrc, sbuf[0], lane);
    commit();
    // this lane's 4 output columns' svh (and bias) for the output step. One split and 8 warps
    // (y' then comes from shared memory): loaded now, behind the first trellis words — a
    // weight's scales are rarely still in L2, and loaded after the k-loop their latency was the
    // output step's. Otherwise after the arrival count, beside the partials' loads (4 more
    // registers through the k-loop would cost the 4-warp programs occupancy).
    const int c0 = nb / PER_BLOCK * 128 + 4 * lane;
    const unsigned short* const sv = svh + set * ssvh_set + (long long)e * ssvh_e;
    float scale[4];
#if BT >= 0
    float shift[4];
#else
    float* const shift = nullptr;
#endif
#if NW == 8
    load_scales(sv, bias, c0, n_out, scale, shift);
#endif
    // The first k-step's tiles depend on the weights alone: decoded while the kernels before
    // this one (launched early) still run, so only their MMAs wait for x'.
    asm volatile("cp.async.wait_group 0;" ::: "memory");  // (its chunks: own)
    __syncwarp();                                          // (… and the other lanes')
    u32 a0[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const u32* const sw = &stage[warp][0][0];
        const u32 w[3] = {sw[i * WT + win.wa], sw[i * WT + win.wb], sw[i * WT + win.wc]};
        decode_tile(w, win.o, xc, a0[i]);
    }
    // x' comes from the rotate_in launched just before (a no-op without an early launch).
    // Nothing that kernel writes may be read above this line: ptxas may hoist a read-only
    // (.nc, const __restrict__) load above the wait — check the SASS (no LDG before ACQBULK);
    // load_x's loads are plain for that reason.
    gdc_wait();
    load_x(xp, x);
    {   // the first k-step, its tiles decoded above: as the loop below, less the decode
        const bool more = k_lo + 1 < k_hi;
#pragma unroll
        for (int c = 0; c < LANE_CHUNKS; ++c) wsrc[c] += more ? step_words : 0;
#pragma unroll
        for (int q = 0; q < RG; ++q) xp[q] += more ? 128 : 0;
        stage_chunks(wsrc, sbuf[1], lane);
        commit();
        u32 xn[RG][8][2];
        load_x(xp, xn);
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int q = 0; q < RG; ++q) mma(acc[q], a0[i], x[q][i][0], x[q][i][1]);
        take(x, xn);
    }
    int cur = 1;
#pragma unroll 2
    for (int ks = k_lo + 1; ks < k_hi; ++ks) {
        // the next k-step's words (into the other buffer, which every lane finished reading
        // in the previous step) and x' load while this one decodes; the last step re-stages
        // its own into the idle buffer (its sources not moved on), so there is no branch
        const bool more = ks + 1 < k_hi;
#pragma unroll
        for (int c = 0; c < LANE_CHUNKS; ++c) wsrc[c] += more ? step_words : 0;
#pragma unroll
        for (int q = 0; q < RG; ++q) xp[q] += more ? 128 : 0;
        __syncwarp();
        stage_chunks(wsrc, sbuf[cur ^ 1], lane);
        commit();
        u32 xn[RG][8][2];
        load_x(xp, xn);
        asm volatile("cp.async.wait_group 1;" ::: "memory");  // this step's chunks (own)
        __syncwarp();                                          // … and the other lanes'
        const u32* const sw = &stage[warp][cur][0];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const u32 w[3] = {sw[i * WT + win.wa], sw[i * WT + win.wb], sw[i * WT + win.wc]};
            u32 a[4];
            decode_tile(w, win.o, xc, a);
#pragma unroll
            for (int q = 0; q < RG; ++q) mma(acc[q], a, x[q][i][0], x[q][i][1]);
        }
        take(x, xn);
        cur ^= 1;
    }
    asm volatile("cp.async.wait_all;" ::: "memory");  // (the last step's spare copy)
    // the next kernel may launch (it waits for this one's end before it reads or writes
    // anything: strata.kernels.pdl), its launch overlapping this program's partials and tail
    gdc_release();

    // One split with one program per 128-column block (NW = 8, S = 1): the block's y' goes
    // to shared memory and the program finishes it. Otherwise this split's partial goes to
    // global memory and the last of the block's PER_BLOCK·S programs to arrive finishes it.
    constexpr int TR = R16 ? 16 : 8;  // tile rows
#if NW == 8
    __shared__ float ys[TR][128];
    const bool direct = S == 1;
    if (direct) {
#pragma unroll
        for (int q = 0; q < RG; ++q)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                float* y = &ys[8 * q + 2 * t + j][warp * 16 + g];
                y[0] = acc[q][j];
                y[8] = acc[q][2 + j];
            }
        __syncthreads();
    } else
#else
    constexpr bool direct = false;
#endif
    {
        // this split's partial: y' rows 8q + 2t, + 1 at columns g, g + 8 of the warp's 16
#pragma unroll
        for (int q = 0; q < RG; ++q)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int r = tile_row(rows, tile, tile_m, M, 8 * q + 2 * t + j);
                if (r >= 0) {
                    float* p = ps + s * sp_split + (long long)r * sp_row + (nb * NW + warp) * 16
                               + g;
                    p[0] = acc[q][j];
                    p[8] = acc[q][2 + j];
                }
            }
        int* const arrivals = cnt + (long long)blockIdx.z * (ncp / PER_BLOCK)
                              + nb / PER_BLOCK;
        // release (this program's partials before its arrival) and, after the count, acquire
        // (the others' partials): acq_rel fences — a sequentially consistent one
        // (__threadfence) orders more than this needs and costs more
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
        __syncthreads();
        if (threadIdx.x == 0) {
            const int prev = atomicAdd(arrivals, 1);
            last = prev == PER_BLOCK * S - 1;
            if (last) *arrivals = 0;
        }
        __syncthreads();
        if (!last) return;
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
    }
    // warp w finishes tile rows w, w + NW, … together, four splits' loads of every row in
    // flight at once (each row still sums its splits in ascending order from zero): the
    // partials come from L2, and the output step's time is their latency, round after round
#if NW != 8
    load_scales(sv, bias, c0, n_out, scale, shift);
#endif
    constexpr int RPW = TR / NW;  // rows per warp
    int rq[RPW];
    float v[RPW][4];
#pragma unroll
    for (int q = 0; q < RPW; ++q) {
        rq[q] = tile_row(rows, tile, tile_m, M, warp + NW * q);
#pragma unroll
        for (int j = 0; j < 4; ++j) v[q][j] = 0.f;
    }
#if NW == 8
    if (direct) {  // (0 + y': the value the one-split sum below gives)
#pragma unroll
        for (int q = 0; q < RPW; ++q)
#pragma unroll
            for (int j = 0; j < 4; ++j) v[q][j] = v[q][j] + ys[warp + NW * q][4 * lane + j];
    }
#endif
#pragma unroll 4
    for (int s2 = 0; s2 < (direct ? 0 : S); ++s2) {
#pragma unroll
        for (int q = 0; q < RPW; ++q) {
            if (rq[q] >= 0) {
                const float4 p = __ldcg(
                    (const float4*)(ps + s2 * sp_split + (long long)rq[q] * sp_row + c0));
                v[q][0] = v[q][0] + p.x; v[q][1] = v[q][1] + p.y;
                v[q][2] = v[q][2] + p.z; v[q][3] = v[q][3] + p.w;
            }
        }
    }
#pragma unroll
    for (int q = 0; q < RPW; ++q) {
        if (rq[q] < 0) continue;  // (uniform across the warp: the shuffles stay converged)
        fwht128(v[q], lane);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int c = c0 + j;
            float y = v[q][j] * inv;
            y = y * scale[j];
#if BT >= 0
            y = y + shift[j];
#endif
#if RS
            if (c < n_out) store_as(out, (long long)rq[q] * so + c, y, ot);
#else
            if (c < n_out) store_out(out, set * so_set + (long long)rq[q] * so + c, y);
#endif
        }
    }
}
#endif  // !PF

#if PF
// ------------------------------------------------------------------------------------------
// exl3_moe_linear's grouped step for many (token, slot) pairs — a prefill chunk's — on row
// tiles of TM = 8·RG pairs sharing an expert (strata.kernels.moe_grouping, block TM). A program
// is one 128-column block (NW = 8 warps, a tile column each) of one tile: it runs the splits of
// the whole k range itself, each an MMA chain from zero, adding them in ascending order from
// zero (the Triton split loop's arithmetic, so its bits), and finishes the block in shared
// memory (output Hadamard, ·svh) as the decode kernel's one-split path does. The tile's x' rows
// are staged per k-step in shared memory for all 8 warps (cp.async, 16-byte chunks, swizzled
// so that ldmatrix reads 8 rows without bank conflicts): each Ŵᵀ tile a lane decodes meets all
// TM rows (RG MMAs), so an expert's weights are decoded once per TM of its pairs.
// Three stages of x' and trellis words (one barrier a k-step: the stage a step fills was last
// read two steps before, which every warp finished before the previous step's barrier), and
// the splits' sum kept in shared memory, not registers: the registers left let the compiler
// overlap the tiles' decode chains (measured: the decode's latency, not a pipe, bound it).
#define TM (8 * RG)
#define XS_BYTES (TM * 256)  // a k-step of the tile's x': TM rows × 128 fp16
#define YS_STRIDE 132        // fp32 y' row (padded: conflict-free accesses)
#define STAGES 3
#if NW != 8 || RG % 2 || RG < 2
#error "exl3_mma_prefill: NW = 8 and an even RG"
#endif
#if RG > 16
#error "exl3_mma_prefill: tiles of at most 128 rows"
#endif
#if WG && WD != 1 && WD != 2 && WD != 4
#error "exl3_mma_prefill: WD is 1, 2 or 4"
#endif

// B fragments of two groups of 8 rows for one k16 step: lanes 8m … 8m + 7 address the 8 rows
// of matrix m (group 2·qp + m / 2, k half m % 2)
__device__ __forceinline__ void ldsm4(u32 addr, u32 (&b)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "r"(addr));
}

#if WG
// wgmma (sm_90a): the warpgroup's 4 warps multiply their decoded 16-column tiles — the same A
// fragments as mma.sync's, rows 16·(warp % 4) … of the group's 64 — with the tile's x' rows
// straight from shared memory, 16·NQ of them, in one asynchronous instruction. D's registers
// are mma.sync's C fragments of each group of 8 rows in turn (acc[q]), so the chain and its
// bits are the same: D = A·B + D over ascending k16 steps from zero.
__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}

// x' of a k-step as wgmma reads it: each 64-column half (k 0–63, 64–127) a region of TM rows of
// 128 bytes, 16-byte chunk c of row r at chunk c ^ (r % 8) — the 128-byte swizzle, whose pattern
// repeats every 8 rows (1,024 bytes, so the regions start on such a boundary). The B descriptor
// of k16 step kk: start at its half's region + 32·(kk % 4) bytes (bits 0–13: address / 16), 8-row
// groups 1,024 bytes apart (the stride, bits 32–45: 1,024 / 16), swizzle mode 1 (128 bytes, bits
// 62–63); the leading offset (bits 16–29) is unused at this swizzle. The low word is made once a
// stage (x_desc_lo) and each k16 step adds its constant: shared addresses stay below 2¹⁸ bytes,
// so the sum never carries out of the address field.
__device__ __forceinline__ u32 x_desc_lo(u32 stage_addr) {
    return ((stage_addr & 0x3FFFF) >> 4) | (1u << 16);
}
__device__ __forceinline__ unsigned long long x_desc(u32 lo, int kk) {
    const u32 HI = (1024u >> 4) | (1u << 30);
    return ((unsigned long long)HI << 32) | (lo + (((kk >> 2) * (TM * 128) + (kk & 3) * 32) >> 4));
}

// c[0 … 2·NQ − 1] += Â·x'ᵀ for one k16 step and 16·NQ rows, NQ 1, 2 or 4: one instruction
// (scale-d 1: accumulate; A, B not negated, B not transposed: K-major as stored)
template <int NQ>
__device__ __forceinline__ void wgmma_one(float (*c)[4], const u32 (&a)[4],
                                          unsigned long long desc) {
    const u32 one = 1;
    if constexpr (NQ == 1) {
        asm volatile(
            "{ .reg .pred p; setp.ne.b32 p, %13, 0;\n\t"
            "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0; }"
            : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]),
              "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]), "+f"(c[1][3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(one));
    } else if constexpr (NQ == 2) {
        asm volatile(
            "{ .reg .pred p; setp.ne.b32 p, %21, 0;\n\t"
            "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
            "{%16, %17, %18, %19}, %20, p, 1, 1, 0; }"
            : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]),
              "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]), "+f"(c[1][3]),
              "+f"(c[2][0]), "+f"(c[2][1]), "+f"(c[2][2]), "+f"(c[2][3]),
              "+f"(c[3][0]), "+f"(c[3][1]), "+f"(c[3][2]), "+f"(c[3][3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(one));
    } else {
        static_assert(NQ == 4, "wgmma: 16, 32 or 64 rows");
        asm volatile(
            "{ .reg .pred p; setp.ne.b32 p, %37, 0;\n\t"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
            "{%32, %33, %34, %35}, %36, p, 1, 1, 0; }"
            : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]),
              "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]), "+f"(c[1][3]),
              "+f"(c[2][0]), "+f"(c[2][1]), "+f"(c[2][2]), "+f"(c[2][3]),
              "+f"(c[3][0]), "+f"(c[3][1]), "+f"(c[3][2]), "+f"(c[3][3]),
              "+f"(c[4][0]), "+f"(c[4][1]), "+f"(c[4][2]), "+f"(c[4][3]),
              "+f"(c[5][0]), "+f"(c[5][1]), "+f"(c[5][2]), "+f"(c[5][3]),
              "+f"(c[6][0]), "+f"(c[6][1]), "+f"(c[6][2]), "+f"(c[6][3]),
              "+f"(c[7][0]), "+f"(c[7][1]), "+f"(c[7][2]), "+f"(c[7][3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(one));
    }
}

// acc[0 … 2·NQ − 1] += Â·x'ᵀ for one k16 step, NQ 1 … RG / 2: instructions of 64 rows, then
// one of 32 and one of 16 as NQ needs (each row's products are one instruction's, so the
// bits do not depend on how the rows are cut). Rows 16·q on start at q·16·128 bytes.
template <int NQ>
__device__ __forceinline__ void wgmma(float (&c)[RG][4], const u32 (&a)[4],
                                      unsigned long long desc) {
    constexpr int N64 = NQ / 4 * 4;  // rows in instructions of 64
#pragma unroll
    for (int q = 0; q < N64; q += 4) wgmma_one<4>(&c[2 * q], a, desc + q * 128);
    if constexpr (NQ - N64 >= 2) wgmma_one<2>(&c[2 * N64], a, desc + N64 * 128);
    if constexpr ((NQ - N64) % 2) wgmma_one<1>(&c[2 * (NQ - 1)], a, desc + (NQ - 1) * 128);
}

// Pins: the compiler sees neither wgmma's late reads of its A registers nor its late writes of
// D. A use of the A values after the wait that covers them keeps their registers unchanged
// until then; a redefinition of D after the wait keeps D's readers below it.
__device__ __forceinline__ void keep(const u32 (&a)[4]) {
    asm volatile("" :: "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]) : "memory");
}
template <int NQ>
__device__ __forceinline__ void settle(float (&c)[RG][4]) {
#pragma unroll
    for (int q = 0; q < 2 * NQ; ++q)
        asm volatile("" : "+f"(c[q][0]), "+f"(c[q][1]), "+f"(c[q][2]), "+f"(c[q][3]) :: "memory");
}
#endif

// A program's work for tiles whose valid rows fill NQ pairs of 8-row groups (a compile-time
// count: a run-time bound inside the unrolled tiles would split them into blocks the
// compiler cannot interleave); the kernel below picks the copy.
template <int NQ>
__device__ __forceinline__ void
prefill_block(const unsigned short* __restrict__ xr, const u32* __restrict__ trellis,
              const unsigned short* __restrict__ svh, void* __restrict__ out,
              const int* __restrict__ rows, int n_tiles, int sxr, long long sx_set,
              long long str_exp, long long str_set, long long ssvh_e, long long ssvh_set, int so,
              long long so_set, int n_out, int k_steps, int per_split, int row_words,
              double inv_d, int e, int nv) {
    extern __shared__ __align__(16) unsigned char smem_[];
#if WG
    // (the swizzle's 1,024-byte boundary; moe_prefill asks for 1,024 bytes more)
    unsigned char* const smem = smem_ + ((1024u - (smem_addr(smem_) & 1023u)) & 1023u);
#else
    unsigned char* const smem = smem_;
#endif
    const float inv = (float)inv_d;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int nb = blockIdx.x;
    const int tile = blockIdx.y % n_tiles;
    const long long set = blockIdx.y / n_tiles;
    const int* const trow = rows + (long long)tile * TM;
    const u32* col = trellis + set * str_set + e * str_exp + (long long)(nb * NW + warp) * WT;
    const unsigned short* const x0 = xr + set * sx_set;

    const u32 xs = smem_addr(smem);  // x' stage b at xs + b·XS_BYTES
    u32* const stage = (u32*)(smem + STAGES * XS_BYTES) + warp * STAGES * 8 * WT;
    const u32 sbuf0 = smem_addr(stage);  // this warp's trellis stage b at sbuf0 + b·32·WT bytes
    float* const ys = (float*)(smem + STAGES * XS_BYTES) + NW * STAGES * 8 * WT;
    const Window win = lane_window(lane);
    long long goff[LANE_CHUNKS];
    chunk_offsets(lane, row_words, goff);
    const long long step_words = 8LL * row_words;

    // this thread's x' chunks of a k-step: chunk c = threadIdx.x + 256j is row c / 16 (a pair's
    // x' row; a row the tile lacks is zero-filled, nothing read: never stored), 16-byte column
    // c % 16, stored at column (c % 16) ^ (row % 8) — for wgmma in its half's region (x_desc)
    constexpr int XC = TM / 16;
    const char* xsrc[XC];
    u32 xdst[XC], xlen[XC];
#pragma unroll
    for (int j = 0; j < XC; ++j) {
        const int c = threadIdx.x + 256 * j, r = c >> 4, cc = c & 15;
        const int pr = r < nv ? trow[r] : -1;
        xsrc[j] = (const char*)(x0 + (pr >= 0 ? (long long)pr * sxr : 0LL)) + 16 * cc;
#if WG
        xdst[j] = (cc >> 3) * (TM * 128) + r * 128 + (((cc & 7) ^ (r & 7)) << 4);
#else
        xdst[j] = r * 256 + ((cc ^ (r & 7)) << 4);
#endif
        xlen[j] = pr >= 0 ? 16 : 0;
    }
#if !WG
    // this lane's ldmatrix row: tile row 16·qp + lrow, 16-byte column (2i + half) ^ (lrow % 8)
    const int lrow = 8 * (lane >> 4) + (lane & 7), half = (lane >> 3) & 1;
#endif
    // this lane's y' elements: rows 8q + 2t + j, columns 16·warp + g (+ 8)
    float* const yl = ys + 2 * t * YS_STRIDE + warp * 16 + g;

    float acc[RG][4];  // this split's chain
    zero(acc);
    const u32 xc = xor_constant();

    stage_w(col, step_words, 0, goff, sbuf0, lane);
    commit();
    // x' comes from the rotate_in launched just before (a no-op without an early launch)
    gdc_wait();
#pragma unroll
    for (int j = 0; j < XC; ++j)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                     :: "r"(xs + xdst[j]), "l"(xsrc[j]), "r"(xlen[j]) : "memory");
    commit();
    bool first = true;  // the first split: y' = 0 + its chain
    int cur = 0;
    for (int ks = 0; ks < k_steps; ++ks) {
        // the next k-step (the last re-stages its own: no branch) into the next stage
        const int kn = min(ks + 1, k_steps - 1), nx = cur == STAGES - 1 ? 0 : cur + 1;
        stage_w(col, step_words, kn, goff, sbuf0 + nx * 32 * WT, lane);
#pragma unroll
        for (int j = 0; j < XC; ++j)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                         :: "r"(xs + nx * XS_BYTES + xdst[j]), "l"(xsrc[j] + 256LL * kn),
                            "r"(xlen[j]) : "memory");
        commit();
        asm volatile("cp.async.wait_group 1;" ::: "memory");  // this step's (own) chunks
#if WG
        // (cp.async wrote through the generic proxy; wgmma reads through the async one)
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
        __syncthreads();                                       // … and every thread's
        const u32* const sw = stage + cur * 8 * WT;
#if WG
        // tiles decoded WD at a time (their chains interleave), then their wgmmas in tile
        // order; tile i's A in ab[i % 2WD], decoded into again 2WD tiles on, after the wait
        // that leaves only the last WD groups in flight
        u32 ab[2 * WD][4];
        const u32 dlo = x_desc_lo(xs + cur * XS_BYTES);
#pragma unroll
        for (int i0 = 0; i0 < 8; i0 += WD) {
#pragma unroll
            for (int i = i0; i < i0 + WD; ++i) {
                const u32 w[3] = {sw[i * WT + win.wa], sw[i * WT + win.wb], sw[i * WT + win.wc]};
                decode_tile(w, win.o, xc, ab[i % (2 * WD)]);
            }
            wgmma_fence();
#pragma unroll
            for (int i = i0; i < i0 + WD; ++i) {
                wgmma<NQ>(acc, ab[i % (2 * WD)], x_desc(dlo, i));
                wgmma_commit();
            }
            if (i0 + WD < 8) {
                wgmma_wait<WD>();
#pragma unroll
                for (int i = i0 - WD; i >= 0 && i < i0; ++i) keep(ab[i % (2 * WD)]);
            }
        }
        wgmma_wait<0>();  // (the k-step's last: its stage is refilled two steps on, D read below)
#pragma unroll
        for (int i = 0; i < 2 * WD; ++i) keep(ab[i]);
        settle<NQ>(acc);
#else
        const u32 xb = xs + cur * XS_BYTES + lrow * 256;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const u32 w[3] = {sw[i * WT + win.wa], sw[i * WT + win.wb], sw[i * WT + win.wc]};
            u32 a[4];
            decode_tile(w, win.o, xc, a);
            const u32 xo = xb + (((2 * i + half) ^ (lane & 7)) << 4);
#pragma unroll
            for (int qp = 0; qp < NQ; ++qp) {
                u32 b[4];
                ldsm4(xo + qp * 16 * 256, b);
                mma(acc[2 * qp], a, b[0], b[1]);
                mma(acc[2 * qp + 1], a, b[2], b[3]);
            }
        }
#endif
        if ((ks + 1) % per_split == 0 || ks + 1 == k_steps) {  // a split ends (uniform)
            // (each lane adds to its own elements only: no barrier)
#pragma unroll
            for (int q = 0; q < 2 * NQ; ++q)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    float* y = yl + (8 * q + j) * YS_STRIDE;
                    y[0] = (first ? 0.f : y[0]) + acc[q][j];
                    y[8] = (first ? 0.f : y[8]) + acc[q][2 + j];
                    acc[q][j] = acc[q][2 + j] = 0.f;
                }
            first = false;
        }
        cur = nx;
    }
    asm volatile("cp.async.wait_all;" ::: "memory");  // (the last step's spare copies)
    __syncthreads();  // every warp's y' columns
    // warp w finishes tile rows w, w + 8, …: (0 + y'), Hadamard, ·inv, ·svh — the decode
    // kernel's one-split output step
    const int c0 = nb * 128 + 4 * lane;
    const unsigned short* const sv = svh + set * ssvh_set + (long long)e * ssvh_e;
    float scale[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) scale[j] = h2f(sv[c0 + j]);
    for (int r = warp; r < TM; r += NW) {
        const int pr = trow[r];
        if (pr < 0) break;  // (the valid rows are a prefix; uniform across the warp)
        float v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = 0.f + ys[r * YS_STRIDE + 4 * lane + j];
        fwht128(v, lane);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int c = c0 + j;
            float y = v[j] * inv;
            y = y * scale[j];
            if (c < n_out) store_out(out, set * so_set + (long long)pr * so + c, y);
        }
    }
}

// Grid (n_p / 128, W · n_tiles), 256 threads. Dynamic shared memory: STAGES x' stages
// (STAGES·XS_BYTES), the warps' trellis stages (NW·STAGES·8·WT words), y' [TM][YS_STRIDE]
// fp32 — moe_prefill's `shared`. Strides in elements of what they step through (32-bit words
// for the trellis).
extern "C" __global__ void __launch_bounds__(256, MINB)
exl3_mma_prefill(const unsigned short* __restrict__ xr, const u32* __restrict__ trellis,
                 const unsigned short* __restrict__ svh, void* __restrict__ out,
                 const int* __restrict__ rows, const int* __restrict__ texp, int n_tiles,
                 int sxr, long long sx_set, long long str_exp, long long str_set,
                 long long ssvh_e, long long ssvh_set, int so, long long so_set,
                 int n_out, int k_steps, int per_split, int row_words, double inv_d) {
    // (the groups were written before the rotate_in this launch may overlap: readable now)
    const int tile = blockIdx.y % n_tiles, lane = threadIdx.x & 31;
    const int e = texp[tile];
    if (e < 0) return;  // an unused tile
    // The tile's valid rows are a prefix (moe_grouping fills a tile's lanes in order). An
    // expert's last tile is often nearly empty (a 4,096-token chunk: ~64 ± 8 pairs an expert,
    // so about half the experts have a second tile of a few pairs): only the row groups that
    // hold a valid row are multiplied.
    const int* const trow = rows + (long long)tile * TM;
    int nv = 0;
#pragma unroll
    for (int r0 = 0; r0 < TM; r0 += 32)
        nv += __popc(__ballot_sync(0xffffffffu, r0 + lane < TM && trow[r0 + lane] >= 0));
    const int nq = (nv + 15) >> 4;  // (uniform)
#define PREFILL_ARGS xr, trellis, svh, out, rows, n_tiles, sxr, sx_set, str_exp, str_set, \
    ssvh_e, ssvh_set, so, so_set, n_out, k_steps, per_split, row_words, inv_d, e, nv
    // a copy for each count of pairs of groups, 1 … RG / 2 (the first copy at RG / 2 returns
    // unconditionally: the ones after it are unreachable and dropped at compile time)
#define COPY(n) \
    if ((n) >= RG / 2 || nq <= (n)) { \
        prefill_block<((n) < RG / 2 ? (n) : RG / 2)>(PREFILL_ARGS); \
        return; \
    }
    COPY(1) COPY(2) COPY(3) COPY(4) COPY(5) COPY(6) COPY(7) COPY(8)
#undef COPY
#undef PREFILL_ARGS
}
#endif  // PF
