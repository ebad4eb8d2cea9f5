"""Helpers shared by tests (importable as `util`; pytest puts tests/ on sys.path)."""
from __future__ import annotations

import torch


def random_tokens(n: int, seed: int, vocab: int = 320, low: int = 3) -> torch.Tensor:
    """Deterministic random token ids in [low, vocab)."""
    return torch.randint(low, vocab, (n,), generator=torch.Generator().manual_seed(seed))


_plain_runs: dict = {}


def plain_tokens_once(model, prompt: torch.Tensor, n: int, params) -> list[int]:
    """A plain generation's tokens (no stop ids), run once per model, prompt, length and
    sampling in this process: the reference many parametrised tests compare against. Keyed by
    the model itself, so a cached run never outlives (or is mistaken for) its model."""
    from strata.runtime.session import Session
    key = (model, tuple(prompt.tolist()), n, params)
    if key not in _plain_runs:
        s = Session(model, max(512, prompt.numel() + n + 8))
        _plain_runs[key] = s.run(prompt, n, params, stop_ids=frozenset()).tokens
    return list(_plain_runs[key])


def continuation_drafts(want: list[int], prompt_len: int, vocab: int, wrong_at: int = 2):
    """A DSpark draft override: plain decoding's own continuation `want` (of a prompt of
    prompt_len tokens) with the draft at index `wrong_at` of each window made wrong, so every
    full window rejects its tail and rolls it back."""
    def override(P, L):
        i = P - prompt_len
        out = list(want[i + 1:i + 1 + L])
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


def stops_alike(ref, ahead, prompt, more, params, n: int, stop: int) -> None:
    """`ahead` (a session whose plain loop runs a step ahead: Session._plain_ahead) and `ref`
    (the eager loop) generate from `prompt` until the token `stop`: the same tokens, position
    and live state — the step launched on the stop token abandoned — then the same next turn
    on `more`."""
    cut = [list(x.generate(prompt, n, params, stop_ids=frozenset({stop}), mode="plain"))
           for x in (ref, ahead)]
    assert cut[0] == cut[1] and cut[0][-1] == stop
    assert ahead.state.position == ref.state.position == len(prompt) + len(cut[0]) - 1
    live, want = ahead.state.live_tensors(), ref.state.live_tensors()
    assert all(torch.equal(live[k], want[k]) for k in want)
    assert ref.run(more, 10, params, mode="plain").tokens == \
        ahead.run(more, 10, params, mode="plain").tokens


def qdq_hard_values(block: int) -> torch.Tensor:
    """Rows of `block` values that stress every step: a wide range of magnitudes, signed
    zeros, all-zero blocks (the floor), amaxes on the scale's power-of-two boundaries and
    just past them, ties of the e2m1 and e4m3 grids, and tiny blocks (subnormal scales)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, block, generator=g) * torch.logspace(-9, 5, 24)[:, None]
    x[0] = 0.0
    x[0, ::2] = -0.0
    x[1, :8] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])  # e2m1 ties at scale 1
    x[1, 8:] = -torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0]).repeat(block // 8 - 1)
    x[2, :12] = torch.tensor([448.0, 1.0625, 1.1875, 17.0, 19.0, 0.0146484375, 0.0029296875,
                              0.0009765625, -2.5 * 2.0 ** -9, -3.5 * 2.0 ** -9, 240.0, -416.0])
    x[2, 12:] = 0.5
    for r, top in ((3, 448.0 * 2.0 ** -3), (4, 6.0 * 2.0 ** 5), (5, 6.0 * 2.0 ** -20)):
        x[r, 0] = top
        x[r + 3, 0] = torch.nextafter(torch.tensor(top), torch.tensor(1e9))
    x[9] = 3e-40  # below every floor (subnormal inputs)
    x[10] = 1e-38 * torch.arange(block)
    return x


def route_reference(logits, bias, temp, k, scale):
    """MoE.route's torch definition from the gate's logits: (ids, weights)."""
    from strata.model.numerics import ranked_topk
    s = torch.sqrt(torch.nn.functional.softplus(logits / temp))
    idx = ranked_topk(s + bias, k)
    w = s.gather(1, idx)
    return idx, w / (w.sum(-1, keepdim=True) + 1e-20) * scale


def compressor_pool(ring, k, g, positions, entries, r):
    """Compressor.forward's torch steps for a ratio-r kv source (the definition the one-launch
    pooling of strata.kernels.compressor reproduces): each entry's softmax-weighted sum of its
    r (k, gate) rows, from the tail ring before the forward, the forward's rows after."""
    T = k.shape[0]
    first = positions[:1]
    kg_all = torch.cat((ring.gather(first + torch.arange(1 - r, 0, device=k.device)),
                        torch.stack((k, g), dim=1)), dim=0)
    rows = entries[:, None] * r + torch.arange(r, device=k.device)[None] - first + (r - 1)
    groups = kg_all[rows.clamp(max=T + r - 2)]
    weights = torch.softmax(groups[:, :, 1], dim=1)
    return (weights * groups[:, :, 0]).sum(dim=1)


def forward_100_then_rest(model, tokens):
    """Logits of every row and the state's tensors after a forward of tokens[:100] and then
    one of the rest (attention's pieces tests: two forwards, a ring and caches between)."""
    state = model.new_state(256)
    logits, _ = model.forward(tokens[:100], state, logits="all")
    more, _ = model.forward(tokens[100:], state, logits="all")
    return torch.cat((logits, more)), state.tensors()


def same_runs(runs) -> None:
    """Every (logits, state tensors) of `runs` equal to the first's, bit for bit."""
    (a, sa), *rest = runs
    for b, sb in rest:
        assert torch.equal(a, b) and sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
