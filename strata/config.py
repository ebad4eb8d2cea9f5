"""Model configuration: read, validate and derive the per-layer roles of DeepSeek-V4.1.

Two spellings are accepted (spec §1.1): the HF composite `config.json` (decoder fields under
`text_config`, model_type `deepseek_v41`) and the vendor's flat `inference/config.json`.
Everything is validated up front so a bad checkpoint fails with the field's name, not with a
shape error deep in the forward.
"""
from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from strata.errors import ConfigError

# HF text_config name -> vendor inference/config.json name, where they differ.
VENDOR_NAMES = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "qk_rope_head_dim": "rope_head_dim",
    "rms_norm_eps": "norm_eps",
    "sliding_window": "window_size",
    "n_shared_experts": "n_shared_experts",
    "num_experts_per_tok": "n_activated_experts",
    "moe_intermediate_size": "moe_inter_dim",
    "routed_scaling_factor": "route_scale",
    "scoring_func": "score_func",
    "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers",
    "candidate_source_layer_id": "candidate_source_layer",
    "engram_pad_token_id": "engram_pad_id",
    "num_nextn_predict_layers": "n_mtp_layers",
    "dspark_num_experts_per_tok": "dspark_n_activated_experts",
}

SUPPORTED_MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")
# Vendor names that are not also HF names: any of them marks a flat inference/config.json.
_VENDOR_ONLY = tuple(v for hf, v in VENDOR_NAMES.items() if v != hf) + ("original_seq_len",)


