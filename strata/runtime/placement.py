"""Layer-split placement: which device holds which layers, checked against memory budgets
before a single weight is read.

Inputs are the config, per-tensor byte sizes (from the checkpoint headers: `tensor_bytes_of`),
the devices with their budgets and the context length to serve. Units are placed in model order
— embed (+ image tokens and the token history), layers 0..L-1, then the tail (final norm, head
and the DSpark stages) — filling each device before moving to the next, so every device holds
one contiguous range of layers, the embed sits with the first and the tail with the last.

Each device keeps a fixed reserve (default 4 GiB) for what the weights and caches do not show:
the CUDA context, a prefill chunk's activations, captured CUDA graphs and allocator slack.

Caches are sized as strata's State allocates them (runtime/state.py), per layer at the
configured context: the window ring (window + widest verify rows, head_dim, activation dtype),
the ratio-2 compressor tail ring (fp32), and the compressed KV and index keys of kv-source
layers (context/ratio entries). `kv_format="fp4"` sizes the global caches as the vendor's packed
layout (spec §4: 288 B per KV entry, 68 B per index entry → 890 B/token for V4.1).

Engram tables (~203 GB for V4.1) stay on disk behind the Engram store and are reported, not
placed, unless `engram_on_device=True`. Vision tensors are not loaded by the text model.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from strata.checkpoint.safetensors_io import CheckpointFolder
from strata.config import ModelConfig
from strata.errors import StrataError
from strata.runtime.state import entry_bucket

GiB = 1 << 30
DEFAULT_RESERVE_BYTES = 4 * GiB
KV_FORMATS = ("bf16", "fp32", "fp4")

_LAYER = re.compile(r"layers\.(\d+)\.")


class PlacementError(StrataError):
    """The model (at the requested context) does not fit the given devices and budgets."""


def parse_bytes(text: str) -> int:
    """'96GB' (10^9), '80GiB' (2^30), '512MiB', '1.5TB' or a plain byte count."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)\s*", text, re.IGNORECASE)
    if not m:
        raise StrataError(f"{text!r} is not a size (examples: 96GB, 80GiB, 512MiB)")
    value, unit = float(m.group(1)), m.group(2).upper().rstrip("B")
    powers = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
              "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
    if unit not in powers:
        raise StrataError(f"{text!r}: unknown unit")
    return int(value * powers[unit])


def gb(n: int | float) -> str:
    """Decimal GB for model-sized numbers, MB below one GB (small fixtures)."""
    return f"{n / 1e9:.2f} GB" if abs(n) >= 1e9 else f"{n / 1e6:.2f} MB"


def tensor_bytes_of(folder: CheckpointFolder) -> dict[str, int]:
    """Per-tensor data bytes from the shard headers (reads no tensor data)."""
    return {name: folder.info(name).nbytes for name in folder.names()}


# ---- caches -------------------------------------------------------------------------------

# fp4 scale block sizes of the vendor's packed caches (spec §2.9): compressed KV has one e4m3
# scale per 16 values, index keys one ue8m0 scale per 32.
KV_SCALE_BLOCK, INDEX_SCALE_BLOCK = 16, 32


def _entry_bytes(values: int, kv_format: str, scale_block: int) -> int:
    """Bytes of one cached row of `values` numbers."""
    if kv_format == "fp4":  # two e2m1 values per byte + one scale byte per block
        return values // 2 + values // scale_block
    return values * (2 if kv_format == "bf16" else 4)


def global_kv_bytes_per_token(cfg: ModelConfig, kv_format: str = "bf16") -> float:
    """Compressed KV + index keys added per token of context, all layers together."""
    total = 0.0
    for l in cfg.kv_source_layer_ids:
        entry = _entry_bytes(cfg.head_dim, kv_format, KV_SCALE_BLOCK)
        if cfg.is_index_source(l):
            entry += _entry_bytes(cfg.index_head_dim, kv_format, INDEX_SCALE_BLOCK)
        total += entry / cfg.ratio(l)
    return total


