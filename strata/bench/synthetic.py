"""A synthetic V4.1-Flash: the real config, shapes and stored formats with random weights made
directly in device memory (no checkpoint, no disk for weights), for measuring speed at full
size where the real checkpoint cannot be had.

`SyntheticWeights` stands in for the WeightReader: the model code asks for tensors by checkpoint
name and shape exactly as when loading, and gets random data of the stored encoding —
EXL3 trellises at a per-group bit width (the default mix is about 2.7 bits per weight
overall: routed experts 2.5/3, attention and shared experts 4, head 6) or the official fp8
tiles / fp4 groups. Values are scaled so activations keep unit-order magnitudes through 40
layers (the numbers are meaningless, but no inf/NaN changes the work done).

Engram tables (384M rows each in V4.1, ~101 GB per table) are folded onto a bounded number of
rows: a row id r reads row r mod `engram_rows`, so lookups keep the real id stream and access
pattern (random rows, 2×24 per token) over a table that fits. `engram="disk"` writes the folded
table as packed records to a file and reads it through the Engram store, like the real thing.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

from strata.argtypes import COUNT, NONNEGATIVE, SEED, THREADS, count_or_auto
from strata.config import ModelConfig
from strata.engram_store import IO_THREADS
from strata.quant.exl3 import Exl3Linear
from strata.quant.linear import DenseLinear, Fp4Group32Linear, Fp8Block32Linear, Linear
from strata.tokenizer import tokenizer_path

# Default EXL3 bits per weight by tensor group (half-integer K needs the mul1 codebook).
DEFAULT_BITS = {"experts.w1": 2.5, "experts.w3": 2.5, "experts.w2": 3.0, "mtp_experts": 3.0,
                "head": 6.0, "other": 4.0}


def exl3_group(name: str) -> str:
    """The bit-mix group of a linear's checkpoint prefix."""
    if name == "head":
        return "head"
    if ".ffn.experts." in name:
        if name.startswith("mtp."):
            return "mtp_experts"
        return "experts." + name.rsplit(".", 1)[1]
    return "other"


