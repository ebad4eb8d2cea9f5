"""Engram n-gram hashing (architecture.md §2.7, dspark_engram.md §2.1).

Engram looks up table rows addressed purely by the token ids before a position, so the row
ids can be computed on the host as soon as tokens are known (and the row reads started before
the forward). This module turns token ids into those row ids:

1. ``token_map`` compresses the tokenizer vocabulary (129,280 ids in V4.1) into classes of
   "the same text up to case, accents and whitespace" (99,092 in V4.1).
2. For every position and every n-gram order n = 2..max_ngram the compressed ids of the last n
   tokens are mixed with per-layer odd multipliers and XOR, then reduced modulo one prime per
   head; each (order, head) owns a disjoint slice of the layer's table, found by adding an
   offset.

Every constant here (the class numbering, primes, multipliers) must match what the checkpoint
was trained with bit for bit: a wrong constant does not fail loudly, it silently reads valid
looking but wrong rows. Hence the exact-value tests in ``tests/test_ngram_hash.py``.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sympy
import torch
from tokenizers import Regex, Tokenizer, normalizers

from strata.cache import cache_dir as strata_cache_dir, write_cache_file
from strata.errors import ConfigError

# Bumped whenever the class rule in build_token_map changes, so stale caches are not reused.
_TOKEN_MAP_RULE_VERSION = 1

# Private-use code point that shields a lone space from Strip() (the vendor rule keeps " " as
# its own class instead of collapsing it into the empty string).
_SPACE_SENTINEL = "\ue000"


def _engram_normalizer() -> normalizers.Normalizer:
    """The vendor's text normaliser for token classes (architecture.md §2.7 item 1)."""
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex("[ \t\r\n]+"), " "),
            normalizers.Replace(Regex("^ $"), _SPACE_SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SPACE_SENTINEL, " "),
        ]
    )


def build_token_map(tokenizer: Tokenizer) -> tuple[np.ndarray, int]:
    """Map every token id to its Engram class; return (int64 map [vocab], class count).

    Each id is decoded alone (special tokens kept) and normalised; ids with equal keys share a
    class, numbered in first-seen id order. Ids whose decode contains U+FFFD (lone bytes of a
    multi-byte character) are keyed by their raw token string instead, so distinct byte tokens
    stay distinct. An empty normalisation falls back to the decoded text itself.
    """
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab <= 0:
        raise ConfigError("tokenizer has an empty vocabulary; cannot build the Engram token map")
    # The map is indexed by id, so ids must be exactly 0..vocab-1 with no holes.
    ids_present = np.zeros(vocab, dtype=bool)
    for token_id in tokenizer.get_vocab(with_added_tokens=True).values():
        if not 0 <= token_id < vocab:
            raise ConfigError(f"tokenizer id {token_id} lies outside 0..{vocab - 1}")
        ids_present[token_id] = True
    if not ids_present.all():
        missing = np.flatnonzero(~ids_present)[:5].tolist()
        raise ConfigError(f"tokenizer ids are not dense: no token for ids {missing} (first 5)")

    normalizer = _engram_normalizer()
    texts = tokenizer.decode_batch([[i] for i in range(vocab)], skip_special_tokens=False)
    classes: dict[str, int] = {}
    token_map = np.empty(vocab, dtype=np.int64)
    for token_id, text in enumerate(texts):
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
            if key is None:
                raise ConfigError(f"tokenizer id {token_id} has no token string")
        else:
            key = normalizer.normalize_str(text) or text
        token_map[token_id] = classes.setdefault(key, len(classes))
    return token_map, len(classes)


