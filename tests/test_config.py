"""ModelConfig: both config spellings (spec §1.1), the derived layer roles, and clear errors.

Every bad-config case must raise ConfigError whose message names the field at fault, so a
broken download is reported up front instead of as a shape error deep in the forward.
"""
from __future__ import annotations

import copy
import json
from dataclasses import fields, replace

import pytest

from strata.checkpoint.tiny import base_config
from strata.config import ModelConfig, v41_flash_config
from strata.errors import ConfigError, StrataError

# ---- the two spellings, written out by hand from spec §1.1 ------------------------------

V41_RATIOS = [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]


def hf_composite() -> dict:
    """The HF composite config.json of V4.1-Flash, field by field from spec §1.1."""
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "image_token_id": 129264,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
                                "expert_dtype": "fp4"},
        "text_config": {
            "model_type": "deepseek_v41_text",
            "vocab_size": 129280,
            "hidden_size": 5120,
            "num_hidden_layers": 40,
            "num_attention_heads": 64,
            "num_key_value_heads": 1,
            "head_dim": 512,
            "qk_rope_head_dim": 64,
            "q_lora_rank": 1280,
            "o_lora_rank": 1024,
            "o_groups": 8,
            "hidden_act": "silu",
            "swiglu_limit": 10.0,
            "rms_norm_eps": 1e-20,
            "tie_word_embeddings": False,
            "max_position_embeddings": 1048576,
            "rope_theta": 10000,
            "compress_rope_theta": 160000,
            "rope_scaling": {"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                             "original_max_position_embeddings": 65536},
            "n_routed_experts": 384,
            "n_shared_experts": 1,
            "num_experts_per_tok": 6,
            "moe_intermediate_size": 2304,
            "scoring_func": "sqrtsoftplus",
            "topk_method": "noaux_tc",
            "norm_topk_prob": True,
            "routed_scaling_factor": 1.5,
            "gate_temp": 1.0,
            "sliding_window": 128,
            "compress_ratios": list(V41_RATIOS),
            "kv_source_layer_ids": [2, 8, 14, 20],
            "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
            "index_n_heads": 32,
            "index_head_dim": 128,
            "index_topk": 512,
            "candidate_source_layer_id": 20,
            "candidate_topk_blocks": 2048,
            "candidate_block_size": 8,
            "hc_mult": 4,
            "hc_sinkhorn_iters": 20,
            "hc_eps": 1e-6,
            "engram_layer_ids": [1, 14],
            "engram_num_embeddings": [384006168, 384016682],
            "engram_max_ngram_size": 4,
            "engram_n_heads": 8,
            "engram_head_dim": 256,
            "engram_vocab_size": 16000000,
            "engram_pad_token_id": 2,
            "engram_compressed_vocab_size": 99092,
            "num_nextn_predict_layers": 3,
            "dspark_block_size": 5,
            "dspark_noise_token_id": 128799,
            "dspark_target_layer_ids": [37, 38, 39],
            "dspark_markov_rank": 256,
            "dspark_n_routed_experts": 128,
            "dspark_num_experts_per_tok": 3,
        },
    }


def vendor_flat() -> dict:
    """The vendor's flat inference/config.json spelling of the same model (spec §1.1, 3rd column)."""
    return {
        "vocab_size": 129280,
        "dim": 5120,
        "n_layers": 40,
        "n_heads": 64,
        "head_dim": 512,
        "rope_head_dim": 64,
        "q_lora_rank": 1280,
        "o_lora_rank": 1024,
        "o_groups": 8,
        "swiglu_limit": 10.0,
        "norm_eps": 1e-20,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_factor": 16,
        "beta_fast": 32,
        "beta_slow": 1,
        "original_seq_len": 65536,
        "n_routed_experts": 384,
        "n_shared_experts": 1,
        "n_activated_experts": 6,
        "moe_inter_dim": 2304,
        "score_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "route_scale": 1.5,
        "gate_temp": 1.0,
        "window_size": 128,
        "compress_ratios": list(V41_RATIOS),
        "kv_source_layers": [2, 8, 14, 20],
        "index_source_layers": [2, 8, 14, 20, 24, 28, 32, 36],
        "index_n_heads": 32,
        "index_head_dim": 128,
        "index_topk": 512,
        "candidate_source_layer": 20,
        "candidate_topk_blocks": 2048,
        "candidate_block_size": 8,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "engram_layer_ids": [1, 14],
        "engram_num_embeddings": [384006168, 384016682],
        "engram_max_ngram_size": 4,
        "engram_n_heads": 8,
        "engram_head_dim": 256,
        "engram_vocab_size": 16000000,
        "engram_pad_id": 2,
        "engram_compressed_vocab_size": 99092,
        "n_mtp_layers": 3,
        "dspark_block_size": 5,
        "dspark_noise_token_id": 128799,
        "dspark_target_layer_ids": [37, 38, 39],
        "dspark_markov_rank": 256,
        "dspark_n_routed_experts": 128,
        "dspark_n_activated_experts": 3,
        "dtype": "fp8",
        "expert_dtype": "fp4",
    }


