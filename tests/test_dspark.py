"""DSpark speculative decoding == plain decoding, token for token and cache for cache."""
from __future__ import annotations

import pytest
import torch

from strata.errors import StrataError
from strata.runtime.sampling import SamplingParams, sample
from strata.runtime.session import Session
from strata.runtime.speculative import SpecConfig, choose_length, measure_costs
from util import plain_tokens_once, random_tokens

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, seed=5)


def plain_tokens(model, prompt, n, params, capacity=512):
    return Session(model, capacity).run(prompt, n, params, stop_ids=frozenset()).tokens


def oracle(reference, prompt_len, corrupt_at=None):
    """Drafts = the true continuation (full acceptance), optionally wrong from one index."""
    def override(P, L):
        i = P - prompt_len  # reference[i] sits at position P (the anchor)
        out = list(reference[i + 1:i + 1 + L])
        if corrupt_at is not None and corrupt_at < len(out):
            out[corrupt_at] = (out[corrupt_at] + 1) % 300 + 3
        return out
    return override


@pytest.mark.parametrize("prompt_len,n", [(10, 40), (120, 24), (250, 20)])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_dspark_equals_plain(tiny_model, prompt_len, n, params):
    """Across the window wrap (128), the ring wrap (256) and ratio-2 pair boundaries."""
    prompt = random_tokens(prompt_len, seed=prompt_len)
    want = plain_tokens(tiny_model, prompt, n, params)
    s = Session(tiny_model, 512, speculative=SpecConfig())
    assert s.run(prompt, n, params, stop_ids=frozenset()).tokens == want
    assert s.stats.windows > 0


@pytest.mark.parametrize("seed", range(6))
def test_many_seeds_sampled(tiny_reference, seed):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
    prompt = random_tokens(30 + seed, seed=100 + seed)
    want = plain_tokens(tiny_reference, prompt, 25, params)
    s = Session(tiny_reference, 256, speculative=SpecConfig(length=5))
    assert s.run(prompt, 25, params, stop_ids=frozenset()).tokens == want