def token_map_cached(
    tokenizer_json_path: Path, cache_dir: Path | None = None
) -> tuple[np.ndarray, int]:
    """build_token_map for a tokenizer.json file, cached as .npy keyed by the file's sha256.

    Keying on the file content (not its path) means an edited or swapped tokenizer can never
    reuse a stale map. ``cache_dir=None`` uses strata.cache.cache_dir() (``$STRATA_CACHE``,
    else ``$XDG_CACHE_HOME/strata`` or ``~/.cache/strata``). An unwritable cache directory is
    not an error: the map is just rebuilt next time.
    """
    tokenizer_json_path = Path(tokenizer_json_path)
    digest = hashlib.sha256(tokenizer_json_path.read_bytes()).hexdigest()
    if cache_dir is None:
        cache_dir = strata_cache_dir()
    cache_file = Path(cache_dir) / f"engram_token_map-v{_TOKEN_MAP_RULE_VERSION}-{digest}.npy"

    if cache_file.is_file():
        try:
            token_map = np.load(cache_file, allow_pickle=False)
        except (OSError, ValueError):
            token_map = None  # corrupt or truncated cache file: rebuild below
        if token_map is not None and token_map.ndim == 1 and token_map.dtype == np.int64:
            if token_map.size > 0 and token_map.min() >= 0:
                return token_map, int(token_map.max()) + 1

    token_map, num_classes = build_token_map(Tokenizer.from_file(str(tokenizer_json_path)))
    buf = io.BytesIO()
    np.save(buf, token_map, allow_pickle=False)
    write_cache_file(cache_file, buf.getvalue())  # (caching is an optimisation only)
    return token_map, num_classes


def engram_primes(
    layer_ids: Sequence[int], vocab_start: int, max_ngram: int, n_heads: int
) -> dict[int, list[list[int]]]:
    """Per layer, per n-gram order (index n-2), ``n_heads`` distinct primes (table moduli).

    Vendor rule: layers in the given order, orders 2..max_ngram; each (layer, order) starts its
    search at ``vocab_start - 1`` and every head takes the next prime above the previous
    candidate that no earlier (layer, order, head) has used. One global "seen" set makes all
    primes distinct, so the first layer gets the smallest ones and the next layer continues.
    """
    if max_ngram < 2 or n_heads < 1:
        raise ConfigError(
            f"Engram needs max_ngram >= 2 and n_heads >= 1, got {max_ngram}, {n_heads}"
        )
    seen: set[int] = set()
    primes: dict[int, list[list[int]]] = {}
    for layer_id in layer_ids:
        if layer_id in primes:
            raise ConfigError(f"Engram layer {layer_id} listed twice")
        per_order: list[list[int]] = []
        for _order in range(2, max_ngram + 1):
            candidate = vocab_start - 1
            heads: list[int] = []
            for _head in range(n_heads):
                candidate = int(sympy.nextprime(candidate))
                while candidate in seen:
                    candidate = int(sympy.nextprime(candidate))
                seen.add(candidate)
                heads.append(candidate)
            per_order.append(heads)
        primes[layer_id] = per_order
    return primes


def engram_multipliers(layer_id: int, compressed_vocab: int, max_ngram: int) -> np.ndarray:
    """The layer's ``max_ngram`` odd int64 hash multipliers, one per shift.

    The upper bound (int64_max // compressed_vocab // 2, then 2r+1) guarantees
    ``class_id * multiplier`` never overflows int64 for any class id < compressed_vocab.
    """
    if compressed_vocab < 1:
        raise ConfigError(f"compressed_vocab must be positive, got {compressed_vocab}")
    rng = np.random.default_rng(10007 * layer_id)
    bound = (2**63 - 1) // compressed_vocab // 2
    return rng.integers(0, bound, size=max_ngram, dtype=np.int64) * 2 + 1


@dataclass(frozen=True)
class NgramHashConfig:
    """Engram hashing constants from the model config.

    V4.1: layer_ids (1, 14), max_ngram 4, n_heads 8, vocab_start 16,000,000 (the first prime
    search candidate + 1, ``engram_vocab_size``), pad_token_id 2, compressed_vocab 99,092.
    """

    layer_ids: tuple[int, ...]
    max_ngram: int
    n_heads: int
    vocab_start: int
    pad_token_id: int
    compressed_vocab: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", tuple(int(i) for i in self.layer_ids))
        if not self.layer_ids:
            raise ConfigError("Engram config has no layer_ids")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise ConfigError(f"Engram layer_ids repeat: {self.layer_ids}")
        if self.max_ngram < 2:
            raise ConfigError(f"Engram max_ngram must be >= 2, got {self.max_ngram}")
        if self.n_heads < 1:
            raise ConfigError(f"Engram n_heads must be >= 1, got {self.n_heads}")
        if self.vocab_start < 2:
            raise ConfigError(f"Engram vocab_start must be >= 2, got {self.vocab_start}")
        if self.compressed_vocab < 1:
            raise ConfigError(f"Engram compressed_vocab must be >= 1, got {self.compressed_vocab}")


