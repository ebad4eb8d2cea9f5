"""The Engram n-gram memory module of layers 1 and 14 (spec §2.7).

Row ids come from model.ngram_hash (tokens only, computed once per forward). Each position
gathers 3·n_heads table rows (fp8 + ue8m0 per 32), projects them to one key per hyper-connection
copy and one shared value, and adds the value to each copy through a per-copy scalar gate.
The table is read through `EngramTable.lookup`, so where the rows live (GPU, RAM or disk) is
the table's concern.
"""
from __future__ import annotations

import torch

from strata.checkpoint.encodings import dequant_engram_rows
from strata.checkpoint.weights import WeightReader
from strata.config import ModelConfig
from strata.engram_store import EngramStore
from strata.kernels import engram as engram_kernels
from strata.model.numerics import Numerics, row_mean, row_sum


class EngramTable:
    """A table held as stored (e4m3 rows + uint8 exponents) in device memory."""

    def __init__(self, rows: torch.Tensor, scale: torch.Tensor) -> None:
        self.rows, self.scale = rows, scale

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows [..., head_dim] for ids [...]."""
        flat = ids.reshape(-1)
        out = dequant_engram_rows(self.rows[flat], self.scale[flat])
        return out.view(*ids.shape, -1)


class Engram:
    def __init__(self, cfg: ModelConfig, layer: int, w: WeightReader, prefix: str) -> None:
        self.cfg = cfg
        i = cfg.engram_layer_ids.index(layer)
        n_rows, hd = cfg.engram_num_embeddings[i], cfg.engram_head_dim
        n_ids = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        D, H = cfg.hidden_size, cfg.hc_mult
        self.table: EngramTable | EngramStore
        if hasattr(w, "engram_table"):  # the reader places the table (e.g. on disk)
            self.table = w.engram_table(f"{prefix}.embed", n_rows, hd)
        else:
            self.table = EngramTable(
                w.tensor(f"{prefix}.embed.weight", "F8_E4M3", (n_rows, hd)),
                w.tensor(f"{prefix}.embed.scale", ("F8_E8M0", "U8"), (n_rows, hd // 32)))
        self.wkv = w.linear(f"{prefix}.wkv", (H + 1) * D, n_ids * hd)
        q_w = w.float_tensor(f"{prefix}.q_weight", (H, D))
        k_w = w.float_tensor(f"{prefix}.k_weight", (H, D))
        self.qk_weight = q_w * k_w  # only their product is used

    def forward(self, h: torch.Tensor, ids: torch.Tensor, nx: Numerics,
                records: torch.Tensor | None = None) -> torch.Tensor:
        """h [T, H, D] → h + gate·value; ids [T, n_ids]. `records`: a disk table's raw
        records of ids, already read onto the device (a graphed step reads them before the
        graph runs); otherwise the table looks the rows up itself."""
        cfg = self.cfg
        T, H, D = h.shape
        mem = (self.table.lookup(ids) if records is None
               else self.table.from_records(records, ids.shape)).flatten(1)  # [T, n_ids·hd]
        kv = self.wkv(mem, nx, torch.float32)
        key, value = kv[:, :H * D].view(T, H, D), kv[:, H * D:]
        return gate_update(h, self.qk_weight, key, value, cfg.rms_norm_eps)


def gate_update(h: torch.Tensor, qk_weight: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, eps: float) -> torch.Tensor:
    """h + gate·value, each copy's gate from its row of h and of key: h [T, H, D], qk_weight
    [H, D], key [T, H, D], value [T, D] fp32 → h's dtype. One launch on CUDA
    (strata.kernels.engram)."""
    if engram_kernels.available(h):
        return engram_kernels.gate_update(h, qk_weight, key, value, eps)
    D = h.shape[2]
    hf = h.float()
    dot = row_sum(hf * qk_weight * key)[..., 0]
    dot = dot * torch.rsqrt(row_mean(hf * hf)[..., 0] + eps) \
        * torch.rsqrt(row_mean(key * key)[..., 0] + eps)
    dot = dot / D ** 0.5
    gate = torch.sigmoid(torch.copysign(torch.sqrt(dot.abs().clamp(min=1e-6)), dot))
    return (hf + gate[..., None] * value[:, None, :]).to(h.dtype)
