"""Helpers shared by tests (importable as `util`; pytest puts tests/ on sys.path)."""
from __future__ import annotations

import torch


def random_tokens(n: int, seed: int, vocab: int = 320, low: int = 3) -> torch.Tensor:
    """Deterministic random token ids in [low, vocab)."""
    return torch.randint(low, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def continuation_drafts(want: list[int], prompt_len: int, vocab: int, wrong_at: int = 2):
    """A DSpark draft override: plain decoding's own continuation `want` (of a prompt of
    prompt_len tokens) with the draft at index `wrong_at` of each window made wrong, so every
    full window rejects its tail and rolls it back."""
    def override(P, drafts):
        i = P - prompt_len
        out = list(want[i + 1:i + 1 + len(drafts)])
        if len(out) > wrong_at:
            out[wrong_at] = (out[wrong_at] + 1) % vocab
        return out
    return override


def windows_roll_back_alike(model, state, graphed, ref) -> None:
    """Three 6-row verify windows, each rolled back past a different number of rows, through
    `graphed` on `state` and eagerly on `ref` (a clone): every ring row and tag is equal
    after each."""
    for i, keep in enumerate((6, 2, 4)):
        window = random_tokens(6, seed=11 + i)
        for st, forward in ((state, lambda w: graphed.forward(w, "all")),
                            (ref, lambda w: model.forward(w, ref, logits="all"))):
            start = st.position
            st.begin()
            forward(window)
            st.rollback(to=start + keep)
        full, want = state.tensors(), ref.tensors()
        assert all(torch.equal(full[k], want[k]) for k in want), f"window {i}"