def ring_rows(cfg: ModelConfig) -> int:
    """Rows of each window ring (as State sizes them: window + widest verify window)."""
    return cfg.sliding_window + max(128, 2 * cfg.dspark_block_size + 2)


def layer_cache_bytes(cfg: ModelConfig, layer: int, context: int, kv_format: str = "bf16",
                      act_bytes: int = 2) -> int:
    """State memory owned by one backbone layer at `context` tokens."""
    rows, hd = ring_rows(cfg), cfg.head_dim
    n = rows * (hd * act_bytes + 8)  # window ring rows + int64 position tags
    if cfg.is_kv_source(layer):
        r = cfg.ratio(layer)
        if r > 1:
            n += rows * (2 * hd * 4 + 8)  # compressor tail ring, fp32 (k, gate)
        e = context // r  # (+1: the spare entry; index keys: the bucket a selection scores)
        n += (e + 1) * _entry_bytes(hd, kv_format, KV_SCALE_BLOCK)
        if cfg.is_index_source(layer):
            n += max(entry_bucket(e), e + 1) * _entry_bytes(cfg.index_head_dim, kv_format,
                                                            INDEX_SCALE_BLOCK)
    return n


# ---- the plan -----------------------------------------------------------------------------

@dataclass
class Unit:
    """A piece placed whole: the embed, one layer, or the tail."""

    name: str
    layer: int | None
    weight_bytes: int
    cache_bytes: int

    @property
    def total(self) -> int:
        return self.weight_bytes + self.cache_bytes


@dataclass
class DevicePlan:
    device: str
    budget: int
    reserve: int
    units: list[Unit] = field(default_factory=list)

    @property
    def weight_bytes(self) -> int:
        return sum(u.weight_bytes for u in self.units)

    @property
    def cache_bytes(self) -> int:
        return sum(u.cache_bytes for u in self.units)

    @property
    def used(self) -> int:
        return self.weight_bytes + self.cache_bytes + (self.reserve if self.units else 0)

    @property
    def layers(self) -> list[int]:
        return [u.layer for u in self.units if u.layer is not None]


@dataclass
class PlacementPlan:
    devices: list[DevicePlan]
    context: int
    kv_format: str
    off_device_bytes: int  # Engram tables left on disk
    unplaced_bytes: int    # tensors the text model does not load (vision)
    draft_off_device_bytes: int = 0  # DSpark experts behind the expert cache (--draft-experts)

    def device_of_layer(self, layer: int) -> str:
        for d in self.devices:
            if layer in d.layers:
                return d.device
        raise KeyError(layer)

    @property
    def first(self) -> DevicePlan:
        return next(d for d in self.devices if d.units)

    @property
    def last(self) -> DevicePlan:
        return [d for d in self.devices if d.units][-1]

    def format(self) -> str:
        lines = [f"placement at context {self.context:,} tokens (global KV {self.kv_format}):"]
        for d in self.devices:
            if not d.units:
                lines.append(f"  {d.device:<8} unused (budget {gb(d.budget)})")
                continue
            ls = d.layers
            extra = [u.name for u in d.units if u.layer is None]
            span = f"layers {ls[0]}-{ls[-1]}" if ls else "no layers"
            lines.append(
                f"  {d.device:<8} {span}{' + ' + ' + '.join(extra) if extra else ''}: weights "
                f"{gb(d.weight_bytes)}, caches {gb(d.cache_bytes)}, reserve {gb(d.reserve)}; "
                f"{gb(d.used)} of {gb(d.budget)} ({gb(d.budget - d.used)} free)")
        if self.off_device_bytes:
            lines.append(f"  Engram tables: {gb(self.off_device_bytes)} stay on disk (engram store)")
        if self.unplaced_bytes:
            lines.append(f"  not loaded (vision): {gb(self.unplaced_bytes)}")
        if self.draft_off_device_bytes:
            lines.append(f"  DSpark stage experts: {gb(self.draft_off_device_bytes)} stay on "
                         "disk behind the draft expert cache (its budget is in the tail's caches)")
        return "\n".join(lines)


