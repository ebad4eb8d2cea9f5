"""Bad checkpoints and bad forward inputs fail cleanly, naming what is at fault.

Each checkpoint test damages its own copy of the tiny fixture (spec §3 layout: sharded
safetensors + index + config.json + tokenizer); `Model.load` must raise a `strata.errors`
error naming the file, tensor or field. Forward tests check that a forward which raises leaves
the decode state exactly as it was (position, tokens and every cache a later forward reads).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from strata.checkpoint.safetensors_io import INDEX_NAME, SafetensorsFile, write_safetensors
from strata.errors import CapacityError, CheckpointError, ConfigError, StrataError
from strata.model.model import Model

from util import random_tokens


# ---- fixture plumbing -------------------------------------------------------------------

@pytest.fixture
def ckpt(tiny_dir, tmp_path) -> Path:
    """A fresh, private copy of the tiny fixture (make_tiny(…, "tiny", seed=0)) to damage."""
    return Path(shutil.copytree(tiny_dir, tmp_path / "ckpt"))


def load(folder: Path) -> Model:
    return Model.load(folder, "cpu", cache_dir=folder.parent / "token-map-cache")


def load_error(folder: Path, kind: type[StrataError], *needles: str) -> str:
    """Model.load must raise `kind` whose message contains every needle; returns the message."""
    with pytest.raises(kind) as ei:
        load(folder)
    msg = str(ei.value)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


def shard_of(folder: Path, tensor: str) -> Path:
    index = json.loads((folder / INDEX_NAME).read_text())
    return folder / index["weight_map"][tensor]


def read_shard(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, str]]:
    """Every tensor of a shard with its stored dtype string and the metadata."""
    with SafetensorsFile(path) as f:
        names = f.names()
        return ({n: f.read(n) for n in names}, {n: f.info(n).dtype for n in names},
                dict(f.metadata))


def rewrite(folder: Path, tensor: str, new: torch.Tensor | None, dtype: str | None = None) -> Path:
    """Rewrite the shard holding `tensor` with it replaced (or dropped when `new` is None)."""
    path = shard_of(folder, tensor)
    tensors, dtypes, meta = read_shard(path)
    assert tensor in tensors
    if new is None:
        del tensors[tensor], dtypes[tensor]
    else:
        tensors[tensor] = new
        dtypes[tensor] = dtype
    write_safetensors(path, tensors, dtypes=dtypes, metadata=meta)
    return path


def stored(folder: Path, tensor: str) -> torch.Tensor:
    with SafetensorsFile(shard_of(folder, tensor)) as f:
        return f.read(tensor)


def edit_config(folder: Path, **text_changes) -> None:
    p = folder / "config.json"
    raw = json.loads(p.read_text())
    raw["text_config"].update(text_changes)
    p.write_text(json.dumps(raw))


def test_pristine_copy_loads(ckpt):
    """The undamaged copy loads: every failure below is due to its one defect."""
    m = load(ckpt)
    assert m.cfg.vocab_size == 320 and len(m.layers) == 8


# ---- files ------------------------------------------------------------------------------

def test_shard_missing_on_disk(ckpt):
    shard = shard_of(ckpt, "layers.5.attn.wq_a.weight")
    shard.unlink()
    msg = load_error(ckpt, CheckpointError, shard.name, "missing")
    assert INDEX_NAME in msg


def test_truncated_shard(ckpt):
    shard = shard_of(ckpt, "layers.6.attn.wq_a.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[:-1000])
    msg = load_error(ckpt, CheckpointError, shard.name, "truncated")
    assert "tensor 'layers." in msg  # the first tensor the short file cannot hold


def test_shard_truncated_inside_header(ckpt):
    shard = shard_of(ckpt, "mtp.0.attn.wq_a.weight")
    shard.write_bytes(shard.read_bytes()[:100])
    load_error(ckpt, CheckpointError, shard.name, "header")


def test_empty_shard(ckpt):
    shard = shard_of(ckpt, "embed.weight")
    shard.write_bytes(b"")
    load_error(ckpt, CheckpointError, shard.name)


def test_no_index_and_no_single_file(ckpt):
    (ckpt / INDEX_NAME).unlink()
    load_error(ckpt, CheckpointError, INDEX_NAME, str(ckpt))


def test_index_not_json(ckpt):
    (ckpt / INDEX_NAME).write_text("{")
    load_error(ckpt, CheckpointError, INDEX_NAME)


# ---- dtypes -----------------------------------------------------------------------------

def test_norm_weight_stored_as_i8(ckpt):
    name = "layers.0.attn_norm.weight"
    path = rewrite(ckpt, name, stored(ckpt, name).to(torch.int8), "I8")
    load_error(ckpt, CheckpointError, name, "I8", path.name)


def test_linear_weight_of_unusable_dtype(ckpt):
    name = "layers.0.attn.wq_a.weight"
    path = rewrite(ckpt, name, stored(ckpt, name).float().to(torch.int32), "I32")
    load_error(ckpt, CheckpointError, name, "I32", path.name)


def test_scale_of_wrong_dtype(ckpt):
    name = "layers.0.attn.wq_a.scale"
    path = rewrite(ckpt, name, stored(ckpt, name).float(), "F32")
    load_error(ckpt, CheckpointError, name, "F32", path.name)


def test_embedding_of_wrong_dtype(ckpt):
    path = rewrite(ckpt, "embed.weight", stored(ckpt, "embed.weight").half(), "F16")
    load_error(ckpt, CheckpointError, "embed.weight", "F16", path.name)


def test_engram_table_of_wrong_dtype(ckpt):
    name = "layers.4.engram.embed.weight"
    path = rewrite(ckpt, name, stored(ckpt, name).view(torch.uint8), "U8")
    load_error(ckpt, CheckpointError, name, "U8", path.name)


def test_fp8_linear_converted_to_bf16_beside_its_scale(ckpt):
    name = "layers.0.attn.wq_a.weight"
    rewrite(ckpt, name, stored(ckpt, name).to(torch.bfloat16), "BF16")
    load_error(ckpt, CheckpointError, "layers.0.attn.wq_a")


# ---- shapes -----------------------------------------------------------------------------

@pytest.mark.parametrize("name,change", [
    ("layers.0.attn_norm.weight", lambda t: t[:-1]),
    ("layers.0.attn.wkv.weight", lambda t: t.t()),                       # fp8 [64,128] → [128,64]
    ("layers.0.attn.wq_a.scale", lambda t: t[:, :-1]),                   # tile scales [2,4] → [2,3]
    ("layers.2.ffn.experts.0.w1.weight", lambda t: t[:, :t.shape[1] // 2]),  # packed fp4
    ("layers.1.engram.embed.weight", lambda t: t[:-1]),                  # one Engram row short
    ("layers.3.attn.indexer.wk.weight", lambda t: t[:, :-32]),
    ("mtp.2.markov_head.embed.weight", lambda t: t[:-1]),
    ("head.weight", lambda t: t[:-1]),
])
def test_wrong_shape(ckpt, name, change):
    t = stored(ckpt, name)
    with SafetensorsFile(shard_of(ckpt, name)) as f:
        dtype = f.info(name).dtype
    new = change(t).contiguous()
    path = rewrite(ckpt, name, new, dtype)
    load_error(ckpt, CheckpointError, name, path.name, str(list(new.shape)), str(list(t.shape)))


# ---- missing tensors --------------------------------------------------------------------

def _drop_from_index(folder: Path, name: str) -> None:
    p = folder / INDEX_NAME
    index = json.loads(p.read_text())
    del index["weight_map"][name]
    p.write_text(json.dumps(index))


@pytest.mark.parametrize("name", ["layers.3.attn.indexer.wk.weight",
                                  "layers.5.attn.indexer.weights_proj.weight",
                                  "layers.1.attn.compressor.wgate.weight",
                                  "mtp.2.confidence_head.proj.weight",
                                  "layers.4.engram.embed.scale",
                                  "layers.7.ffn.experts.7.w2.scale"])
def test_tensor_missing_from_checkpoint(ckpt, name):
    """Dropped from its shard and from the index: the model names the tensor it needs."""
    rewrite(ckpt, name, None)
    _drop_from_index(ckpt, name)
    load_error(ckpt, CheckpointError, name, "missing")


def test_tensor_in_index_but_not_in_its_shard(ckpt):
    name = "layers.3.attn.indexer.wk.weight"
    path = rewrite(ckpt, name, None)
    load_error(ckpt, CheckpointError, name, path.name)


def test_tensor_in_shard_but_not_in_index(ckpt):
    name = "layers.3.attn.indexer.wk.weight"
    _drop_from_index(ckpt, name)
    load_error(ckpt, CheckpointError, name)


# ---- config.json ------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["deepseek_v4", "llama"])
def test_unknown_model_type(ckpt, model_type):
    p = ckpt / "config.json"
    raw = json.loads(p.read_text())
    raw["model_type"] = model_type
    p.write_text(json.dumps(raw))
    load_error(ckpt, ConfigError, "model_type", repr(model_type), str(p))


def test_config_json_missing_or_broken(ckpt):
    p = ckpt / "config.json"
    p.write_text("{ not json")
    load_error(ckpt, ConfigError, str(p), "JSON")
    p.unlink()
    load_error(ckpt, ConfigError, str(ckpt), "config.json")


def test_engram_class_count_mismatch(ckpt):
    n = json.loads((ckpt / "config.json").read_text())["text_config"][
        "engram_compressed_vocab_size"]
    edit_config(ckpt, engram_compressed_vocab_size=n + 1)
    load_error(ckpt, ConfigError, "engram_compressed_vocab_size", str(n), str(n + 1))


def test_engram_row_count_mismatch(ckpt):
    rows = json.loads((ckpt / "config.json").read_text())["text_config"]["engram_num_embeddings"]
    edit_config(ckpt, engram_num_embeddings=[rows[0], rows[1] + 1])
    load_error(ckpt, ConfigError, "engram_num_embeddings", str(rows[1] + 1))


def test_vocab_size_disagrees_with_tokenizer(ckpt):
    edit_config(ckpt, vocab_size=330)
    load_error(ckpt, ConfigError, "vocab_size", "330", "320")


def test_config_invalid_in_itself(ckpt):
    edit_config(ckpt, o_groups=3)
    load_error(ckpt, ConfigError, "o_groups", str(ckpt / "config.json"))


# ---- forward: errors leave the state unchanged ------------------------------------------

def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


def test_capacity_error_on_empty_state(tiny_reference):
    state = tiny_reference.new_state(16)
    before = state.clone()
    with pytest.raises(CapacityError) as ei:
        tiny_reference.forward(random_tokens(17, seed=1), state)
    msg = str(ei.value)
    assert "17" in msg and "16" in msg, msg
    assert state.position == 0
    assert_same(state.tensors(), before.tensors())
    assert state.stale_index_source is None and state.journal is None


def test_capacity_boundary_and_error_after_tokens(tiny_reference):
    """Exactly filling the capacity works; one more token raises naming all three numbers,
    and the state (also under a snapshot) is untouched by the failed call."""
    m = tiny_reference
    tokens = random_tokens(6, seed=2)
    state = m.new_state(4)
    m.forward(tokens[:1], state, logits="none")
    before = state.clone()
    with pytest.raises(CapacityError) as ei:
        m.forward(tokens[1:5], state)                    # 1 + 4 = 5 > 4
    assert all(s in str(ei.value) for s in ("1", "4", "5")), str(ei.value)
    assert state.position == 1
    assert_same(state.tensors(), before.tensors())

    m.forward(tokens[1:4], state, logits="none")         # 1 + 3 = 4: fits exactly
    assert state.position == 4
    before = state.clone()
    state.begin()
    with pytest.raises(CapacityError, match="4 tokens in context \\+ 1 new = 5 .* 4 tokens"):
        m.forward(tokens[4:5], state)
    assert state.position == 4 and state.journal.n_written == 0
    state.rollback()
    assert state.position == 4
    assert_same(state.tensors(), before.tensors())


@pytest.mark.parametrize("bad", [[-1], [320], [3, 4, 320], [5, -7, 6], [10**6]])
def test_token_ids_out_of_range(tiny_reference, bad):
    state = tiny_reference.new_state(16)
    before = state.clone()
    with pytest.raises(ValueError) as ei:
        tiny_reference.forward(torch.tensor(bad), state)
    assert "0..319" in str(ei.value)
    assert state.position == 0
    assert_same(state.tensors(), before.tensors())


def test_bad_tokens_after_some_context(tiny_reference):
    m = tiny_reference
    state = m.new_state(16)
    m.forward(random_tokens(2, seed=3), state, logits="none")
    before = state.clone()
    with pytest.raises(ValueError, match="0..319"):
        m.forward(torch.tensor([7, 320]), state)
    with pytest.raises(ValueError):
        m.forward(torch.tensor([], dtype=torch.long), state)
    assert state.position == 2
    assert_same(state.tensors(), before.tensors())
    assert state.stale_index_source == before.stale_index_source


def test_bad_logits_mode_is_rejected_before_anything_runs(tiny_reference):
    state = tiny_reference.new_state(16)
    try:
        with pytest.raises(ValueError, match="logits"):
            tiny_reference.forward(random_tokens(1, seed=4), state, logits="lats")
    finally:
        assert state.position == 0


class _Injected(RuntimeError):
    pass


def _fail_at(monkeypatch, model: Model, layer: int) -> None:
    """Make block `layer` raise, as an out-of-memory or interrupt would mid-forward."""
    def boom(*args, **kwargs):
        raise _Injected(f"injected failure in layer {layer}")
    monkeypatch.setattr(model.layers[layer], "forward", boom)


def _next_logits(model: Model, state, token: torch.Tensor) -> torch.Tensor:
    logits, _ = model.forward(token, state, logits="last")
    return logits


def test_failure_mid_forward_does_not_advance(tiny_reference, monkeypatch):
    """A forward that raises after some layers wrote their caches leaves the state as it was:
    same position and tokens, same live caches, and the next forward decodes as if the failed
    call never happened."""
    m = tiny_reference
    tokens = random_tokens(8, seed=5)
    state = m.new_state(32)
    m.forward(tokens[:3], state, logits="none")
    clean = state.clone()
    with monkeypatch.context() as mp:
        _fail_at(mp, m, 6)
        with pytest.raises(_Injected):
            m.forward(tokens[3:7], state)
    assert state.position == 3 and state.journal is None
    assert torch.equal(state.tokens[:3], tokens[:3])
    assert state.stale_index_source == clean.stale_index_source
    assert_same(state.live_tensors(), clean.live_tensors())
    assert torch.equal(_next_logits(m, state, tokens[3:4]), _next_logits(m, clean, tokens[3:4]))


def test_failure_mid_forward_under_snapshot_rolls_back(tiny_reference, monkeypatch):
    """With begin()/rollback() around it, even a long failed chunk is undone exactly."""
    m = tiny_reference
    tokens = random_tokens(40, seed=6)
    state = m.new_state(64)
    m.forward(tokens[:1], state, logits="none")
    clean = state.clone()
    state.begin()
    with monkeypatch.context() as mp:
        _fail_at(mp, m, 2)
        with pytest.raises(_Injected):
            m.forward(tokens[1:33], state)               # 32 tokens: longer than comp_tail ring
    assert state.position == 1 and state.journal.n_written == 0
    state.rollback()
    assert_same(state.tensors(), clean.tensors())


@pytest.mark.parametrize("fail_layer,chunk", [(2, 16), (1, 256)], ids=["comp_tail", "window"])
def test_long_chunk_failing_mid_forward_keeps_live_caches(tiny_reference, monkeypatch,
                                                          fail_layer, chunk):
    m = tiny_reference
    tokens = random_tokens(chunk + 2, seed=7)
    state = m.new_state(512)
    m.forward(tokens[:1], state, logits="none")          # odd position: a pair is pending
    clean = state.clone()
    with monkeypatch.context() as mp:
        _fail_at(mp, m, fail_layer)
        with pytest.raises(_Injected):
            m.forward(tokens[1:1 + chunk], state)
    assert state.position == 1
    assert_same(state.live_tensors(), clean.live_tensors())
    assert torch.equal(_next_logits(m, state, tokens[1:2]), _next_logits(m, clean, tokens[1:2]))