@dataclass(frozen=True)
class ModelConfig:
    """The V4.1 text decoder's configuration (names as in HF `text_config`)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    rms_norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    rope_factor: float
    beta_fast: float
    beta_slow: float
    original_max_position_embeddings: int
    max_position_embeddings: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    gate_temp: float
    swiglu_limit: float
    sliding_window: int
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    candidate_source_layer_id: int
    candidate_topk_blocks: int
    candidate_block_size: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_vocab_size: int
    engram_pad_token_id: int
    engram_compressed_vocab_size: int
    num_nextn_predict_layers: int
    dspark_block_size: int
    dspark_noise_token_id: int
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    dspark_n_routed_experts: int
    dspark_num_experts_per_tok: int
    bos_token_id: int = 0
    eos_token_id: int = 1
    image_token_id: int = 129264
    model_type: str = "deepseek_v41"

    # ---- derived roles (spec §1.1 role table) -------------------------------------------
    @property
    def n_layers(self) -> int:
        return self.num_hidden_layers

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def kv_source_of(self, layer: int) -> int | None:
        """The kv-source layer whose compressed cache `layer` reads (most recent source ≤ layer)."""
        if self.ratio(layer) == 0:
            return None
        srcs = [s for s in self.kv_source_layer_ids if s <= layer]
        return srcs[-1]

    def index_source_of(self, layer: int) -> int | None:
        """The index-source layer whose top-k selection `layer` uses (most recent ≤ layer)."""
        if self.ratio(layer) == 0:
            return None
        srcs = [s for s in self.index_source_layer_ids if s <= layer]
        return srcs[-1]

    def is_kv_source(self, layer: int) -> bool:
        return layer in self.kv_source_layer_ids

    def is_index_source(self, layer: int) -> bool:
        return layer in self.index_source_layer_ids

    def is_reindex(self, layer: int) -> bool:
        """Index source without its own keys, scoring inside the published candidate blocks."""
        return (self.is_index_source(layer) and not self.is_kv_source(layer)
                and self.candidates_enabled and layer > self.candidate_source_layer_id)

    @property
    def candidates_enabled(self) -> bool:
        return self.candidate_source_layer_id >= 0

    @property
    def hc_mix_size(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def dspark_stage_ids(self) -> tuple[int, ...]:
        """Layer ids of the DSpark stages (`mtp.k` has compress_ratios index n_layers + k)."""
        return tuple(range(self.n_layers, self.n_layers + self.num_nextn_predict_layers))

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> "ModelConfig":
        """Build from an HF composite, HF text-only or vendor flat config dict."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: top level must be a JSON object")
        top = raw
        vendor = False
        model_type = raw.get("model_type")
        if "text_config" in raw:
            text = raw["text_config"]
            if not isinstance(text, dict):
                raise ConfigError(f"{source}: text_config must be an object")
            if model_type not in (None, "deepseek_v41"):
                raise ConfigError(f"{source}: model_type {model_type!r} is not supported "
                                  f"(expected one of {SUPPORTED_MODEL_TYPES})")
            text_type = text.get("model_type")
            if text_type not in (None, "deepseek_v41_text"):
                raise ConfigError(f"{source}: text_config.model_type {text_type!r} is not "
                                  "supported (expected 'deepseek_v41_text')")
            model_type = "deepseek_v41"
        elif any(v in raw for v in _VENDOR_ONLY):
            vendor = True
            text = {hf: raw[v] for hf, v in VENDOR_NAMES.items() if v in raw}
            text.update({k: v for k, v in raw.items() if k not in VENDOR_NAMES.values()})
            model_type = model_type or "deepseek_v41"
        else:
            text = raw
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"{source}: model_type {model_type!r} is not supported "
                              f"(expected one of {SUPPORTED_MODEL_TYPES})")
        vals = _flatten_rope(text, source)
        for k in ("bos_token_id", "eos_token_id", "image_token_id"):
            if k not in vals and k in top:
                vals[k] = top[k]
        vals["model_type"] = "deepseek_v41"
        known = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        missing = []
        for name, f in known.items():
            if name in vals:
                shown = f"{name} (vendor: {VENDOR_NAMES[name]})" \
                    if vendor and VENDOR_NAMES.get(name, name) != name else name
                kwargs[name] = _coerce(shown, vals[name], f.type, source)
            elif name in _DEFAULTS:
                kwargs[name] = _DEFAULTS[name]
            elif f.default is not MISSING:  # has a dataclass default
                continue
            else:
                missing.append(f"{name} (vendor: {VENDOR_NAMES[name]})"
                               if vendor and VENDOR_NAMES.get(name, name) != name else name)
        if missing:
            raise ConfigError(f"{source}: missing field(s) {', '.join(missing)}")
        cfg = cls(**kwargs)
        cfg.validate(source)
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_model_dir(cls, folder: str | Path) -> "ModelConfig":
        folder = Path(folder)
        for cand in (folder / "config.json", folder / "inference" / "config.json"):
            if cand.exists():
                return cls.from_file(cand)
        raise ConfigError(f"{folder}: no config.json (nor inference/config.json)")

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF composite form (used by the fixture writer)."""
        text = {f.name: getattr(self, f.name) for f in fields(self)}
        for k in ("rope_factor", "beta_fast", "beta_slow", "original_max_position_embeddings"):
            text.pop(k)
        text["rope_scaling"] = {
            "type": "yarn", "factor": self.rope_factor, "beta_fast": self.beta_fast,
            "beta_slow": self.beta_slow,
            "original_max_position_embeddings": self.original_max_position_embeddings}
        text = {k: list(v) if isinstance(v, tuple) else v for k, v in text.items()}
        text["model_type"] = "deepseek_v41_text"
        return {
            "architectures": ["DeepseekV41ForCausalLM"],
            "model_type": "deepseek_v41",
            "image_token_id": self.image_token_id,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "dtype": "bfloat16",
            "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                    "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
                                    "expert_dtype": "fp4"},
            "text_config": text,
        }

    # ---- validation ---------------------------------------------------------------------
    def validate(self, source: str = "config") -> None:
        def bad(msg: str) -> ConfigError:
            return ConfigError(f"{source}: {msg}")

        L = self.num_hidden_layers
        if L < 1:
            raise bad("num_hidden_layers must be ≥ 1")
        n_ratios = L + self.num_nextn_predict_layers
        if len(self.compress_ratios) not in (L, n_ratios):
            raise bad(f"compress_ratios has {len(self.compress_ratios)} entries; expected "
                      f"num_hidden_layers ({L}) or num_hidden_layers + "
                      f"num_nextn_predict_layers ({n_ratios})")
        for i, r in enumerate(self.compress_ratios):
            if r not in (0, 1, 2):
                raise bad(f"compress_ratios[{i}] = {r}; V4.1 uses only 0, 1 and 2")
        for i in range(L, len(self.compress_ratios)):
            if self.compress_ratios[i] != 0:
                raise bad(f"compress_ratios[{i}] = {self.compress_ratios[i]}: DSpark stages "
                          "are window-only (ratio 0)")
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids",
                     "dspark_target_layer_ids"):
            ids = getattr(self, name)
            if list(ids) != sorted(set(ids)):
                raise bad(f"{name} {list(ids)} must be strictly increasing")
            for i in ids:
                if not 0 <= i < L:
                    raise bad(f"{name} contains {i}, outside layers 0..{L - 1}")
        for s in self.kv_source_layer_ids:
            if self.ratio(s) == 0:
                raise bad(f"kv_source_layer_ids contains {s}, whose compress ratio is 0")
        for l in range(L):
            r = self.ratio(l)
            if r == 0:
                continue
            src = [s for s in self.kv_source_layer_ids if s <= l]
            if not src:
                raise bad(f"layer {l} has compress ratio {r} but no kv source layer ≤ {l}")
            if self.ratio(src[-1]) != r:
                raise bad(f"layer {l} (ratio {r}) would read kv source layer {src[-1]} "
                          f"of ratio {self.ratio(src[-1])}")
            isrc = [s for s in self.index_source_layer_ids if s <= l]
            if not isrc:
                raise bad(f"layer {l} has compress ratio {r} but no index source layer ≤ {l}")
            if self.ratio(isrc[-1]) != r:
                raise bad(f"layer {l} (ratio {r}) would use index source {isrc[-1]} of ratio "
                          f"{self.ratio(isrc[-1])}")
        for s in self.index_source_layer_ids:
            if self.ratio(s) == 0:
                raise bad(f"index_source_layer_ids contains {s}, whose compress ratio is 0")
        if self.candidates_enabled:
            c = self.candidate_source_layer_id
            if c not in self.kv_source_layer_ids or c not in self.index_source_layer_ids:
                raise bad(f"candidate_source_layer_id {c} must be both a kv and an index source")
            if c > 0 and self.ratio(c - 1) == self.ratio(c):
                raise bad(f"candidate_source_layer_id {c} must be the first layer of its "
                          "ratio group")
            if self.candidate_block_size < 1 or self.candidate_topk_blocks < 1:
                raise bad("candidate_block_size and candidate_topk_blocks must be ≥ 1")
        for s in self.index_source_layer_ids:
            if not self.is_kv_source(s) and not self.is_reindex(s):
                raise bad(f"index source layer {s} owns no keys and is not a reindex layer "
                          "after the candidate source")
        for k in ("hidden_size", "head_dim", "q_lora_rank", "o_lora_rank",
                  "moe_intermediate_size", "index_head_dim", "engram_head_dim"):
            if getattr(self, k) % 32:
                raise bad(f"{k} = {getattr(self, k)} is not a multiple of 32 (hidden_size, "
                          "head_dim, q_lora_rank, o_lora_rank, moe_intermediate_size, "
                          "index_head_dim and engram_head_dim are quantised in 32-wide blocks)")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            raise bad("qk_rope_head_dim must be even and ≤ head_dim")
        if self.qk_rope_head_dim > self.index_head_dim:
            raise bad("qk_rope_head_dim must be ≤ index_head_dim")
        if self.num_attention_heads % self.o_groups:
            raise bad(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                      f"o_groups {self.o_groups}")
        if self.o_lora_rank * self.o_groups % 32:
            raise bad("o_lora_rank·o_groups must be a multiple of 32")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise bad("num_experts_per_tok must be in 1..n_routed_experts")
        if self.num_nextn_predict_layers and not (
                1 <= self.dspark_num_experts_per_tok <= self.dspark_n_routed_experts):
            raise bad("dspark_num_experts_per_tok must be in 1..dspark_n_routed_experts")
        if self.n_shared_experts not in (0, 1):
            raise bad(f"n_shared_experts = {self.n_shared_experts}; V4.1 has one")
        if self.hc_mult < 1 or self.hc_sinkhorn_iters < 1:
            raise bad("hc_mult and hc_sinkhorn_iters must be ≥ 1")
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise bad(f"engram_num_embeddings has {len(self.engram_num_embeddings)} entries for "
                      f"{len(self.engram_layer_ids)} engram layers")
        if self.engram_layer_ids and self.engram_max_ngram_size < 2:
            raise bad("engram_max_ngram_size must be ≥ 2")
        if self.num_nextn_predict_layers and len(self.dspark_target_layer_ids) == 0:
            raise bad("dspark_target_layer_ids is empty but DSpark stages are configured")
        if self.sliding_window < 1:
            raise bad("sliding_window must be ≥ 1")
        for k in ("bos_token_id", "eos_token_id", "engram_pad_token_id"):
            if not 0 <= getattr(self, k) < self.vocab_size:
                raise bad(f"{k} = {getattr(self, k)} is outside the vocabulary")


_DEFAULTS: dict[str, Any] = {
    "gate_temp": 1.0,
    "rope_factor": 1.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "original_max_position_embeddings": 0,
    "candidate_source_layer_id": -1,
    "candidate_topk_blocks": 0,
    "candidate_block_size": 8,
    "engram_layer_ids": (),
    "engram_num_embeddings": (),
    "engram_max_ngram_size": 4,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_vocab_size": 0,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 0,
    "num_nextn_predict_layers": 0,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 0,
    "dspark_target_layer_ids": (),
    "dspark_markov_rank": 0,
    "dspark_n_routed_experts": 0,
    "dspark_num_experts_per_tok": 0,
    "max_position_embeddings": 1048576,
    "n_shared_experts": 1,
    "hc_eps": 1e-6,
}


def _flatten_rope(text: dict[str, Any], source: str) -> dict[str, Any]:
    vals = dict(text)
    rs = vals.pop("rope_scaling", None)
    if rs is not None:
        if not isinstance(rs, dict):
            raise ConfigError(f"{source}: rope_scaling must be an object")
        kind = rs.get("type", rs.get("rope_type"))
        if kind != "yarn":
            raise ConfigError(f"{source}: rope_scaling type {kind!r}; V4.1 uses 'yarn'")
        for k_in, k_out in (("factor", "rope_factor"), ("beta_fast", "beta_fast"),
                            ("beta_slow", "beta_slow"),
                            ("original_max_position_embeddings",
                             "original_max_position_embeddings")):
            if k_in in rs:
                vals[k_out] = rs[k_in]
    # vendor spellings of the rope fields
    for k_in, k_out in (("original_seq_len", "original_max_position_embeddings"),):
        if k_in in vals and k_out not in vals:
            vals[k_out] = vals.pop(k_in)
    return vals


def _as_int(value: Any) -> int:
    """A JSON integer (an integral float like 5120.0 too); not a bool, string or fraction."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or (isinstance(value, float) and not value.is_integer()):
        raise TypeError
    return int(value)