def _classify(name: str, cfg: ModelConfig, engram_on_device: bool) -> str | int:
    """'embed' | 'tail' | layer index | 'engram' (off device) | 'skip' (not loaded)."""
    m = _LAYER.match(name)
    if m:
        layer = int(m.group(1))
        if ".engram.embed." in name and not engram_on_device:
            return "engram"
        return layer
    root = name.split(".", 1)[0]
    if root in ("embed", "image_start", "image_end", "image_newline"):
        return "embed"
    if root in ("norm", "head", "mtp"):
        return "tail"
    return "skip"  # vision.*, aligner.*: the text model never reads them


def build_units(cfg: ModelConfig, tensor_bytes: Mapping[str, int], context: int, *,
                kv_format: str = "bf16", act_bytes: int = 2,
                engram_on_device: bool = False,
                draft_cache_bytes: int | None = None) -> tuple[list[Unit], int, int, int]:
    """(units in model order, Engram bytes left on disk, bytes not loaded, DSpark expert
    bytes left on disk). draft_cache_bytes: the DSpark stages' experts stay off the device
    behind an expert cache of that budget (Model.load(draft_experts="cache"))."""
    if kv_format not in KV_FORMATS:
        raise StrataError(f"kv_format {kv_format!r}: expected one of {', '.join(KV_FORMATS)}")
    weights = {"embed": 0, "tail": 0, "engram": 0, "skip": 0, "draft": 0}
    layer_w = [0] * cfg.n_layers
    for name, n in tensor_bytes.items():
        where = _classify(name, cfg, engram_on_device)
        if draft_cache_bytes is not None and name.startswith("mtp.") and ".ffn.experts." in name:
            where = "draft"
        if isinstance(where, int):
            if where >= cfg.n_layers:
                raise PlacementError(f"tensor {name} names layer {where}, but the config has "
                                     f"{cfg.n_layers} layers")
            layer_w[where] += n
        else:
            weights[where] += n
    hd = cfg.head_dim
    units = [Unit("embed", None, weights["embed"], context * 8)]  # + token history (int64)
    units += [Unit(f"layer {l}", l, layer_w[l],
                   layer_cache_bytes(cfg, l, context, kv_format, act_bytes))
              for l in range(cfg.n_layers)]
    dspark_rings = cfg.num_nextn_predict_layers * ring_rows(cfg) * (hd * act_bytes + 8)
    units.append(Unit("head+norm+DSpark" if cfg.num_nextn_predict_layers else "head+norm",
                      None, weights["tail"], dspark_rings + (draft_cache_bytes or 0)))
    return units, weights["engram"], weights["skip"], weights["draft"]


def plan_placement(cfg: ModelConfig, tensor_bytes: Mapping[str, int], devices: Sequence[str],
                   budgets: Sequence[int], context: int, *,
                   reserve_bytes: int = DEFAULT_RESERVE_BYTES, kv_format: str = "bf16",
                   act_bytes: int = 2, engram_on_device: bool = False,
                   draft_cache_bytes: int | None = None) -> PlacementPlan:
    """Assign contiguous layer ranges to devices in order; PlacementError if it cannot fit."""
    if not devices:
        raise StrataError("no devices given")
    if len(budgets) == 1:
        budgets = list(budgets) * len(devices)
    if len(budgets) != len(devices):
        raise StrataError(f"{len(budgets)} budgets for {len(devices)} devices")
    if context < 1:
        raise StrataError(f"context {context}: must be ≥ 1 token")
    units, off_device, unplaced, draft_off = build_units(
        cfg, tensor_bytes, context, kv_format=kv_format, act_bytes=act_bytes,
        engram_on_device=engram_on_device, draft_cache_bytes=draft_cache_bytes)
    plans = [DevicePlan(d, int(b), reserve_bytes) for d, b in zip(devices, budgets)]
    k = 0
    for unit in units:
        # Move on to the next device when this unit would overflow the current one.
        while k < len(plans) and plans[k].weight_bytes + plans[k].cache_bytes + unit.total \
                > plans[k].budget - plans[k].reserve:
            k += 1
        if k == len(plans):
            raise PlacementError(_shortfall(units, unit, plans, context, off_device))
        plans[k].units.append(unit)
    return PlacementPlan(plans, context, kv_format, off_device, unplaced, draft_off)


