"""Sampling as a pure function of (seed, absolute position, logits).

Gumbel-max (the vendor samples argmax(p / Exp(1)), the same distribution): the noise for token
v at position p comes from a counter-based hash of (seed, p, v), so the token picked at a
position never depends on how many rows were computed together or on any RNG state. Plain and
speculative decoding therefore pick the same tokens at any temperature, and a request is
reproducible from its seed.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from strata.current_device import made_current
from strata.errors import StrataError
from strata.kernels import ranking
from strata.trace import scope

_M32 = 0xFFFFFFFF


def _mul32(a: torch.Tensor, b: int) -> torch.Tensor:
    """(a·b) mod 2³² for 0 ≤ a < 2³², in int64 without overflow (16-bit limbs)."""
    hi, lo = a >> 16, a & 0xFFFF
    return ((((hi * b) & 0xFFFF) << 16) + lo * b) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser: a bijection that mixes every input bit."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def uniform_noise(seed: int | torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """U(0,1) fp64 [R, V], a deterministic function of (seed, position, token id). `seed`: an
    int, or an int64 0-d tensor on the positions' device holding it (the same bits: the same
    integer ops) — a CUDA graph then replays with any seed."""
    if positions.device.type == "cpu":
        return torch.from_numpy(_uniform_noise_numpy(int(seed), positions.numpy(), vocab))
    return _uniform_noise_torch(seed, positions, vocab)


def _uniform_noise_torch(seed: int | torch.Tensor, positions: torch.Tensor,
                         vocab: int) -> torch.Tensor:
    dev = positions.device
    v = torch.arange(vocab, device=dev, dtype=torch.long)[None, :]
    p = positions.long()[:, None]
    h = _fmix32((v * 0x9E3779B1) & _M32)
    h = _fmix32(h ^ (p & _M32))
    h = _fmix32(h ^ ((p >> 32) & _M32) ^ 0x68E31DA4)
    h = _fmix32(h ^ (seed & _M32))
    h = _fmix32(h ^ ((seed >> 32) & _M32) ^ 0x1B56C4E9)
    return (h.double() + 0.5) / 2.0 ** 32


# The CPU path: the same hash in numpy's uint32, whose products wrap mod 2³² by definition.
# (The torch path's 16-bit limbs in int64 take ~17× as long: 15 ms a row at a 129K vocabulary,
# a fifth of a sampled CPU decode step.)

def _fmix32_numpy(h: np.ndarray) -> np.ndarray:
    """_fmix32 on uint32, in place."""
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h


@functools.lru_cache(maxsize=4)
def _token_hash_numpy(vocab: int) -> np.ndarray:
    """The first round, which depends on the token id alone (read-only, shared)."""
    v = np.arange(vocab, dtype=np.uint32)
    v *= np.uint32(0x9E3779B1)
    h = _fmix32_numpy(v)
    h.flags.writeable = False
    return h


def _uniform_noise_numpy(seed: int, positions: np.ndarray, vocab: int) -> np.ndarray:
    p = positions.astype(np.int64).reshape(-1, 1)
    h = _token_hash_numpy(vocab)[None, :] ^ (p & _M32).astype(np.uint32)
    h = _fmix32_numpy(h)
    h ^= ((p >> 32) & _M32).astype(np.uint32) ^ np.uint32(0x68E31DA4)
    h = _fmix32_numpy(h)
    h ^= np.uint32(seed & _M32)
    h = _fmix32_numpy(h)
    h ^= np.uint32((seed >> 32) & _M32) ^ np.uint32(0x1B56C4E9)
    h = _fmix32_numpy(h)
    return (h.astype(np.float64) + 0.5) / 2.0 ** 32


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise StrataError(f"temperature {self.temperature} must be ≥ 0")
        if not (0.0 < self.top_p <= 1.0):
            raise StrataError(f"top_p {self.top_p} must be in (0, 1]")
        if not 0 <= self.seed < 2 ** 63:
            raise StrataError(f"seed {self.seed} must be in 0..2^63-1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample(logits: torch.Tensor, positions: torch.Tensor, params: SamplingParams,
           seed: torch.Tensor | None = None) -> torch.Tensor:
    """Token ids [R] for logits [R, V] fp32 of the rows at absolute `positions` [R].

    Greedy: argmax (ties to the lowest id). Otherwise softmax(logits / T) restricted to the
    top-p nucleus (smallest prefix by descending probability, ties by id, whose mass reaches
    top_p), sampled by Gumbel-max with the position-keyed noise. `seed`: params.seed held in
    an int64 0-d device tensor instead (uniform_noise), for a graph that replays any seed.
    """
    with scope("sampling"), made_current(logits.device):
        return _sample(logits, positions, params, params.seed if seed is None else seed)


def _sample(logits: torch.Tensor, positions: torch.Tensor, params: SamplingParams,
            seed: int | torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    if params.greedy:
        if ranking.available(logits) and logits.dim() == 2:  # (two launches, torch's ids)
            return ranking.argmax_rows(logits)
        return logits.argmax(dim=-1)
    z = logits.double() / params.temperature
    if params.top_p < 1.0:
        probs = torch.softmax(z, dim=-1)
        order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = torch.cumsum(order.values, dim=-1) - order.values  # mass strictly before
        keep_sorted = before < params.top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order.indices, keep_sorted)
        z = torch.where(keep, z, torch.full_like(z, float("-inf")))
    u = uniform_noise(seed, positions.to(logits.device), logits.shape[-1])
    gumbel = -torch.log(-torch.log(u))
    return (z + gumbel).argmax(dim=-1)


TOP_LOGPROBS_MAX = 20  # alternatives a token may report (OpenAI's limit)


@dataclass
class Logprobs:
    """What a generation reports of its tokens' probabilities, filled as it yields them:
    items[i] = (the i-th token's logprob, its `top` likeliest alternatives as (id, logprob),
    most likely first). Under the model's own distribution — the log-softmax of the raw
    logits, before temperature and top-p shape the sampling — so a token's figures are the
    same whatever the request samples with."""
    top: int = 0
    items: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0 <= self.top <= TOP_LOGPROBS_MAX:
            raise StrataError(f"top logprobs {self.top} must be in 0..{TOP_LOGPROBS_MAX}")

    def add(self, logits: torch.Tensor, tokens: list[int]) -> None:
        """Append the figures of tokens[r], picked from logits row r ([R, V] or [V])."""
        lp = torch.log_softmax(logits.view(len(tokens), -1).float(), dim=-1)
        ids = torch.tensor(tokens, device=lp.device).view(-1, 1)
        chosen = lp.gather(1, ids).view(-1).tolist()
        if not self.top:
            self.items.extend((c, []) for c in chosen)
            return
        top = lp.topk(self.top, dim=-1)
        for c, vs, ix in zip(chosen, top.values.tolist(), top.indices.tolist()):
            self.items.append((c, list(zip(ix, vs))))