def _coerce(name: str, value: Any, typ: Any, source: str) -> Any:
    typ = str(typ)
    try:
        if typ.startswith("tuple"):
            if not isinstance(value, (list, tuple)):
                raise TypeError
            return tuple(_as_int(v) for v in value)
        if typ == "int":
            return _as_int(value)
        if typ == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError
            return float(value)
        if typ == "str":
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: field {name} = {value!r} is not a valid {typ}") from None
    return value


def v41_flash_config() -> ModelConfig:
    """The published V4.1-Flash text config (spec §1.1), for synthetic models and tests."""
    return ModelConfig(
        vocab_size=129280, hidden_size=5120, num_hidden_layers=40, num_attention_heads=64,
        head_dim=512, qk_rope_head_dim=64, q_lora_rank=1280, o_lora_rank=1024, o_groups=8,
        rms_norm_eps=1e-20, rope_theta=10000.0, compress_rope_theta=160000.0, rope_factor=16.0,
        beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=65536,
        max_position_embeddings=1048576, n_routed_experts=384, n_shared_experts=1,
        num_experts_per_tok=6, moe_intermediate_size=2304, routed_scaling_factor=1.5,
        gate_temp=1.0, swiglu_limit=10.0, sliding_window=128,
        compress_ratios=tuple([0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]),
        kv_source_layer_ids=(2, 8, 14, 20), index_source_layer_ids=(2, 8, 14, 20, 24, 28, 32, 36),
        index_n_heads=32, index_head_dim=128, index_topk=512, candidate_source_layer_id=20,
        candidate_topk_blocks=2048, candidate_block_size=8, hc_mult=4, hc_sinkhorn_iters=20,
        hc_eps=1e-6, engram_layer_ids=(1, 14), engram_num_embeddings=(384006168, 384016682),
        engram_max_ngram_size=4, engram_n_heads=8, engram_head_dim=256,
        engram_vocab_size=16000000, engram_pad_token_id=2, engram_compressed_vocab_size=99092,
        num_nextn_predict_layers=3, dspark_block_size=5, dspark_noise_token_id=128799,
        dspark_target_layer_ids=(37, 38, 39), dspark_markov_rank=256,
        dspark_n_routed_experts=128, dspark_num_experts_per_tok=3)