def _shortfall(units: list[Unit], stuck: Unit, plans: list[DevicePlan], context: int,
               off_device: int) -> str:
    weights = sum(u.weight_bytes for u in units)
    caches = sum(u.cache_bytes for u in units)
    reserves = sum(p.reserve for p in plans)
    need = weights + caches + reserves
    have = sum(p.budget for p in plans)
    # At least the overall deficit; more when whole units do not pack into what is left.
    last = plans[-1]
    room = max(0, last.budget - last.reserve - last.weight_bytes - last.cache_bytes)
    missing = max(need - have, stuck.total - room)
    where = ", ".join(f"{p.device} {gb(p.budget)}" for p in plans)
    note = f" (Engram tables, {gb(off_device)}, stay on disk and are not counted)" \
        if off_device else ""
    return (f"the model does not fit: it needs {gb(need)} = weights {gb(weights)} + caches at "
            f"context {context:,} {gb(caches)} + reserve {gb(reserves)} ({len(plans)} × "
            f"{gb(plans[0].reserve)}), but the budgets are {where} = {gb(have)}; {stuck.name} "
            f"({gb(stuck.total)}) found no room: {gb(missing)} missing{note}")


def balanced_split(cfg: ModelConfig, tensor_bytes: Mapping[str, int], n_devices: int,
                   context: int, *, kv_format: str = "bf16", act_bytes: int = 2,
                   engram_on_device: bool = False) -> list[range]:
    """Contiguous layer ranges, one per device, that balance weights + caches, for a layer-split
    run (runtime/parallel.py) where the first device also holds the embed and the tail (head,
    final norm, DSpark stages: sampling and drafting live with the API on rank 0).
    Minimises the largest device's bytes; every device gets at least one layer."""
    L = cfg.n_layers
    if not 1 <= n_devices <= L:
        raise PlacementError(f"cannot split {L} layers over {n_devices} devices")
    units, _, _, _ = build_units(cfg, tensor_bytes, context, kv_format=kv_format,
                              act_bytes=act_bytes, engram_on_device=engram_on_device)
    extra = sum(u.total for u in units if u.layer is None)
    size = [0] * L
    for u in units:
        if u.layer is not None:
            size[u.layer] = u.total
    prefix = [0]
    for s in size:
        prefix.append(prefix[-1] + s)
    # best[k][i]: the smallest possible largest load when layers i.. go on devices k..
    inf = float("inf")
    best = [[inf] * (L + 1) for _ in range(n_devices + 1)]
    cut = [[L] * (L + 1) for _ in range(n_devices + 1)]
    best[n_devices][L] = 0
    for k in range(n_devices - 1, -1, -1):
        for i in range(L - 1, -1, -1):
            for j in range(i + 1, L - (n_devices - k - 1) + 1):
                load = prefix[j] - prefix[i] + (extra if k == 0 else 0)
                cand = max(load, best[k + 1][j])
                if cand < best[k][i]:
                    best[k][i], cut[k][i] = cand, j
    out, i = [], 0
    for k in range(n_devices):
        j = cut[k][i]
        out.append(range(i, j))
        i = j
    return out