@dataclass
class SyntheticWeights:
    """Random stored tensors on `device`, by checkpoint name (the WeightReader interface)."""

    cfg: ModelConfig
    device: torch.device
    fmt: str = "exl3"                      # "exl3" or "official" (fp8 dense, fp4 experts)
    bits: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_BITS))
    seed: int = 0
    engram: str = "device"                 # "device" or "disk"
    engram_rows: int = 1 << 20             # rows each folded Engram table keeps
    engram_dir: Path | None = None         # where engram="disk" writes its table files
    engram_io_threads: int = IO_THREADS    # engram="disk": each store's reading threads
    stored_bytes: dict[str, int] = field(default_factory=dict)  # by group, for reports
    weights: dict[str, int] = field(default_factory=dict)       # quantized weights by group
    linear_weights: dict[str, int] = field(default_factory=dict)  # … by linear (prefix)
    # Bytes by checkpoint-like tensor name (the placement planner's input); on the "meta"
    # device nothing is allocated, so the full model's sizes come for free.
    tensor_bytes: dict[str, int] = field(default_factory=dict)
    folded_bytes: dict[str, int] = field(default_factory=dict)  # engram="device": by table

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        if self.fmt not in ("exl3", "official"):
            raise ValueError(f"synthetic format {self.fmt!r}: expected 'exl3' or 'official'")
        if self.engram not in ("device", "disk"):
            raise ValueError(f"engram={self.engram!r}: expected 'device' or 'disk'")
        self.meta = self.device.type == "meta"
        self.gen = None
        self.used: set[str] = set()

    def _start(self, name: str) -> None:
        """Every tensor's values come from a generator seeded by (seed, its name), so any
        process that builds a tensor — one device, a layer-split rank, a tensor-parallel rank
        building only its shards — builds the same values."""
        self.used.add(name)
        if not self.meta:
            key = zlib.crc32(name.encode()) ^ (self.seed * 0x9E3779B1 & 0xFFFFFFFF)
            self.gen = torch.Generator(device=self.device).manual_seed(key)

    # ---- helpers ---------------------------------------------------------------------------
    def _count(self, group: str, t: torch.Tensor, name: str) -> torch.Tensor:
        n = t.numel() * t.element_size()
        self.stored_bytes[group] = self.stored_bytes.get(group, 0) + n
        self.tensor_bytes[name] = n
        return t

    def _randn(self, shape, scale: float, dtype=torch.float32) -> torch.Tensor:
        if self.meta:
            return torch.empty(shape, dtype=dtype, device="meta")
        return (torch.randn(shape, generator=self.gen, device=self.device) * scale).to(dtype)

    def _ints(self, shape, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        if self.meta:
            return torch.empty(shape, dtype=dtype, device="meta")
        return torch.randint(lo, hi, shape, generator=self.gen, device=self.device,
                             dtype=torch.int32).to(dtype)

    def _bytes(self, shape, lo: int = 0, hi: int = 256) -> torch.Tensor:
        return self._ints(shape, lo, hi, torch.uint8)

    def _signs(self, n: int, scale: float | None = None) -> torch.Tensor:
        """n random ±1 (times scale) in fp16. (On the meta device no arithmetic: there each
        op runs torch's Python meta functions, ~0.2 ms, and a full-size plan makes ~10⁵.)"""
        s = self._ints((n,), 0, 2, torch.float16)
        if self.meta:
            return s
        s = s * 2 - 1
        return s if scale is None else s * scale

    # ---- the WeightReader interface --------------------------------------------------------
    def has(self, name: str) -> bool:
        return False  # optional tensors (bias_vl, biases) are absent, as in V4.1 text weights

    def tensor(self, name: str, dtype: str | tuple[str, ...] | None = None,
               shape: tuple[int, ...] | None = None) -> torch.Tensor:
        self._start(name)
        want = dtype if isinstance(dtype, str) else (dtype or ("BF16",))[0]
        if want in ("BF16", "F32", "F16"):
            torch_dtype = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}[want]
            return self._count("dense", self._randn(shape, 0.02, torch_dtype), name)
        raise ValueError(f"synthetic tensor {name}: dtype {want} is not generated")

    def float_tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        self._start(name)
        if re.search(r"norm\.weight$|q_weight$|k_weight$", name):
            t = torch.ones(shape, device=self.device)
        elif name.endswith(("gate.bias", "attn_sink", "_base")):
            t = torch.zeros(shape, device=self.device)
        else:
            t = self._randn(shape, 0.02)
        return self._count("dense", t, name)

    def linear(self, prefix: str, out_features: int, in_features: int) -> Linear:
        self._start(prefix)
        if prefix.endswith(".gate"):  # the router stays unquantized in every format
            return DenseLinear(self._count("dense", self._randn((out_features, in_features),
                                                                in_features ** -0.5,
                                                                torch.bfloat16),
                                           f"{prefix}.weight"))
        group = exl3_group(prefix)
        self.weights[group] = self.weights.get(group, 0) + out_features * in_features
        self.linear_weights[prefix] = out_features * in_features
        if self.fmt == "exl3":
            return self._exl3(group, prefix, out_features, in_features)
        if ".ffn.experts." in prefix:
            return self._fp4(group, prefix, out_features, in_features)
        return self._fp8(group, prefix, out_features, in_features)

    def linear_groups(self, prefix: str, groups: int, out_per_group: int,
                      in_features: int) -> list[Linear]:
        return [self.linear(f"{prefix}.slice.{g}", out_per_group, in_features)
                for g in range(groups)]

    def engram_table(self, prefix: str, n_rows: int, dim: int):
        self._start(prefix)
        # The full table's size for plans (it stays on disk); a folded one to run.
        self.tensor_bytes[f"{prefix}.weight"] = n_rows * dim
        self.tensor_bytes[f"{prefix}.scale"] = n_rows * (dim // 32)
        rows = min(n_rows, self.engram_rows)
        if self.engram == "device":
            self.folded_bytes[prefix] = rows * (dim + dim // 32)
        values = self._bytes((rows, dim)) & 0x77        # e4m3 without NaN codes
        scales = self._bytes((rows, dim // 32), 118, 126)
        if self.engram == "device":
            return FoldedTable(_DeviceRows(values, scales), rows)
        from strata.engram_store import EngramStore, RowSource, pack_records
        if self.engram_dir is None:
            raise ValueError("engram='disk' needs engram_dir")
        path = Path(self.engram_dir) / f"{prefix}.engram"
        path.parent.mkdir(parents=True, exist_ok=True)
        pack_records(values.cpu(), scales.cpu()).tofile(path)
        return FoldedTable(EngramStore(RowSource.packed(path, rows, dim), self.device,
                                       io_threads=self.engram_io_threads), rows)

    # ---- stored encodings ------------------------------------------------------------------
    def _exl3(self, group: str, prefix: str, out_features: int, in_features: int) -> Exl3Linear:
        K = self.bits.get(group, self.bits["other"])
        kp, np_ = -(-in_features // 128) * 128, -(-out_features // 128) * 128
        L = int(16 * K) if K == int(K) else int(16 * (K - 0.5)) + 8
        trellis = self._ints((kp // 16, np_ // 16, L), -32768, 32768, torch.int16)
        suh = self._signs(kp)
        svh = self._signs(np_, 1.0 / math.sqrt(in_features))  # keeps |y| ≈ |x|
        codebook = "mul1" if K != int(K) else "3inst"
        for part, t in (("trellis", trellis), ("suh", suh), ("svh", svh)):
            self._count(group, t, f"{prefix}.{part}")
        return Exl3Linear(trellis, suh, svh, codebook, out_features, in_features)

    def _fp8(self, group: str, prefix: str, out_features: int,
             in_features: int) -> Fp8Block32Linear:
        w = self._bytes((out_features, in_features)) & 0x77  # |e4m3| ≤ ~240·2^-? , no NaN
        w = w | (self._bytes((out_features, in_features), 0, 2) << 7)  # random sign
        e = 127 - 7 - round(math.log2(math.sqrt(in_features)))
        s = torch.full((-(-out_features // 32), -(-in_features // 32)), e, dtype=torch.uint8,
                       device=self.device)
        return Fp8Block32Linear(self._count(group, w.view(torch.float8_e4m3fn),
                                            f"{prefix}.weight"),
                                self._count(group, s, f"{prefix}.scale"))

    def _fp4(self, group: str, prefix: str, out_features: int,
             in_features: int) -> Fp4Group32Linear:
        w = self._bytes((out_features, in_features // 2)).view(torch.int8)
        e = 127 - 2 - round(math.log2(math.sqrt(in_features)))
        s = torch.full((out_features, in_features // 32), e, dtype=torch.uint8,
                       device=self.device)
        return Fp4Group32Linear(self._count(group, w, f"{prefix}.weight"),
                                self._count(group, s, f"{prefix}.scale"))

    def bits_per_weight(self) -> float:
        """Average stored bits per weight of the quantized linears made so far (trellis,
        suh/svh or fp8/fp4 bytes and their scales, padding included)."""
        quant = sum(v for k, v in self.stored_bytes.items() if k != "dense")
        return 8 * quant / max(sum(self.weights.values()), 1)


def step_traffic(w: SyntheticWeights, rows: int) -> tuple[int, int]:
    """(bytes read, quantized weights decoded) by one decode forward of `rows` rows over the
    tensors `w` made: every tensor once, except that of the routed experts only the at most
    rows × top-k distinct ones of n are read (an upper bound: rows may share experts), and
    that the embedding and the Engram tables (a few rows each; Engram lives on the host in the
    real engine) and the DSpark stages (read when drafting, not verifying) are left out. KV
    cache reads are left out too: at a decode benchmark's short contexts they are MBs."""
    cfg = w.cfg
    share = min(rows * cfg.num_experts_per_tok, cfg.n_routed_experts) / cfg.n_routed_experts

    def part(name: str) -> float:
        if name.startswith("mtp.") or name == "embed.weight" or ".engram.embed." in name:
            return 0.0
        return share if ".ffn.experts." in name else 1.0

    read = sum(n * part(name) for name, n in w.tensor_bytes.items())
    decoded = sum(n * part(prefix + ".") for prefix, n in w.linear_weights.items())
    return round(read), round(decoded)


def kernel_rates(cfg: ModelConfig, device: torch.device, fmt: str) -> dict[str, float]:
    """The rates a decode roofline is set against, measured on `device` now: the copy bandwidth
    (GB/s, bytes read + written) and the quantized linear kernel's decode rate (weights/s) on
    one large linear — the head's shape at the routed experts' bits, one row, graphed, so
    neither launches nor a small matrix's tail count against the kernel."""
    from strata.bench.kernels import Timer, copy_bandwidth
    from strata.model.numerics import Numerics
    device = torch.device(device)
    small = device.type != "cuda"
    timer = Timer(device, warmup=25, rep=100, smoke=small)
    copy = copy_bandwidth(device, timer, (1 << 20) if small else (1 << 30))
    probe = SyntheticWeights(cfg, device, fmt=fmt, bits={"other": DEFAULT_BITS["experts.w1"]})
    linear = probe.linear("roofline_probe", cfg.vocab_size, cfg.hidden_size)
    nx = Numerics.for_device(device)
    x = torch.randn((1, cfg.hidden_size), device=device).to(nx.act_dtype)
    us = timer(lambda: linear(x, nx))
    del linear, probe
    if device.type == "cuda":
        torch.cuda.empty_cache()
    rate = cfg.vocab_size * cfg.hidden_size / (us * 1e-6)
    return {"copy_gb_per_s": copy, "linear_weights_per_s": rate}


def roofline(w: SyntheticWeights, results: dict, rates: dict[str, float]) -> dict[str, dict]:
    """Per mode: what a token read and decoded (step_traffic over the forward's rows, divided
    by the tokens it committed), the rates that implies at the measured tok/s, and the tok/s
    the measured copy bandwidth and kernel rate alone would allow."""
    out = {}
    for mode, r in results.items():
        # a verify window: the last committed token and its drafts (their mean count: a
        # fixed or adaptive length, and the run's last windows cut short)
        rows = round(1 + r.drafted / r.windows) if r.windows else 1
        read, decoded = step_traffic(w, rows)
        per_tok = max(r.mean_committed, 1e-9)
        gb, gw = read / per_tok / 1e9, decoded / per_tok / 1e9
        out[mode] = {"rows": rows, "gb_per_token": gb, "gweights_per_token": gw,
                     "gb_per_s": gb * r.median, "tweights_per_s": gw * r.median / 1e3,
                     "of_copy": gb * r.median / rates["copy_gb_per_s"],
                     "of_kernel": gw * 1e9 * r.median / rates["linear_weights_per_s"],
                     "bandwidth_floor_tok_per_s": rates["copy_gb_per_s"] / gb,
                     "kernel_floor_tok_per_s": rates["linear_weights_per_s"] / (gw * 1e9)}
    return out


def roofline_report(roof: dict[str, dict], rates: dict[str, float]) -> str:
    lines = [f"roofline per token (held layers; routed experts at rows × top-k distinct, an "
             f"upper bound; measured now: copy {rates['copy_gb_per_s']:.0f} GB/s, linear kernel "
             f"{rates['linear_weights_per_s'] / 1e12:.2f} Tweights/s):",
             f"{'mode':<20}{'rows':>5}{'GB/tok':>8}{'Gw/tok':>8}{'GB/s':>8}{'of copy':>9}"
             f"{'Tw/s':>7}{'of kernel':>10}{'floor tok/s (bw / kernel)':>27}"]
    for mode, x in roof.items():
        lines.append(f"{mode:<20}{x['rows']:>5}{x['gb_per_token']:>8.2f}"
                     f"{x['gweights_per_token']:>8.2f}{x['gb_per_s']:>8.0f}{x['of_copy']:>9.1%}"
                     f"{x['tweights_per_s']:>7.2f}{x['of_kernel']:>10.1%}"
                     f"{x['bandwidth_floor_tok_per_s']:>18.0f} / "
                     f"{x['kernel_floor_tok_per_s']:.0f}")
    return "\n".join(lines)


class _DeviceRows:
    """Folded table rows held on the device, looked up like EngramTable."""

    def __init__(self, values: torch.Tensor, scales: torch.Tensor) -> None:
        self.values, self.scales = values.view(torch.float8_e4m3fn), scales

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        from strata.checkpoint.encodings import dequant_engram_rows
        flat = ids.reshape(-1)
        return dequant_engram_rows(self.values[flat], self.scales[flat]).view(*ids.shape, -1)


class FoldedTable:
    """Row r of the full table reads row r mod `rows` of a smaller one (same id stream)."""

    def __init__(self, inner, rows: int) -> None:
        self.inner, self.rows = inner, rows
        self.prefetches = getattr(inner, "prefetches", False)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.lookup(ids % self.rows)

    def records(self, ids: torch.Tensor):
        """The stored records of the rows (a graphed step dequantises them on the GPU)."""
        return self.inner.records(ids % self.rows)

    def from_records(self, raw: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        return self.inner.from_records(raw, shape)

    def prefetch(self, ids: torch.Tensor) -> None:
        if hasattr(self.inner, "prefetch"):
            self.inner.prefetch(ids % self.rows)

    def stats(self):
        return self.inner.stats()

    def drop_caches(self) -> str:
        return self.inner.drop_caches()

    def close(self) -> None:
        if hasattr(self.inner, "close"):
            self.inner.close()


def synthetic_hasher(cfg: ModelConfig):
    """The Engram hasher of `cfg` over a stand-in token map (id mod classes): the real map
    needs the V4.1 tokenizer, and any map gives the same amount of hashing and reading."""
    import numpy as np

    from strata.model.ngram_hash import NgramHashConfig, NgramHasher
    if not cfg.engram_layer_ids:
        return None
    token_map = np.arange(cfg.vocab_size, dtype=np.int64) % cfg.engram_compressed_vocab_size
    return NgramHasher(NgramHashConfig(
        layer_ids=list(cfg.engram_layer_ids), max_ngram=cfg.engram_max_ngram_size,
        n_heads=cfg.engram_n_heads, vocab_start=cfg.engram_vocab_size,
        pad_token_id=cfg.engram_pad_token_id, compressed_vocab=cfg.engram_compressed_vocab_size),
        token_map)


def build_synthetic(cfg: ModelConfig, device: torch.device | str, numerics=None,
                    layers=None, part=None, **options):
    """(Model, SyntheticWeights): `cfg`'s model with random stored weights on `device`.
    `layers`: the backbone layers to hold (None: all) — a one-GPU run of a model that needs
    two holds a subset, and per-layer times scale to the whole; `part`: a rank's ModelPart
    of a multi-device group instead (its reader wrapper applied; the config kept whole);
    options go to SyntheticWeights (fmt, bits, seed, engram, engram_rows, engram_dir,
    engram_io_threads)."""
    from dataclasses import replace

    from strata.model.model import Model, ModelPart
    from strata.model.numerics import Numerics
    device = torch.device(device)
    if layers is not None and cfg.dspark_target_layer_ids and \
            not set(cfg.dspark_target_layer_ids) <= set(layers):
        # The draft head taps its target layers; a subset taps its last layers instead (the
        # same amount of work, and the weights are random anyway).
        n = len(cfg.dspark_target_layer_ids)
        cfg = replace(cfg, dspark_target_layer_ids=tuple(sorted(layers)[-n:]))
    if part is None and layers is not None:
        _check_index_sources(cfg, layers)
    w = SyntheticWeights(cfg, device, **options)
    if part is None and layers is not None:
        part = ModelPart(layers=layers)
    reader = part.wrap_reader(w) if part is not None and part.wrap_reader else w
    model = Model(cfg, reader, numerics or Numerics.for_device(device), synthetic_hasher(cfg),
                  part)
    return model, w


# ---- `strata bench synthetic` ------------------------------------------------------------------
def device_bytes(cfg: ModelConfig, fmt: str = "exl3", engram: str = "device",
                 engram_rows: int = 1 << 20) -> tuple[dict[int, int], int]:
    """(bytes by backbone layer, bytes of the rest: embed, head, DSpark stages) that a one-device
    build keeps on its device — the stored tensors, and with engram="device" the folded tables'
    rows (not the full tables' sizes, which are kept for plans) — from a build of every layer
    on the meta device (nothing allocated)."""
    w = build_synthetic(cfg, "meta", fmt=fmt, engram="device", engram_rows=engram_rows)[1]
    sizes = {n: b for n, b in w.tensor_bytes.items() if ".engram.embed." not in n}
    if engram == "device":
        sizes.update(w.folded_bytes)
    per_layer, rest = dict.fromkeys(range(cfg.n_layers), 0), 0
    for name, n in sizes.items():
        m = re.match(r"layers\.(\d+)\.", name)
        if m:
            per_layer[int(m.group(1))] += n
        else:
            rest += n
    return per_layer, rest


def check_fits(cfg: ModelConfig, layers: list[int] | None, device: str, free: int, *,
               context: int, fmt: str = "exl3", engram: str = "device",
               engram_rows: int = 1 << 20, reserve: int | None = None,
               sizes: tuple[dict[int, int], int] | None = None) -> int:
    """The device bytes a one-device run of `layers` needs — their weights (device_bytes, or
    `sizes` from it), the rest, the caches at `context` tokens (runtime/placement.py's sizes)
    and the placement reserve; a StrataError naming the parts and how many layers would fit
    when that exceeds `free` — before a weight is made (else the build fails deep inside with
    the allocator's out-of-memory message, partway through)."""
    from strata.errors import StrataError
    from strata.runtime.placement import DEFAULT_RESERVE_BYTES, gb, layer_cache_bytes
    reserve = DEFAULT_RESERVE_BYTES if reserve is None else reserve
    per_layer, rest = sizes or device_bytes(cfg, fmt, engram, engram_rows)
    held = list(range(cfg.n_layers)) if layers is None else layers
    weights = sum(per_layer[l] for l in held)
    caches = {l: layer_cache_bytes(cfg, l, context) for l in held}
    need = weights + rest + sum(caches.values()) + reserve
    if need <= free:
        return need
    each = max(per_layer[l] + caches[l] for l in held)
    fit = max(0, (free - rest - reserve) // each)
    hint = f"about {fit} layers of ≤ {gb(each)} fit (--layers, or --layers fit)" if fit else \
        "not one layer fits beside them"
    raise StrataError(
        f"{len(held)} of {cfg.n_layers} layers need {gb(need)} on {device}: layers {gb(weights)} "
        f"(weights{' and folded Engram rows' if engram == 'device' else ''}), embed/head/DSpark "
        f"{gb(rest)}, caches at {context:,} tokens {gb(sum(caches.values()))}, reserve "
        f"{gb(reserve)} — but {gb(free)} is free; {hint}")


def fit_layers(cfg: ModelConfig, device: str, free: int, sizes=None,
               **options) -> list[int] | None:
    """`--layers fit`: the most layers that fit `free` bytes (check_fits' options and sizes)
    as the first k of each half of the model — 0..k−1 and L/2..L/2+k−1, so both halves are
    timed (V4.1's decoder half, layers 20–39, reads the compressed KV layer 20 builds) — or
    every layer (None)."""
    from strata.errors import StrataError
    sizes = sizes or device_bytes(cfg, options.get("fmt", "exl3"),
                                  options.get("engram", "device"),
                                  options.get("engram_rows", 1 << 20))
    h = cfg.n_layers // 2
    last = None
    for k in range(h, 0, -1):
        layers = None if 2 * k == cfg.n_layers else list(range(k)) + list(range(h, h + k))
        try:
            if layers is not None:
                _check_index_sources(cfg, layers)
            check_fits(cfg, layers, device, free, sizes=sizes, **options)
            return layers
        except StrataError as e:
            last = e
    raise StrataError(f"--layers fit: not even layers 0 and {h} fit ({last})")


def _check_index_sources(cfg: ModelConfig, layers) -> None:
    """A one-device subset computes every top-k selection it uses: a held layer whose index
    source (or a re-indexing layer whose candidate source) is not held would find none (a
    layer split ships them between ranks)."""
    from strata.errors import StrataError
    held = set(layers)
    for l in sorted(held):
        src = cfg.index_source_of(l)
        if src is not None and src not in held:
            raise StrataError(f"--layers: layer {l} attends with layer {src}'s top-k selection "
                              f"(its index source); hold layer {src} too")
        c = cfg.candidate_source_layer_id
        if cfg.is_reindex(l) and c not in held:
            raise StrataError(f"--layers: layer {l} picks among layer {c}'s candidate blocks; "
                              f"hold layer {c} too")


def parse_layers(text: str | None, n_layers: int) -> list[int] | None:
    """'0-7,20-27' → [0..7, 20..27]; None/'all' → every layer."""
    if text in (None, "", "all"):
        return None
    from strata.errors import StrataError
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise StrataError(f"--layers {text!r}: expected ranges like 0-7,20-27") from None
        if not 0 <= a <= b < n_layers:
            raise StrataError(f"--layers {text!r}: layers run 0..{n_layers - 1}")
        out.extend(range(a, b + 1))
    return sorted(set(out))


def layers_text(layers: list[int] | None) -> str:
    """parse_layers' inverse: [0..4, 20..24] → '0-4,20-24'; None → 'all'."""
    if layers is None:
        return "all"
    runs: list[list[int]] = []
    for l in layers:
        if runs and l == runs[-1][1] + 1:
            runs[-1][1] = l
        else:
            runs.append([l, l])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def add_arguments(p) -> None:
    p.add_argument("--config", help="take the model config from this checkpoint folder "
                                    "(default: the published V4.1-Flash config)")
    p.add_argument("--layers", help="backbone layers to hold, e.g. 0-11,20-31 (default all), "
                                    "or 'fit': the first k of each half, as many as the GPU's "
                                    "free memory holds; per-layer times scale to the whole "
                                    "model")
    p.add_argument("--format", dest="fmt", default="exl3", choices=["exl3", "official"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--engram", default="device", choices=["device", "disk"])
    p.add_argument("--engram-rows", type=COUNT, default=1 << 20,
                   help="rows each folded Engram table keeps (same id stream, bounded size)")
    p.add_argument("--engram-dir", help="with --engram disk: where the table files go")
    p.add_argument("--engram-io-threads", type=THREADS, default=IO_THREADS,
                   help="with --engram disk: threads reading each table's rows "
                        f"(default {IO_THREADS})")
    p.add_argument("--engram-cache", default="warm", choices=["warm", "cold"],
                   help="with --engram disk: cold = every run starts with the row cache "
                        "empty and the tables' pages dropped (each row a disk read, as at a "
                        "fresh start); warm = runs reuse what earlier runs read")
    p.add_argument("--prompt-tokens", type=COUNT, default=512)
    p.add_argument("--tokens", type=COUNT, default=64)
    p.add_argument("--modes", default="plain,oracle")
    p.add_argument("--runs", type=COUNT, default=3)
    p.add_argument("--warmup", type=NONNEGATIVE, default=1)
    p.add_argument("--length", type=COUNT, default=None,
                   help="fixed verify length for dspark (default: adaptive) and the oracle "
                        "modes (default: the draft block)")
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--prefill", help="also time chunked prefills of these prompt lengths, "
                                     "e.g. 8K,32K,128K (K = 1024)")
    from strata.runtime.chunk_size import LARGEST_AUTO_CHUNK
    from strata.runtime.session import PREFILL_CHUNK
    p.add_argument("--prefill-chunk", type=count_or_auto, default=PREFILL_CHUNK,
                   help=f"rows a prefill forward takes at once (default {PREFILL_CHUNK}); "
                        f"auto: the largest up to {LARGEST_AUTO_CHUNK} whose scratch fits, "
                        "measured after the build as `strata serve` does")
    p.add_argument("--prefill-piece", type=COUNT, default=32768,
                   help="feed a prefill's prompt in pieces of this many tokens, with a "
                        "progress line after each")
    p.add_argument("--prefill-warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="before each timed prefill, an untimed one of a shorter prompt with "
                        "the same chunk shapes (the Triton kernels compile there, not in the "
                        "timed run); default: on CUDA")
    p.add_argument("--prefill-runs", type=COUNT, default=1,
                   help="timed prefills of each prompt; the median is reported")
    p.add_argument("--prefill-skip", default="both", choices=["both", "on", "off"],
                   help="the exact decoder-skipping prefill: with, without, or both (then the "
                        "last logits are checked bit-identical)")
    p.add_argument("--breakdown", type=NONNEGATIVE, default=0, metavar="STEPS",
                   help="also profile this many plain decode steps and split their time by "
                        "part (attention, MoE, mHC, …, launch gaps); with --parallel, rank 0's "
                        "process and device (its waits on the others show as collective "
                        "kernels or gaps); with --prefill on one device, also a prefill chunk "
                        "at the longest prompt's end, encoder-only and full")
    p.add_argument("--no-mma", action="store_true",
                   help="EXL3 decode linears on the Triton kernels only, not the CUDA kernel of "
                        "strata.kernels.exl3_mma (STRATA_EXL3_MMA=0), for an A/B")
    p.add_argument("--json", help="write the results as JSON here")
    from strata.cli import _add_parallel_args
    _add_parallel_args(p)  # every rank builds its part of the same synthetic model


def chunk_rows(flag: int | str) -> int:
    """--prefill-chunk's rows for sizing before the model is built: "auto" may pick up to
    the largest."""
    from strata.runtime.chunk_size import LARGEST_AUTO_CHUNK
    return LARGEST_AUTO_CHUNK if flag == "auto" else flag


def prefill_warmup_length(n: int, chunk: int, reach: int) -> int:
    """The warm-up prompt for a timed prefill of n tokens: the same remainder modulo the chunk,
    so its chunks (the decoder skip's boundary and the decoder's rows included) have the timed
    run's lengths and alignments mod 16, the forms Triton specialises its kernels on — and
    long enough to reach past the decoder skip's reach by a chunk."""
    chunks = -(-(reach + chunk) // chunk)
    return min(n, n % chunk + chunks * chunk)


def bench_prefill(model, lengths: list[int], chunk: int, skip: str, seed: int,
                  progress=None, piece: int = 32768, warmup: bool | None = None,
                  runs: int = 1) -> list[dict]:
    """Time a chunked prefill of random prompts of each length (device synchronised around it)
    with and/or without the decoder skip; peak device memory; with both, whether the last
    row's logits are bit-identical (the skip is exact). `progress(text)`: a line per prefill
    as soon as it is timed, and one per `piece` tokens fed (the prompt goes in pieces, as the
    engine feeds long prompts: a long-context run cut short by a time limit keeps its rate).
    `warmup` (default: on CUDA): an untimed prefill of `prefill_warmup_length` tokens first.
    `runs`: timed prefills of each prompt, each on a new session; a row's seconds are their
    median (a short prefill's run-to-run spread is several percent), all in `runs_seconds`."""
    import statistics
    import time

    from strata.bench.memory import proc_status
    from strata.runtime.session import Session
    dev = torch.device(model.device)
    cuda = dev.type == "cuda"
    can_skip = getattr(model, "decoder_start", None) is not None
    modes = {"both": (False, True), "on": (True,), "off": (False,)}[skip]
    if warmup is None:
        warmup = cuda
    reach = getattr(model, "prefill_reach", 0) if can_skip else 0
    out = []
    for n in lengths:
        g = torch.Generator().manual_seed(seed + n)
        prompt = torch.randint(3, min(model.cfg.vocab_size, 100_000), (n,), generator=g)
        last = {}
        for on in modes:
            warm = prefill_warmup_length(n, chunk, reach) if warmup else 0
            if warm:
                t0 = time.perf_counter()
                if cuda:  # (kernels only a long context's shapes take)
                    from strata.kernels import ranking
                    ranking.compile_split(dev)
                Session(model, warm + 8, prefill_chunk=chunk, decoder_skip=on).prefill(
                    prompt[:warm])
                if progress is not None:
                    progress(f"prefill {n}: untimed warm-up of {warm} tokens took "
                             f"{time.perf_counter() - t0:.1f} s")
            timed = []
            for _ in range(runs):
                s = Session(model, n + 8, prefill_chunk=chunk, decoder_skip=on)
                base = None
                if cuda:
                    torch.cuda.synchronize(dev)
                    torch.cuda.reset_peak_memory_stats(dev)
                    base = torch.cuda.memory_allocated(dev)  # weights, tables, the caches
                t0 = time.perf_counter()
                logits = None
                for i in range(0, n, piece):
                    j = min(i + piece, n)
                    logits = s.prefill(prompt[i:j], rows_after=n - j)
                    if progress is not None and j < n:
                        if cuda:
                            torch.cuda.synchronize(dev)
                        progress(f"prefill {n}: {j} tokens in {time.perf_counter() - t0:.1f} s")
                if cuda:
                    torch.cuda.synchronize(dev)
                timed.append(time.perf_counter() - t0)
                del s
            secs = statistics.median(timed)
            last[on] = logits
            out.append({"tokens": n, "decoder_skip": on, "skip_applied": on and can_skip,
                        "seconds": secs, "tok_per_s": n / secs, "chunk": chunk,
                        "runs_seconds": timed,
                        "warmup_tokens": warm,
                        # this process's (rank 0's) device; host: the process's peak so far
                        "peak_device_bytes": torch.cuda.max_memory_allocated(dev) if cuda
                        else None,
                        # what the prefill itself added at its peak: the chunks' scratch
                        "base_device_bytes": base,
                        "peak_host_rss_bytes": proc_status("VmHWM")})
            if progress is not None:
                peak = out[-1]["peak_device_bytes"]
                each = "" if runs == 1 else \
                    f" (median of {runs}: {', '.join(f'{t:.3f}' for t in timed)} s)"
                progress(f"measured prefill {n} (decoder skip {'on' if on else 'off'}): "
                         f"{secs:.3f} s, {n / secs:.0f} tok/s{each}"
                         + ("" if peak is None else f", peak device {peak / 2**30:.1f} GiB"))
        if len(last) == 2:
            same = bool(torch.equal(last[False], last[True]))
            for r in out[-2:]:
                r["logits_equal_to_full"] = same
    return out


def prefill_report(rows: list[dict], scale: float) -> str:
    lines = [f"{'prefill':>9}{'skip':>6}{'s':>9}{'tok/s':>10}{'scaled':>10}{'dev GiB':>9}"
             f"{'scratch':>9}{'host GiB':>10}{'= full':>8}"]
    for r in rows:
        peak = "-" if r["peak_device_bytes"] is None else f"{r['peak_device_bytes'] / 2**30:.1f}"
        scratch = ("-" if r.get("base_device_bytes") is None else
                   f"{(r['peak_device_bytes'] - r['base_device_bytes']) / 2**30:.2f}")
        same = {True: "yes", False: "NO"}.get(r.get("logits_equal_to_full"), "-")
        skip = ("on" if r["skip_applied"] else "n/a") if r["decoder_skip"] else "off"
        lines.append(f"{r['tokens']:>9}{skip:>6}{r['seconds']:>9.2f}{r['tok_per_s']:>10.0f}"
                     f"{r['tok_per_s'] * scale:>10.0f}{peak:>9}{scratch:>9}"
                     f"{r['peak_host_rss_bytes'] / 2**30:>10.1f}{same:>8}")
    return "\n".join(lines)


def decode_breakdown(model, prompt: list[int], steps: int, mode: str = "plain") -> dict:
    """strata.bench.breakdown over `steps` greedy decode steps after the prompt (three steps
    first, so the profile sees steady state — and, graphed, the step's graph captured), then
    as many timed without a profiler and as many under cProfile. `mode` "plain" or
    "plain+graphs"; "oracle" or "oracle+graphs": a step is one DSpark window (draft, one
    batched verify, commit) whose drafts are plain decoding's continuation, all accepted."""
    from strata.bench.breakdown import step_breakdown
    from strata.bench.decode import GRAPHS, _run_once, make_session
    from strata.runtime.sampling import SamplingParams
    window = mode.removesuffix(GRAPHS) == "oracle"
    per = model.cfg.dspark_block_size + 1 if window else 1  # tokens a step commits, at most
    n = (3 + 3 * steps) * per + 1
    reference = _run_once(model, prompt, n + per, "plain", None, None, None)[0] \
        if window else None
    s = make_session(model, prompt, n + per, mode, reference)
    gen = s.generate(prompt, n + per, SamplingParams(), stop_ids=frozenset(),
                     mode="dspark" if window else "plain")
    next(gen)  # the prompt's token

    def one_step():
        if not window:
            next(gen)
            return
        target = s.stats.windows + 1
        while s.stats.windows < target:  # (a window's other tokens are served from its buffer)
            next(gen)

    for _ in range(3):
        one_step()

    def run():
        for _ in range(steps):
            one_step()
    out = step_breakdown(run, steps, s.state.device, plain_run=run, python_run=run)
    if window:
        out["unit"] = "verify windows"
    return out


def prefill_breakdown(model, context: int, chunk: int, decoder: bool, seed: int,
                      chunks: int = 1) -> dict:
    """strata.bench.breakdown over `chunks` prefill chunks of `chunk` rows after `context`
    tokens of history (fed first with the decoder skip, untimed): each chunk runs the encoder
    half in full and, with `decoder`, the decoder half too (else only what the decoder skip
    keeps) and is then rolled back, so every profiled run sees the same context. Eager —
    prefill runs no graphs — so every kernel counts for its part."""
    from strata.bench.breakdown import step_breakdown
    from strata.runtime.session import Session
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, min(model.cfg.vocab_size, 100_000), (context + chunk,),
                           generator=g)
    s = Session(model, context + chunk + 8, prefill_chunk=chunk, decoder_skip=True)
    if context:
        s.prefill(tokens[:context], rows_after=chunk)
    piece = tokens[context:]

    def run():
        for _ in range(chunks):
            s.state.begin()
            # (decoder False: the decoder skip from past the chunk — its encoder alone)
            model.forward(piece, s.state, logits="last" if decoder else "none",
                          decoder_from=None if decoder else s.state.position + chunk)
            s.state.rollback()
    run()  # (the chunk's shapes compiled before the profile)
    out = step_breakdown(run, chunks, s.state.device, plain_run=run, python_run=run)
    out["unit"] = "prefill chunks"
    return out


def _launch(args, cfg: ModelConfig):
    """--parallel: the synthetic model over --devices, one process per device (each rank makes
    the tensors it holds; the same names give the same values as one device would)."""
    from strata.errors import StrataError
    from strata.runtime.parallel import ParallelSpec, launch, parse_devices, parse_split
    if not args.devices:
        raise StrataError(f"--parallel {args.parallel} needs --devices, one per rank")
    if args.layers:
        raise StrataError("--layers is for one device; --parallel holds every layer")
    devices = parse_devices(args.devices)
    split = parse_split(args.split, cfg.n_layers, len(devices)) if args.split else None
    synthetic = {"config": args.config, "fmt": args.fmt, "seed": args.seed,
                 "engram": args.engram, "engram_rows": args.engram_rows,
                 "engram_dir": args.engram_dir, "engram_io_threads": args.engram_io_threads}
    return launch(ParallelSpec(args.parallel, devices, "", split=split,
                               tp_attention=args.tp_attention, peer_timeout=args.peer_timeout,
                               synthetic=synthetic))


def run(args) -> int:
    """Build the synthetic model on the device, run the decode protocol, report tok/s measured
    and scaled to the whole layer count, stored bits per weight and bytes per group."""
    import json
    import sys
    import time

    from strata.bench.decode import bench_decode, report
    from strata.config import v41_flash_config
    cfg = ModelConfig.from_model_dir(Path(args.config)) if args.config else v41_flash_config()
    fit = args.layers == "fit"
    layers = None if fit else parse_layers(args.layers, cfg.n_layers)
    from strata.errors import StrataError
    if args.engram_cache == "cold" and (args.engram != "disk" or args.parallel):
        raise StrataError("--engram-cache cold needs --engram disk on one device (the tables' "
                          "row cache and pages are what it drops)")
    if args.engram == "disk" and not args.engram_dir:
        raise StrataError("--engram disk needs --engram-dir DIR (where the table files go)")
    from strata.kernels import exl3_mma, pdl
    if args.no_mma:  # (the environment reaches the ranks of a parallel run)
        os.environ["STRATA_EXL3_MMA"] = "0"
        exl3_mma.ENABLED = False
    lengths, planned = [], None
    if args.prefill:
        from strata.bench.passkey import parse_length
        lengths = [parse_length(t) for t in args.prefill.split(",") if t.strip()]
    if fit and (args.parallel or torch.device(args.device).type != "cuda"):
        raise StrataError("--layers fit sizes the subset by a CUDA device's free memory: give "
                          "--device cuda[:N] (and no --parallel), or name the layers")
    if not args.parallel and torch.device(args.device).type == "cuda":
        context = max([args.prompt_tokens + args.tokens + cfg.dspark_block_size + 2]
                      + [n + chunk_rows(args.prefill_chunk) + 8 for n in lengths])
        free = torch.cuda.mem_get_info(args.device)[0]
        sizing = dict(context=context, fmt=args.fmt, engram=args.engram,
                      engram_rows=args.engram_rows,
                      sizes=device_bytes(cfg, args.fmt, args.engram, args.engram_rows))
        if fit:
            layers = fit_layers(cfg, args.device, free, **sizing)
            args.layers = layers_text(layers)
            print(f"--layers fit: {args.layers} on {args.device}", file=sys.stderr, flush=True)
        planned = check_fits(cfg, layers, args.device, free, **sizing)
    # Measured first, on an empty device (in a layer split or TP, the first device's).
    rates = kernel_rates(cfg, args.devices.split(",")[0] if args.parallel else args.device,
                         args.fmt)
    if planned is not None:
        torch.cuda.reset_peak_memory_stats(args.device)  # (the peak below: the model's run)
    t0 = time.perf_counter()
    if args.parallel:
        model = _launch(args, cfg)
        w = build_synthetic(cfg, "meta", fmt=args.fmt)[1]  # the sizes, for the report
    else:
        model, w = build_synthetic(cfg, args.device, layers=layers, fmt=args.fmt,
                                   seed=args.seed, engram=args.engram,
                                   engram_rows=args.engram_rows, engram_dir=args.engram_dir,
                                   engram_io_threads=args.engram_io_threads)
    build_s = time.perf_counter() - t0
    chunk = args.prefill_chunk
    if lengths:
        from strata.runtime.chunk_size import resolve_prefill_chunk
        chunk = resolve_prefill_chunk(chunk, model, max(lengths) + 8)
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(3, min(cfg.vocab_size, 100_000), (args.prompt_tokens,),
                           generator=g).tolist()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes:
        raise StrataError(f"--modes {args.modes!r}: no mode named (e.g. plain,dspark,oracle)")
    before_run = None
    if args.engram_cache == "cold":
        def before_run() -> None:  # (the page-cache note, printed once)
            notes = {store.drop_caches() for store in model.engram_stores.values()}
            if not cold_notes:
                print(f"engram cold before each run: {'; '.join(sorted(notes))}",
                      file=sys.stderr, flush=True)
            cold_notes.update(notes)
        cold_notes: set[str] = set()
    try:
        results = bench_decode(model, prompt, modes, n=args.tokens, runs=args.runs,
                               warmup=args.warmup, length=args.length,
                               progress=lambda line: print(line, file=sys.stderr, flush=True),
                               before_run=before_run,
                               tokenizer_json=tokenizer_path(None))  # (V4's vocabulary)
        split = None
        if args.parallel:
            from strata.bench.decode import parallel_split
            split = parallel_split(model, prompt, modes, n=args.tokens, length=args.length)
        prefill = []
        if lengths:
            prefill = bench_prefill(model, lengths, chunk, args.prefill_skip,
                                    args.seed, progress=lambda line: print(
                                        line, file=sys.stderr, flush=True),
                                    piece=args.prefill_piece, warmup=args.prefill_warmup,
                                    runs=args.prefill_runs)
        # Eager plain steps, and graphed ones too when "plain+graphs" was measured; DSpark
        # windows (oracle drafts) when an oracle mode was, graphed if it was graphed.
        from strata.bench.decode import GRAPHS, parse_mode
        kinds = {ms.base.split(":")[0] + (GRAPHS if ms.graphs else "")
                 for ms in map(parse_mode, modes)}  # (oracle:2.9@3+graphs → oracle+graphs)
        # (a graphed mode's eager twin too: its profile names each kernel's part)
        wanted = ["plain"] + [m for m in ("plain+graphs", "oracle", "oracle+graphs")
                              if m in kinds or m + GRAPHS in kinds]
        breakdown = {m: decode_breakdown(model, prompt, args.breakdown, m)
                     for m in wanted} if args.breakdown else None
        if breakdown:
            from strata.bench.breakdown import graphed_by_part
            for m in ("plain", "oracle"):
                eager, graphed = breakdown.get(m), breakdown.get(m + GRAPHS)
                if graphed is not None and "busy_ms" in graphed and "busy_ms" in eager:
                    breakdown[m + GRAPHS + " by part"] = graphed_by_part(eager, graphed)
        if breakdown and prefill and not args.parallel:
            # a chunk at the longest prompt's end: the decoder skip's encoder-only chunks
            # are most of a long prefill, its last chunks run in full
            at = max(r["tokens"] for r in prefill) - chunk
            skips = getattr(model, "decoder_start", None) is not None
            for decoder in ((False, True) if skips else (True,)):
                breakdown[f"prefill chunk at {at}, {'full' if decoder else 'encoder only'}"] \
                    = prefill_breakdown(model, max(at, 0), chunk, decoder,
                                        args.seed)
    finally:
        if args.parallel:
            model.close()  # the other ranks exit
    held = cfg.n_layers if args.parallel else len(model.layers)
    where = (f"over {args.devices} ({args.parallel})" if args.parallel
             else f"({'all' if layers is None else args.layers})")
    lines = [report(results, len(prompt)),
             f"synthetic {args.fmt}: {held} of {cfg.n_layers} layers held {where}; stored "
             f"{sum(w.stored_bytes.values()) / 1e9:.2f} GB, {w.bits_per_weight():.2f} bits per "
             f"quantized weight; built in {build_s:.1f} s"]
    roof = roofline(w, results, rates)
    lines.append(roofline_report(roof, rates))
    if split is not None:
        from strata.bench.decode import split_report
        lines.append(split_report(split))
    if prefill:
        lines.append(prefill_report(prefill, held / cfg.n_layers))
    if breakdown:
        from strata.bench.breakdown import format_breakdown, format_by_part
        for mode, b in breakdown.items():
            lines.append(f"[{mode}] " + (format_by_part(b) if mode.endswith(" by part")
                                         else format_breakdown(b)))
    scaled = {}
    if held < cfg.n_layers:
        # Time per token scales with the layers held (embed/head/draft counted once: the
        # scaled figure is slightly pessimistic).
        for mode, r in results.items():
            scaled[mode] = r.median * held / cfg.n_layers
        lines.append("scaled to all layers: " + ", ".join(f"{m} {v:.1f} tok/s"
                                                          for m, v in scaled.items()))
        engram = sorted(cfg.engram_layer_ids)
        held_engram = [l for l in engram if l in {b.layer for b in model.layers}]
        if args.engram == "disk" and held_engram != engram:
            # the disk reads happen per Engram layer, not per layer: scaling misses the rest
            lines.append(f"(Engram layers held: {held_engram} of {engram} — the scaled "
                         f"figures read only the held layers' tables from disk)")
    peak = None
    if planned is not None:  # how the plan compares, for the next one-GPU run's sizing
        # (a timed prefill resets the peak: its rows keep theirs)
        peak = max([torch.cuda.max_memory_allocated(args.device)]
                   + [r["peak_device_bytes"] for r in prefill])
        lines.append(f"device memory: planned {planned / 1e9:.2f} GB with the reserve "
                     f"(check_fits), peak allocated {peak / 1e9:.2f} GB")
    print("\n".join(lines))
    exact = all(r.get("logits_equal_to_full", True) for r in prefill)
    if not exact:
        print("strata: the decoder-skipping prefill changed the last logits", file=sys.stderr)
    if args.json:
        dev = torch.device(args.devices.split(",")[0] if args.parallel else args.device)
        meta = {"command": "strata " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
                "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                "parallel": args.parallel, "devices": args.devices,
                "layers": layers, "format": args.fmt, "bits_per_weight": w.bits_per_weight(),
                "stored_bytes": w.stored_bytes, "build_s": build_s,
                "exl3_mma": exl3_mma.ENABLED, "early_launch": pdl.ENABLED,
                "engram": args.engram, "engram_rows": args.engram_rows,
                "engram_cache": args.engram_cache if args.engram == "disk" else None,
                "planned_device_bytes": planned, "peak_device_bytes": peak}
        Path(args.json).write_text(json.dumps(
            {"meta": meta, "results": {m: r.as_dict() for m, r in results.items()},
             "scaled_tok_per_s": scaled, "rates": rates, "roofline": roof,
             "split_timing": split, "prefill": prefill,
             "breakdown": breakdown}, indent=2))
    return 0 if exact else 1


@lru_cache(maxsize=None)
def v41_tensor_bytes(fmt: str = "exl3") -> dict[str, int]:
    """Bytes per stored tensor of the published V4.1-Flash config in `fmt` (the EXL3 default
    mix), from a build on the meta device: nothing allocated, for plans."""
    from strata.config import v41_flash_config
    return dict(build_synthetic(v41_flash_config(), "meta", fmt=fmt)[1].tensor_bytes)