def with_text(**changes) -> dict:
    """The HF composite with text_config fields changed (value None deletes the field)."""
    raw = hf_composite()
    for k, v in changes.items():
        if v is None:
            raw["text_config"].pop(k)
        else:
            raw["text_config"][k] = v
    return raw


def config_error(raw: dict, *needles: str) -> str:
    """from_dict must raise ConfigError whose message contains every needle; returns it."""
    with pytest.raises(ConfigError) as ei:
        ModelConfig.from_dict(raw, source="cfg.json")
    msg = str(ei.value)
    assert isinstance(ei.value, StrataError)
    assert msg.startswith("cfg.json"), msg  # the source is named
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


# ---- reading the good configs -----------------------------------------------------------

def test_hf_composite_round_trip_equals_published_config():
    ref = v41_flash_config()
    raw = json.loads(json.dumps(ref.to_hf_dict()))  # exactly what a config.json holds
    assert raw["model_type"] == "deepseek_v41"
    assert raw["text_config"]["model_type"] == "deepseek_v41_text"
    assert raw["text_config"]["rope_scaling"] == {
        "type": "yarn", "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 65536}
    assert ModelConfig.from_dict(raw) == ref


def test_hand_written_hf_config_equals_published_config():
    cfg = ModelConfig.from_dict(hf_composite())
    assert cfg == v41_flash_config()
    # spot checks of the values and of their types after coercion
    assert cfg.rope_factor == 16.0 and isinstance(cfg.rope_factor, float)
    assert cfg.original_max_position_embeddings == 65536
    assert cfg.beta_fast == 32.0 and cfg.beta_slow == 1.0
    assert cfg.rope_theta == 10000.0 and isinstance(cfg.rope_theta, float)
    assert cfg.compress_ratios == tuple(V41_RATIOS) and len(cfg.compress_ratios) == 43
    assert cfg.kv_source_layer_ids == (2, 8, 14, 20)
    assert cfg.engram_num_embeddings == (384006168, 384016682)
    assert cfg.dspark_stage_ids == (40, 41, 42)
    assert cfg.hc_mix_size == 24  # hc_attn_fn is [24, 4·5120] (spec §3.2)
    assert cfg.image_token_id == 129264 and cfg.bos_token_id == 0 and cfg.eos_token_id == 1
    assert cfg.model_type == "deepseek_v41"


def test_rope_type_key_spelling():
    raw = hf_composite()
    rs = raw["text_config"]["rope_scaling"]
    rs["rope_type"] = rs.pop("type")
    assert ModelConfig.from_dict(raw) == v41_flash_config()


def test_text_config_alone():
    """An HF text-only config (model_type deepseek_v41_text) reads the same decoder."""
    text = hf_composite()["text_config"]
    text.update(bos_token_id=0, eos_token_id=1, image_token_id=129264)
    assert ModelConfig.from_dict(text) == v41_flash_config()


def test_vendor_flat_equals_hf():
    assert ModelConfig.from_dict(vendor_flat()) == ModelConfig.from_dict(hf_composite())
    assert ModelConfig.from_dict(vendor_flat()) == v41_flash_config()


def test_from_file_and_model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_composite()))
    assert ModelConfig.from_file(tmp_path / "config.json") == v41_flash_config()
    assert ModelConfig.from_model_dir(tmp_path) == v41_flash_config()
    # the vendor layout: only inference/config.json
    vendor = tmp_path / "vendor"
    (vendor / "inference").mkdir(parents=True)
    (vendor / "inference" / "config.json").write_text(json.dumps(vendor_flat()))
    assert ModelConfig.from_model_dir(vendor) == v41_flash_config()


def test_optional_fields_take_defaults():
    cfg = ModelConfig.from_dict(with_text(gate_temp=None, hc_eps=None))
    assert cfg.gate_temp == 1.0 and cfg.hc_eps == 1e-6


# ---- derived roles (spec §1.1 role table) -----------------------------------------------

