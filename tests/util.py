"""Helpers shared by tests (importable as `util`; pytest puts tests/ on sys.path)."""
from __future__ import annotations

import torch


def random_tokens(n: int, seed: int, vocab: int = 320, low: int = 3) -> torch.Tensor:
    """Deterministic random token ids in [low, vocab)."""
    return torch.randint(low, vocab, (n,), generator=torch.Generator().manual_seed(seed))