@pytest.mark.parametrize("kind", ["accept_all", "reject_first", "reject_third", "reject_all"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_forced_drafts(tiny_model, kind, params):
    prompt_len, n = 124, 30  # the windows straddle positions 125-129
    prompt = random_tokens(prompt_len, seed=7)
    want = plain_tokens_once(tiny_model, prompt, n, params)
    ref = [int(sample(tiny_model.forward(prompt, tiny_model.new_state(512), logits="last")[0],
                      torch.tensor([prompt_len]), params)[0])] + want[1:]
    assert ref == want
    corrupt = {"accept_all": None, "reject_first": 0, "reject_third": 2, "reject_all": -1}[kind]
    if corrupt == -1:
        def override(P, L):
            return [(t + 1) % 300 + 3 for t in oracle(want, prompt_len)(P, L)]
    else:
        override = oracle(want, prompt_len, corrupt)
    s = Session(tiny_model, 512, speculative=SpecConfig(length=5, low_windows=10**6),
                draft_override=override)
    assert s.run(prompt, n, params, stop_ids=frozenset()).tokens == want
    per_window = s.stats.committed
    if kind == "accept_all":
        assert all(c == 6 for c in per_window[:-1])
    elif kind == "reject_all" or kind == "reject_first":
        assert all(c == 1 for c in per_window)
    else:
        assert all(c == 3 for c in per_window[:-1])


def test_caches_equal_plain_after_every_step(tiny_model):
    """After each speculative step, every readable cache — window rings, compressor tails,
    compressed KV, index keys, the DSpark stage windows — equals plain decoding's, bit for bit."""
    prompt_len = 60
    prompt = random_tokens(prompt_len, seed=12)
    want = plain_tokens(tiny_model, prompt, 40, GREEDY)
    s = Session(tiny_model, 256, speculative=SpecConfig(length=5, low_windows=10**6),
                draft_override=oracle(want, prompt_len, corrupt_at=3))
    plain = Session(tiny_model, 256, speculative=SpecConfig())
    plain.prefill(prompt)
    gen = s.generate(prompt, 40, GREEDY, stop_ids=frozenset())
    produced = [next(gen)]
    checked = 0
    while True:
        try:
            produced.append(next(gen))
        except StopIteration:
            break
        # bring the plain state to the speculative state's position (it runs ahead of the
        # yielded tokens by the rest of its window; `want` is the common continuation)
        consumed = s.state.position - prompt_len
        while plain.state.position - prompt_len < consumed:
            i = plain.state.position - prompt_len
            logits, ctx = tiny_model.forward(torch.tensor([want[i]]), plain.state)
            tiny_model.dspark.commit_context(tiny_model.dspark.main_hidden(ctx), prompt_len + i,
                                             plain.state, tiny_model.numerics)
        if plain.state.position == s.state.position:
            a, b = s.state.live_tensors(), plain.state.live_tensors()
            assert a.keys() == b.keys()
            for name in a:
                assert torch.equal(a[name], b[name]), (name, s.state.position)
            checked += 1
    assert produced == want and checked >= 5


def test_low_acceptance_falls_back_to_plain(tiny_reference):
    prompt = random_tokens(20, seed=13)
    want = plain_tokens(tiny_reference, prompt, 40, GREEDY)

    def reject(P, L):
        return [(t + 1) % 300 + 3 for t in oracle(want, 20)(P, L)]
    cfg = SpecConfig(length=5, low_acceptance=0.5, low_windows=3, plain_backoff=4)
    s = Session(tiny_reference, 128, speculative=cfg, draft_override=reject)
    assert s.run(prompt, 40, GREEDY, stop_ids=frozenset()).tokens == want
    assert s.stats.plain_steps >= 4 and s.stats.windows >= 3


def test_plain_runs_grow_while_the_drafts_keep_failing(tiny_reference):
    """Each plain run that low acceptance begins is twice the last (up to max_plain_backoff)
    while the probes after it still fail; once drafts pay again, the next slump starts
    from plain_backoff — the tokens plain decoding's throughout."""
    prompt = random_tokens(20, seed=13)
    want = plain_tokens(tiny_reference, prompt, 80, GREEDY)
    good = oracle(want, 20)

    def slumps(P, L):  # wrong drafts but for positions 36 … 51 of the output
        right = good(P, L)
        return right if 36 <= P - 20 < 52 else [(t + 1) % 300 + 3 for t in right]
    cfg = SpecConfig(length=5, low_acceptance=0.5, low_windows=2, plain_backoff=2,
                     max_plain_backoff=8)
    s = Session(tiny_reference, 256, speculative=cfg, draft_override=slumps)
    assert s.run(prompt, 80, GREEDY, stop_ids=frozenset()).tokens == want
    b = s.stats.backoffs
    restart = b.index(2, 1)  # (the first run after the drafts paid)
    assert restart > 3 and b[:restart] == [2, 4] + [8] * (restart - 2)
    assert b[restart:restart + 3] == [2, 4, 8]
    assert s.stats.accepted >= 10  # (two windows of five in the good stretch)
    with pytest.raises(StrataError, match="max_plain_backoff"):
        SpecConfig(plain_backoff=16, max_plain_backoff=8)


def test_after_a_plain_run_a_short_probe_judges_the_drafts(tiny_reference):
    """The first slump is judged over low_windows windows, each later one over the
    probe_windows windows after the plain run — a failed window costs several plain steps —
    and a probe that pays keeps drafting until low_windows windows judge again."""
    prompt = random_tokens(20, seed=13)
    want = plain_tokens(tiny_reference, prompt, 80, GREEDY)
    good = oracle(want, 20)

    def wrong(P, L):
        return [(t + 1) % 300 + 3 for t in good(P, L)]
    cfg = SpecConfig(length=3, low_acceptance=0.5, low_windows=4, probe_windows=1,
                     plain_backoff=2, max_plain_backoff=8)
    s = Session(tiny_reference, 256, speculative=cfg, draft_override=wrong)
    assert s.run(prompt, 80, GREEDY, stop_ids=frozenset()).tokens == want
    st = s.stats
    assert st.backoffs[:4] == [2, 4, 8, 8] and st.accepted == 0
    # 4 windows before the first run, then 1 after each (the last one's maybe not yet run)
    assert st.windows - (4 + len(st.backoffs) - 1) in (0, 1)
    assert st.plain_steps + st.windows == 79

    def right_after(P, L):  # wrong for the first 10 positions, then right
        return good(P, L) if P - 20 >= 10 else wrong(P, L)
    s = Session(tiny_reference, 256, speculative=cfg, draft_override=right_after)
    assert s.run(prompt, 80, GREEDY, stop_ids=frozenset()).tokens == want
    # windows at 0 … 3 fail, 2 plain steps, the probe at 6 fails, 4 plain, the probe at 11
    # pays: drafting from then on
    assert s.stats.backoffs == [2, 4] and s.stats.accepted > 40
    with pytest.raises(StrataError, match="probe_windows 0"):
        SpecConfig(probe_windows=0)


def test_choose_length():
    costs = [1.0, 1.05, 1.1, 1.15, 1.2, 1.25]  # seconds for 1..6 rows
    assert choose_length(torch.tensor([0.9] * 5), costs, 0.1) == 5
    assert choose_length(torch.tensor([0.05] * 5), costs, 0.1) == 0
    # confident first drafts, hopeless later ones: stop where the expected gain stops paying
    assert choose_length(torch.tensor([0.95, 0.9, 0.01, 0.01, 0.01]), costs, 0.1) == 2
    # expensive windows: shorter
    assert choose_length(torch.tensor([0.8] * 5), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 0.0) == 0


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphed"])
def test_window_prices_measured_and_followed(tiny_reference, graphs):
    """measure_costs prices a window of every row count and a draft, the way the session
    will run them (graphed: on the CPU the graphed session runs eagerly, the same path the
    measurement must survive); a session given prices picks its verify length by them —
    windows dearer than what they can commit: plain steps only; one draft as cheap as a
    step, more dear: windows of one draft; all as cheap as a step: longer windows — the
    tokens plain decoding's every time."""
    m = tiny_reference
    block = m.cfg.dspark_block_size
    costs, draft = measure_costs(m, block + 1, repeats=1, context=16, graphs=graphs)
    assert len(costs) == block + 1 and all(c > 0 for c in costs) and draft > 0
    prompt = random_tokens(20, seed=3)
    want = plain_tokens(m, prompt, 12, GREEDY, capacity=64)
    spec = SpecConfig(low_windows=10 ** 6)  # (no fallback to plain steps: few accepted)

    def stats(prices):
        s = Session(m, 64, speculative=spec, costs=(prices, 0.0), graphs=graphs)
        assert s.run(prompt, 12, GREEDY, stop_ids=frozenset()).tokens == want
        return s.stats

    dear = stats([1.0] + [1e3] * block)
    assert dear.windows == 0 and dear.plain_steps == 11 and dear.drafts == 10
    # drafts not worth verifying count as rejected: after low_windows of them, plain steps
    # without drafts for plain_backoff steps, then a probe of probe_windows drafts
    s = Session(m, 64, speculative=SpecConfig(low_windows=3, plain_backoff=4),
                costs=([1.0] + [1e3] * block, 0.0), graphs=graphs)
    assert s.run(prompt, 12, GREEDY, stop_ids=frozenset()).tokens == want
    assert s.stats.plain_steps == 11 and s.stats.drafts == 3 + 2 and s.stats.backoffs == [4, 8]
    one = stats([1.0, 1.0] + [1e3] * (block - 1))
    assert one.windows > 0 and one.drafted == one.windows
    cheap = stats([1.0] * (block + 1))
    assert cheap.windows > 0 and cheap.drafted > 2 * cheap.windows


def test_the_cli_prices_its_windows(tiny_reference, tiny_dir, capsys):
    """--speculative's setup (speculative_config): window prices measured now and printed
    for the adaptive length, none for --draft-length; the server's sessions follow the prices
    it gives its engine; `generate --speculative` decodes plain decoding's tokens and reports
    its windows; --draft-length alone is refused, and so is a model without a draft head."""
    import json
    import threading

    from strata.cli import main
    from strata.model.model import Model
    from strata.runtime.engine import Engine, Finished, GenRequest, Token
    from strata.runtime.speculative import speculative_config
    m = tiny_reference
    block = m.cfg.dspark_block_size
    spec, (costs, draft) = speculative_config(m, None, graphs=False)
    assert spec.length is None and len(costs) == block + 1 and draft > 0
    assert "DSpark verify windows priced" in capsys.readouterr().err
    assert speculative_config(m, 3, graphs=False) == (SpecConfig(length=3), None)
    prompt = random_tokens(20, seed=4)
    want = plain_tokens(m, prompt, 8, GREEDY, capacity=64)

    def served(prices):
        engine = Engine(m, 64, speculative=SpecConfig(low_windows=10 ** 6),
                        costs=(prices, 0.0)).start()
        got, done = [], threading.Event()

        def on_event(ev):
            got.append(ev)
            if isinstance(ev, Finished):
                done.set()
        try:
            engine.submit(GenRequest(prompt, 8, stop_ids=frozenset()), on_event)
            assert done.wait(120)
        finally:
            engine.stop()
        assert [ev.id for ev in got if isinstance(ev, Token)] == want
        return got[-1]

    assert served([1.0] + [1e3] * block).drafted == 0
    assert served([1.0] * (block + 1)).drafted > 0
    ids = " ".join(map(str, prompt.tolist()))
    gen = ["generate", "--model", str(tiny_dir), "--tokens", ids, "--max-tokens", "8", "--json"]
    assert main(gen + ["--speculative"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == want and out["speculative"]["windows"] > 0
    assert main(gen + ["--speculative", "--draft-length", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == want and out["speculative"]["drafted"] <= 2 * out["speculative"][
        "windows"]
    for argv in (["serve"], ["generate", "--tokens", "5"]):
        assert main(argv + ["--model", str(tiny_dir), "--draft-length", "2"]) == 2
        assert "--draft-length needs --speculative" in capsys.readouterr().err
    # a model without a draft head is refused at start-up, not at every request
    bare = Model.load(tiny_dir, "cpu")
    bare.dspark = None
    with pytest.raises(StrataError, match="needs a model with DSpark stages"):
        speculative_config(bare, None, graphs=False)


def test_verify_row_sampler_matches_target_distribution(tiny_reference):
    """The token a verify row commits is sample(row logits, position, seed): over many seeds
    its frequencies follow softmax(logits/T) within the top-p nucleus (chi-square, p=0.001)."""
    m = tiny_reference
    state = m.new_state(64)
    logits, _ = m.forward(random_tokens(12, seed=14), state)
    row = logits[-1]
    T, top_p = 1.3, 0.9
    p = torch.softmax(row.double() / T, -1)
    order = torch.sort(p, descending=True, stable=True)
    keep = (torch.cumsum(order.values, 0) - order.values) < top_p
    q = torch.zeros_like(p)
    q[order.indices[keep]] = p[order.indices[keep]]
    q /= q.sum()
    n = 3000
    picks = torch.cat([sample(row[None], torch.tensor([20]), SamplingParams(T, top_p, seed))
                       for seed in range(n)])
    assert bool((q[picks] > 0).all()), "a token outside the nucleus was sampled"
    counts = torch.bincount(picks, minlength=row.numel()).double()
    expect = q * n
    big = expect >= 5
    cells_obs = torch.cat((counts[big], counts[~big].sum()[None]))
    cells_exp = torch.cat((expect[big], expect[~big].sum()[None]))
    nz = cells_exp > 0
    chi2 = float(((cells_obs[nz] - cells_exp[nz]) ** 2 / cells_exp[nz]).sum())
    dof = int(nz.sum()) - 1
    # Wilson–Hilferty approximation of the 0.999 chi-square quantile
    z = 3.09
    crit = dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3
    assert chi2 < crit, (chi2, crit, dof)


def test_dspark_needs_a_speculative_session(tiny_reference):
    with pytest.raises(StrataError, match="speculative"):
        list(Session(tiny_reference, 64).generate(random_tokens(4, seed=1), 3, mode="dspark"))
    with pytest.raises(StrataError, match="decode mode"):
        list(Session(tiny_reference, 64).generate(random_tokens(4, seed=1), 3, mode="fast"))


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_markov_picks_follow_the_definition(tiny_model, params):
    """The draft's Markov picks, kept on the device (each pick indexes the next row's
    embedding), equal the definition run on the host one pick at a time: logits_i = base_i +
    E_m[t_(i-1)]·H_mᵀ, t_i = the request's sampler at position P+1+i, and the confidence
    σ(w·[x_i, m])."""
    from strata.model.context import ForwardContext
    from strata.model.numerics import row_matmul
    m = tiny_model
    s = Session(m, 96, speculative=SpecConfig())
    s.prefill(random_tokens(30, seed=4))
    P, anchor = s.state.position, 17
    d = m.dspark.draft(m.embed, m.head, anchor, s.state, m.numerics,
                       lambda lg, positions: sample(lg, positions, params))
    tokens = torch.full((m.cfg.dspark_block_size,), m.cfg.dspark_noise_token_id)
    tokens[0] = anchor
    ctx = ForwardContext(m.cfg, m.numerics, P, torch.arange(P, P + tokens.numel()))
    x, base = m.dspark.draft_rows(m.embed, m.head, tokens, ctx, s.state)
    dsp, prev = m.dspark, anchor
    for i in range(base.shape[0]):
        e = dsp.markov_embed[prev].float()
        logits = base[i] + row_matmul(e[None], dsp.markov_head.float())[0]
        assert torch.equal(d.logits[i], logits)
        assert torch.equal(d.confidence[i],
                           torch.sigmoid(dsp.confidence_proj[0] @ torch.cat((x[i], e))))
        prev = int(sample(logits[None], torch.tensor([P + 1 + i]), params)[0])
        assert int(d.tokens[i]) == prev
    assert d.tokens.dtype == torch.long and d.tokens.shape == (base.shape[0],)


def test_a_window_failing_after_its_forward_leaves_the_state_as_it_was(tiny_model,
                                                                        monkeypatch):
    """A verify window that fails after its forward (its commit of the draft windows raises
    halfway: some rows written) rolls back: the state at the window's start, no snapshot left
    open, every readable cache as before; the session then goes on to plain decoding's
    tokens."""
    prompt = random_tokens(30, seed=21)
    want = plain_tokens(tiny_model, prompt, 16, GREEDY)
    s = Session(tiny_model, 256, speculative=SpecConfig(length=3, low_windows=10 ** 6),
                draft_override=oracle(want, len(prompt)))
    gen = s.generate(prompt, 16, GREEDY, stop_ids=frozenset())
    assert next(gen) == want[0]
    before, position = s.state.live_tensors(), s.state.position
    real = Session.commit_context

    def failing(self, ctx, rows, start):
        real(self, ctx, 1, start)  # (one row written, then the failure)
        raise RuntimeError("commit failed")
    monkeypatch.setattr(Session, "commit_context", failing)
    with pytest.raises(RuntimeError, match="commit failed"):
        next(gen)
    assert s.state.position == position and s.state.journal is None
    after = s.state.live_tensors()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    monkeypatch.setattr(Session, "commit_context", real)
    assert s.run(want[:1], 15, GREEDY, stop_ids=frozenset()).tokens == want[1:]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_logprobs_are_the_models_in_every_mode(tiny_model, params):
    """A generation's logprobs (Logprobs): one entry a token — its log-probability under the
    model's own distribution and the top alternatives, likeliest first — the same from plain
    steps and from DSpark windows (oracle drafts, some rejected), and the first token's equal
    to the log-softmax of the prompt's last logits."""
    from strata.runtime.sampling import Logprobs
    prompt, n = random_tokens(40, seed=11), 16
    want = plain_tokens(tiny_model, prompt, n, params)
    runs = []
    for spec in (None, SpecConfig(length=3)):
        lp = Logprobs(top=4)
        override = None if spec is None else oracle([0] + want, len(prompt) - 1, corrupt_at=1)
        s = Session(tiny_model, 512, speculative=spec, draft_override=override)
        toks = list(s.generate(prompt, n, params, stop_ids=frozenset(), logprobs=lp))
        assert toks == want and len(lp.items) == n
        runs.append(lp.items)
        if spec is not None:
            assert s.stats.windows > 0 and s.stats.accepted > 0
    for (c0, top0), (c1, top1) in zip(*runs):
        assert c0 == pytest.approx(c1, abs=1e-5)
        assert [i for i, _ in top0] == [i for i, _ in top1]
        assert [v for _, v in top0] == pytest.approx([v for _, v in top1], abs=1e-5)
    for tok, (chosen, top) in zip(want, runs[0]):
        vals = [v for _, v in top]
        assert len(top) == 4 and vals == sorted(vals, reverse=True) and chosen <= vals[0] + 1e-6
        if params.greedy:
            assert top[0][0] == tok and chosen == vals[0]
    last = tiny_model.forward(prompt, tiny_model.new_state(512), logits="last")[0]
    first = torch.log_softmax(last.float().view(-1), -1)
    assert runs[0][0][0] == pytest.approx(float(first[want[0]]), abs=1e-6)
    bare = Logprobs()  # (no alternatives asked for)
    bare.add(last, [want[0]])
    assert bare.items == [(pytest.approx(float(first[want[0]]), abs=1e-6), [])]
    with pytest.raises(StrataError, match="top logprobs 21"):
        Logprobs(top=21)