# layer: (ratio, kv_source_of, index_source_of, is_kv_source, is_index_source, is_reindex)
V41_ROLES = {
    0: (0, None, None, False, False, False),
    1: (0, None, None, False, False, False),
    2: (2, 2, 2, True, True, False),     # encoder Full
    3: (2, 2, 2, False, False, False),   # encoder Reuse of 2
    8: (2, 8, 8, True, True, False),
    13: (2, 8, 8, False, False, False),
    14: (2, 14, 14, True, True, False),
    19: (2, 14, 14, False, False, False),
    20: (1, 20, 20, True, True, False),  # decoder source + candidate source
    21: (1, 20, 20, False, False, False),
    24: (1, 20, 24, False, True, True),  # reindex: reads 20's KV, scores itself
    25: (1, 20, 24, False, False, False),
    36: (1, 20, 36, False, True, True),
    39: (1, 20, 36, False, False, False),
}


@pytest.mark.parametrize("cfg_source", ["published", "hf", "vendor"])
def test_v41_roles(cfg_source):
    cfg = {"published": v41_flash_config,
           "hf": lambda: ModelConfig.from_dict(hf_composite()),
           "vendor": lambda: ModelConfig.from_dict(vendor_flat())}[cfg_source]()
    assert cfg.candidates_enabled and cfg.candidate_source_layer_id == 20
    for layer, (r, kv, idx, is_kv, is_idx, reidx) in V41_ROLES.items():
        got = (cfg.ratio(layer), cfg.kv_source_of(layer), cfg.index_source_of(layer),
               cfg.is_kv_source(layer), cfg.is_index_source(layer), cfg.is_reindex(layer))
        assert got == (r, kv, idx, is_kv, is_idx, reidx), layer


def test_v41_role_table_in_full():
    cfg = v41_flash_config()
    for l in range(cfg.n_layers):
        if l < 2:
            assert cfg.kv_source_of(l) is None and cfg.index_source_of(l) is None
        elif l < 20:
            assert cfg.ratio(l) == 2
            assert cfg.kv_source_of(l) == cfg.index_source_of(l) == max(s for s in (2, 8, 14) if s <= l)
        else:
            assert cfg.ratio(l) == 1 and cfg.kv_source_of(l) == 20
            assert cfg.index_source_of(l) == max(s for s in (20, 24, 28, 32, 36) if s <= l)
        assert cfg.is_reindex(l) == (l in (24, 28, 32, 36))
    for stage in cfg.dspark_stage_ids:
        assert cfg.ratio(stage) == 0 and cfg.kv_source_of(stage) is None


def test_tiny_fixture_roles():
    """The fixture architecture of strata.checkpoint.tiny covers every role (its docstring)."""
    cfg = replace(base_config(320, 100, 267, 266), engram_num_embeddings=(10, 10))
    cfg.validate("tiny")
    roles = [(cfg.ratio(l), cfg.kv_source_of(l), cfg.index_source_of(l), cfg.is_reindex(l))
             for l in range(cfg.n_layers)]
    assert roles == [(0, None, None, False), (2, 1, 1, False), (2, 1, 1, False),
                     (1, 3, 3, False), (1, 3, 3, False), (1, 3, 5, True), (1, 3, 5, False),
                     (1, 3, 5, False)]


# ---- errors -----------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["deepseek_v4", "deepseek_v3", "llama", ""])
def test_unknown_model_type_top_level(model_type):
    raw = hf_composite()
    raw["model_type"] = model_type
    config_error(raw, "model_type", repr(model_type))


def test_unknown_model_type_in_text_config():
    """A composite whose decoder says it is some other model must not be read as V4.1."""
    config_error(with_text(model_type="deepseek_v4_text"), "model_type", "'deepseek_v4_text'")


def test_unknown_model_type_text_only_and_vendor():
    text = hf_composite()["text_config"]
    text["model_type"] = "deepseek_v4"
    config_error(text, "model_type", "'deepseek_v4'")
    flat = vendor_flat()
    flat["model_type"] = "deepseek_v4"
    config_error(flat, "model_type", "'deepseek_v4'")


def test_text_only_without_model_type():
    text = hf_composite()["text_config"]
    del text["model_type"]
    config_error(text, "model_type")


@pytest.mark.parametrize("name", ["vocab_size", "hidden_size", "compress_ratios",
                                  "kv_source_layer_ids", "index_topk", "head_dim",
                                  "swiglu_limit", "o_groups"])
def test_missing_field_hf(name):
    config_error(with_text(**{name: None}), "missing", name)


@pytest.mark.parametrize("vendor_name,hf_name", [("dim", "hidden_size"), ("n_layers", "num_hidden_layers"),
                                                 ("kv_source_layers", "kv_source_layer_ids"),
                                                 ("moe_inter_dim", "moe_intermediate_size")])