class NgramHasher:
    """Token ids → Engram table row ids, per Engram layer.

    Hashing depends only on the current chunk and the ``max_ngram - 1`` raw tokens before it,
    so a prefill chunk, a verify window and a single decode token all give identical ids for
    the same positions as long as the caller passes the right history.
    """

    def __init__(self, config: NgramHashConfig, token_map: np.ndarray | torch.Tensor) -> None:
        token_map_t = torch.as_tensor(token_map).detach().to("cpu", torch.int64).contiguous()
        if token_map_t.ndim != 1 or token_map_t.numel() == 0:
            raise ConfigError(
                "Engram token map must be a non-empty 1-D array, "
                f"got shape {tuple(token_map_t.shape)}"
            )
        if int(token_map_t.min()) < 0:
            raise ConfigError("Engram token map has negative class ids")
        num_classes = int(token_map_t.max()) + 1
        if num_classes != config.compressed_vocab:
            raise ConfigError(
                f"Engram token map has {num_classes} classes but the config says "
                f"compressed_vocab={config.compressed_vocab} (wrong tokenizer?)"
            )
        if int(torch.bincount(token_map_t, minlength=num_classes).eq(0).sum()) != 0:
            raise ConfigError("Engram token map skips class ids (classes must be dense 0..C-1)")
        if not 0 <= config.pad_token_id < token_map_t.numel():
            raise ConfigError(
                f"Engram pad_token_id {config.pad_token_id} outside the token map "
                f"(size {token_map_t.numel()})"
            )

        self.config = config
        self.token_map = token_map_t
        self.pad_class = int(token_map_t[config.pad_token_id])
        all_primes = engram_primes(
            config.layer_ids, config.vocab_start, config.max_ngram, config.n_heads
        )
        self.primes: dict[int, torch.Tensor] = {}
        self.offsets: dict[int, torch.Tensor] = {}
        self.multipliers: dict[int, torch.Tensor] = {}
        for layer_id in config.layer_ids:
            primes = torch.tensor(all_primes[layer_id], dtype=torch.int64)  # [max_ngram-1, n_heads]
            flat = primes.reshape(-1)  # column order: order-major, then head
            offsets = torch.cumsum(flat, 0) - flat  # exclusive prefix sum, layer-local
            self.primes[layer_id] = primes
            self.offsets[layer_id] = offsets.reshape(primes.shape)
            mult = engram_multipliers(layer_id, config.compressed_vocab, config.max_ngram)
            self.multipliers[layer_id] = torch.from_numpy(mult)
        # numpy views of the constants (shared memory): ids() hashes with numpy on the host,
        # where a step's few tokens cost a few µs (torch's CPU ops cost ~100 µs a step).
        self._np = (token_map_t.numpy(), {
            layer: (self.multipliers[layer].numpy(), self.primes[layer].numpy(),
                    self.offsets[layer].numpy()) for layer in config.layer_ids})
        self._device_tables: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def device_ids(self, history: torch.Tensor, tokens: torch.Tensor) -> dict[int, torch.Tensor]:
        """ids() on tokens' device (CUDA: strata.kernels.engram.ngram_ids, one launch): tokens
        [T] int64 there, history [max_ngram − 1] int64 there — the ids right before
        tokens[0], −1 where the sequence had not started (or the id is dead). Views of one
        [layers, T, width] tensor."""
        from strata.kernels.engram import ngram_ids
        tables = self._device_tables.get(tokens.device)
        if tables is None:  # (uploaded once per device, outside any graph capture's first use)
            layers = self.config.layer_ids
            tables = tuple(t.to(tokens.device) for t in (
                self.token_map, torch.stack([self.multipliers[i] for i in layers]),
                torch.stack([self.primes[i] for i in layers]),
                torch.stack([self.offsets[i] for i in layers])))
            self._device_tables[tokens.device] = tables
        ids = ngram_ids(history, tokens, *tables, self.pad_class)
        return dict(zip(self.config.layer_ids, ids.unbind(0)))

    @property
    def width(self) -> int:
        """Row ids per token per layer: (max_ngram - 1) * n_heads (24 in V4.1)."""
        return (self.config.max_ngram - 1) * self.config.n_heads

    def rows(self, layer: int) -> int:
        """Row count of ``layer``'s table: the sum of its primes (engram_num_embeddings)."""
        return int(self.primes[layer].sum())

    def ids(
        self,
        tokens: torch.Tensor,
        history: torch.Tensor | None = None,
        dead: torch.Tensor | None = None,
        history_dead: torch.Tensor | None = None,
    ) -> dict[int, torch.Tensor]:
        """Row ids for each position of ``tokens``: {layer: int64 [T, width]}, on the host
        (computed there whatever the inputs' device).

        tokens: raw token ids [T]. history: the raw ids right before tokens[0], oldest first;
        only the last max_ngram-1 matter, and fewer than that means the sequence starts at the
        first history entry (or at tokens[0] if history is empty/None). dead / history_dead:
        bool masks of image positions; a negative token id (the spec's DEAD = -1) is dead too.
        An n-gram never reaches across a dead position or the sequence start: from the first
        shift that hits one, that shift and all older ones use the pad class.
        """
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        span = self.config.max_ngram - 1
        if history is None:
            history = torch.empty(0, dtype=torch.int64)
        if history.ndim != 1:
            raise ValueError(f"history must be 1-D, got shape {tuple(history.shape)}")
        if dead is not None and dead.shape != tokens.shape:
            raise ValueError(
                f"dead mask shape {tuple(dead.shape)} != tokens shape {tuple(tokens.shape)}"
            )
        if history_dead is not None and history_dead.shape != history.shape:
            raise ValueError(
                f"history_dead shape {tuple(history_dead.shape)} "
                f"!= history shape {tuple(history.shape)}"
            )
        if history.numel() > span:
            history = history[-span:]
            history_dead = None if history_dead is None else history_dead[-span:]

        def host(t: torch.Tensor, dtype) -> np.ndarray:
            return t.detach().cpu().numpy().astype(dtype, copy=False)

        token_map, per_layer = self._np
        n_hist, n_tok = history.numel(), tokens.numel()
        seq = np.concatenate([host(history, np.int64), host(tokens, np.int64)])
        seq_dead = seq < 0
        if history_dead is not None:
            seq_dead[:n_hist] |= host(history_dead, bool)
        if dead is not None:
            seq_dead[n_hist:] |= host(dead, bool)
        seq_class = token_map[np.maximum(seq, 0)]

        # Class id per (position, shift), with cumulative blocking along the shift axis.
        pos = np.arange(n_hist, n_hist + n_tok)
        blocked = np.zeros(n_tok, dtype=bool)
        classes = np.empty((n_tok, self.config.max_ngram), dtype=np.int64)
        for shift in range(self.config.max_ngram):  # loop over shifts (4), not tokens
            src = pos - shift
            src_c = np.maximum(src, 0)
            blocked = blocked | (src < 0) | seq_dead[src_c]
            classes[:, shift] = np.where(blocked, self.pad_class, seq_class[src_c])

        out: dict[int, torch.Tensor] = {}
        for layer, (mult, primes, offsets) in per_layer.items():
            products = classes * mult  # [T, max_ngram]; cannot overflow by the multiplier bound
            # XOR of orders 0..n for n = 1 .. max_ngram-1: [T, max_ngram-1], non-negative
            mixed = np.bitwise_xor.accumulate(products, axis=1)[:, 1:]
            layer_ids = mixed[:, :, None] % primes[None] + offsets[None]
            out[layer] = torch.from_numpy(layer_ids.reshape(n_tok, self.width))
        return out