def test_missing_field_vendor(vendor_name, hf_name):
    """A vendor config missing a field is reported as missing (under either spelling), not
    mistaken for some other kind of config."""
    flat = vendor_flat()
    del flat[vendor_name]
    msg = config_error(flat, "missing")
    assert vendor_name in msg or hf_name in msg, msg


def test_several_missing_fields_all_named():
    msg = config_error(with_text(vocab_size=None, index_topk=None), "missing")
    assert "vocab_size" in msg and "index_topk" in msg


@pytest.mark.parametrize("n", [40 - 1, 42, 44, 0])
def test_compress_ratios_wrong_length(n):
    ratios = (V41_RATIOS * 2)[:n]
    config_error(with_text(compress_ratios=ratios), "compress_ratios", f"has {n} entries")


def test_compress_ratios_without_stage_entries_is_accepted():
    """num_hidden_layers entries (no DSpark stages listed) is a legal length."""
    cfg = ModelConfig.from_dict(with_text(compress_ratios=V41_RATIOS[:40]))
    assert len(cfg.compress_ratios) == 40


@pytest.mark.parametrize("layer,value", [(5, 4), (25, 128), (0, 3), (10, -1)])
def test_compress_ratio_value(layer, value):
    ratios = list(V41_RATIOS)
    ratios[layer] = value
    config_error(with_text(compress_ratios=ratios), f"compress_ratios[{layer}]", str(value))


@pytest.mark.parametrize("stage,value", [(40, 1), (42, 2)])
def test_dspark_stage_ratio_must_be_zero(stage, value):
    ratios = list(V41_RATIOS)
    ratios[stage] = value
    msg = config_error(with_text(compress_ratios=ratios), f"compress_ratios[{stage}]")
    assert "DSpark" in msg


def test_kv_source_on_ratio_zero_layer():
    config_error(with_text(kv_source_layer_ids=[0, 2, 8, 14, 20]), "kv_source_layer_ids", "0")
    config_error(with_text(index_source_layer_ids=[1, 2, 8, 14, 20, 24, 28, 32, 36]),
                 "index_source_layer_ids", "1")


@pytest.mark.parametrize("name,ids,needle", [
    ("kv_source_layer_ids", [2, 8, 14, 40], "40"),
    ("kv_source_layer_ids", [-1, 2, 8, 14, 20], "-1"),
    ("index_source_layer_ids", [2, 8, 14, 20, 24, 28, 32, 36, 45], "45"),
    ("engram_layer_ids", [1, 40], "40"),
    ("dspark_target_layer_ids", [37, 38, 40], "40"),
])
def test_source_ids_out_of_range(name, ids, needle):
    msg = config_error(with_text(**{name: ids}), name, needle)
    assert "0..39" in msg


@pytest.mark.parametrize("name,ids", [
    ("kv_source_layer_ids", [2, 14, 8, 20]),
    ("kv_source_layer_ids", [2, 8, 8, 14, 20]),
    ("index_source_layer_ids", [2, 8, 14, 20, 28, 24, 32, 36]),
    ("engram_layer_ids", [14, 1]),
    ("dspark_target_layer_ids", [39, 38, 37]),
])
def test_source_ids_unsorted(name, ids):
    config_error(with_text(**{name: ids}), name, "increasing")


def test_candidate_source_layer_checks():
    config_error(with_text(candidate_source_layer_id=24), "candidate_source_layer_id", "24")
    # < 0 disables the candidate stage; then 24..36 would own no keys and fail as index sources
    config_error(with_text(candidate_source_layer_id=-1), "index source layer 24")


@pytest.mark.parametrize("name,value", [("hidden_size", 5000), ("head_dim", 500),
                                        ("q_lora_rank", 1270), ("o_lora_rank", 1000),
                                        ("moe_intermediate_size", 2300),
                                        ("index_head_dim", 120), ("engram_head_dim", 250)])
def test_dims_multiple_of_32(name, value):
    """The message names the offending field and its value, not just the list of rules."""
    msg = config_error(with_text(**{name: value}), name, str(value))
    assert "32" in msg


def test_n_heads_multiple_of_o_groups():
    config_error(with_text(num_attention_heads=60), "num_attention_heads", "60", "o_groups", "8")
    config_error(with_text(o_groups=7), "num_attention_heads", "o_groups", "7")


@pytest.mark.parametrize("rows", [[384006168], [384006168, 384016682, 5], []])
def test_engram_num_embeddings_length(rows):
    config_error(with_text(engram_num_embeddings=rows), "engram_num_embeddings",
                 f"has {len(rows)} entries")


def test_other_consistency_errors():
    config_error(with_text(num_experts_per_tok=400), "num_experts_per_tok")
    config_error(with_text(dspark_num_experts_per_tok=0), "dspark_num_experts_per_tok")
    config_error(with_text(n_shared_experts=2), "n_shared_experts")
    config_error(with_text(sliding_window=0), "sliding_window")
    config_error(with_text(engram_pad_token_id=129280), "engram_pad_token_id")
    config_error(with_text(qk_rope_head_dim=63), "qk_rope_head_dim")
    config_error(with_text(dspark_target_layer_ids=[]), "dspark_target_layer_ids")
    config_error(with_text(num_hidden_layers=0), "num_hidden_layers")


def test_rope_scaling_errors():
    rs = hf_composite()["text_config"]["rope_scaling"]
    config_error(with_text(rope_scaling={**rs, "type": "linear"}), "rope_scaling", "'linear'")
    config_error(with_text(rope_scaling=[16]), "rope_scaling")


@pytest.mark.parametrize("name,value", [
    ("hidden_size", "5120"),          # a number spelled as a string
    ("hidden_size", "big"),
    ("hidden_size", 5120.5),
    ("hidden_size", True),
    ("hidden_size", [5120]),
    ("num_hidden_layers", "40"),
    ("rms_norm_eps", "1e-20"),
    ("routed_scaling_factor", "1.5"),
    ("rope_theta", False),
    ("compress_ratios", "0,0,2"),
    ("compress_ratios", [0, 0] + [2.5] * 18 + [1] * 20 + [0, 0, 0]),
    ("compress_ratios", [0, 0] + ["2"] * 18 + [1] * 20 + [0, 0, 0]),
    ("engram_layer_ids", [True, 14]),           # a bool is not a layer id
    ("kv_source_layer_ids", 20),
    ("engram_num_embeddings", {"1": 384006168, "14": 384016682}),
])
def test_wrong_value_type(name, value):
    config_error(with_text(**{name: value}), name)


def test_wrong_value_type_vendor():
    flat = vendor_flat()
    flat["dim"] = "5120"
    msg = config_error(flat)
    assert "hidden_size" in msg or "dim" in msg, msg


def test_integral_float_is_accepted():
    """JSON writers sometimes emit 5120.0; an integral float is the same number."""
    assert ModelConfig.from_dict(with_text(hidden_size=5120.0)).hidden_size == 5120


def test_top_level_not_an_object():
    for raw in ([1, 2], "config", None):
        with pytest.raises(ConfigError, match="cfg.json"):
            ModelConfig.from_dict(raw, source="cfg.json")
    raw = hf_composite()
    raw["text_config"] = [1]
    config_error(raw, "text_config")


def test_bad_json_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_text('{"model_type": "deepseek_v41", "text_config": {')
    with pytest.raises(ConfigError) as ei:
        ModelConfig.from_file(p)
    assert str(p) in str(ei.value) and "JSON" in str(ei.value)
    with pytest.raises(ConfigError, match="JSON"):
        ModelConfig.from_model_dir(tmp_path)
    p.write_text("[1, 2, 3]")
    with pytest.raises(ConfigError, match="JSON object"):
        ModelConfig.from_file(p)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError) as ei:
        ModelConfig.from_model_dir(tmp_path)
    assert str(tmp_path) in str(ei.value) and "config.json" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        ModelConfig.from_file(tmp_path / "nope.json")
    assert "nope.json" in str(ei.value)


def test_source_names_the_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(with_text(hidden_size=5000)))
    with pytest.raises(ConfigError) as ei:
        ModelConfig.from_file(p)
    assert str(ei.value).startswith(str(p)) and "hidden_size" in str(ei.value)


def test_hand_written_dicts_are_not_mutated():
    raw, flat = hf_composite(), vendor_flat()
    raw0, flat0 = copy.deepcopy(raw), copy.deepcopy(flat)
    ModelConfig.from_dict(raw)
    ModelConfig.from_dict(flat)
    assert raw == raw0 and flat == flat0


def test_hand_written_config_covers_every_field():
    """The hand-written spec dict spells out every ModelConfig field (so the equality tests cover them all)."""
    base = ModelConfig.from_dict(hf_composite())
    skip = {"model_type", "bos_token_id", "eos_token_id", "image_token_id",
            "rope_factor", "beta_fast", "beta_slow", "original_max_position_embeddings"}
    text = hf_composite()["text_config"]
    for f in fields(ModelConfig):
        if f.name in skip:
            continue
        assert f.name in text, f.name
