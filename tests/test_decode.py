"""decode.py: exact equivalences of the cached decoders, the commit rules, the stopping rule, the step map and its replay."""
import pytest
import torch

from conftest import EOS, MASK, PAD, random_prompts, tiny
from decode import (COMMIT_RULES, CachedModel, ar_generate, choose, diffusion_generate, finished, replay_chunks,
                    replay_rows)
from model import NOISY, build_rows, hidden_states, noisy_copy, target_sources


def gen(model, prompts, block, tau, max_new=24, **kw):
    return diffusion_generate(model, prompts, block, tau, max_new, MASK, EOS, PAD, **kw)


def recorder(seen, block, sizes=None):
    """An on_step that keeps the logit each committed token was chosen from, by (row, response position),
    and (sizes) how many tokens each row committed at each step."""
    def record(b, s, canvas, committed, pred):
        for i, j in committed.nonzero().tolist():
            seen[(i, b * block + j)] = pred[i, j].clone()
        if sizes is not None:
            sizes.extend(committed.sum(1).tolist())
    return record


# ----------------------------------------------------------------------------- exact equivalences
def test_block_size_one_is_ar_greedy(attn):
    model = tiny(attn, sharpen=4.0)
    prompts = random_prompts(3)
    ar = ar_generate(model, prompts, 20, EOS, PAD)
    bd = gen(model, prompts, block=1, tau=0.9, max_new=20)
    assert bd.tokens == ar.tokens and len({len(t) for t in ar.tokens}) > 1  # rows of different lengths: some stop early
    assert bd.nfe == ar.nfe  # with B = 1 every forward is a commit forward: exactly AR's count


@pytest.mark.parametrize("commit", COMMIT_RULES)
def test_cache_and_no_cache_decode_the_same(attn, commit):
    model = tiny(attn, sharpen=30.0)  # confident logits: several commits per step
    prompts = random_prompts(3, 4, 14)
    a = gen(model, prompts, block=4, tau=0.7, commit=commit)
    b = gen(model, prompts, block=4, tau=0.7, use_cache=False, commit=commit)
    assert a.tokens == b.tokens and a.steps == b.steps
    assert max(a.nfe) < 1 + 24 + 6  # parallel commits really happened


def test_eager_and_sdpa_decode_from_the_same_logits():
    """The cached path builds its masks against the cache (queries shorter than keys): both kernels agree."""
    prompts, logits = random_prompts(3, 4, 14), {}
    for attn in ("eager", "sdpa"):
        seen = logits[attn] = {}
        out = gen(tiny(attn, sharpen=30.0), prompts, block=4, tau=0.7, on_step=recorder(seen, 4))
        logits[attn + " tokens"] = out.tokens
    assert logits["eager tokens"] == logits["sdpa tokens"] and logits["eager"].keys() == logits["sdpa"].keys()
    assert max((logits["eager"][k] - logits["sdpa"][k]).abs().max() for k in logits["eager"]) <= 1e-4


def test_training_layout_logits_equal_cached_decoding_logits(attn):
    """The logit diffusion_loss reads for each token of x_t (token shift: j = 0 of a block from x_0's previous
    block, j > 0 from the noisy block) is the logit the cached decoder computes for that position in that state,
    the last block padded with masks in both."""
    model, block = tiny(attn), 4
    p, r = random_prompts(1)[0], random_prompts(1, 10, 11, seed=4)[0]  # blocks of 4, 4 and 2 (+ 2 masks)
    x_t = noisy_copy(r, [j % 3 != 1 for j in range(len(r))], block, MASK)
    rows = build_rows([p], [r], block, noisy=[[x_t]])
    train = model.lm_head(hidden_states(model, rows))[0]
    src, _ = target_sources(rows, [len(r)], block, copy=0)
    state = CachedModel(model, [p], PAD)
    for lo in range(0, len(r), block):
        noisy = state.forward(torch.tensor([x_t[lo:lo + block]]), state.response_desc(lo, block, block, NOISY), keep=False)
        pred = torch.cat([state.edge, noisy[0, :-1]])  # position 0: the logit that closed the previous block
        for j in range(min(block, len(r) - lo)):
            assert (pred[j] - train[src[0, lo + j]]).abs().max() <= 1e-4, (lo, j)
        if lo + block < len(r):  # the commit forward of a whole block writes it into the cache
            state.edge = state.forward(torch.tensor([r[lo:lo + block]]), state.response_desc(lo, block, block), keep=True)


def test_batch_equals_one_by_one():
    model = tiny(sharpen=30.0)
    prompts = random_prompts(4, 3, 15)
    batch = gen(model, prompts, block=4, tau=0.8)
    for i, p in enumerate(prompts):
        one = gen(model, [p], block=4, tau=0.8)
        assert one.tokens[0] == batch.tokens[i] and one.steps[0] == batch.steps[i]


def test_ar_batch_equals_one_by_one():
    model = tiny(sharpen=4.0)
    prompts = random_prompts(3, 3, 15)
    batch = ar_generate(model, prompts, 12, EOS, PAD)
    for i, p in enumerate(prompts):
        assert ar_generate(model, [p], 12, EOS, PAD).tokens[0] == batch.tokens[i]


# ----------------------------------------------------------------------------- commit rules
def test_threshold_rule_on_hand_made_confidences():
    rule = lambda conf, masked, tau: choose(torch.tensor(conf), torch.tensor(masked), tau, "threshold").tolist()
    assert rule([[0.95, 0.5, 0.91, -1.0]], [[True, True, True, False]], 0.9) == [[True, False, True, False]]
    assert rule([[0.3, 0.6, 0.4]], [[True] * 3], 0.9) == [[False, True, False]]  # nothing sure: the most confident
    assert rule([[-1.0, -1.0]], [[False, False]], 0.9) == [[False, False]]  # no masks: nothing
    # tau = 1.0: exactly one token per step, even where a float32 softmax has rounded several confidences to 1.0
    assert sum(rule([[1.0, 0.2, 1.0, 1.0]], [[True] * 4], 1.0)[0]) == 1
    assert rule([[0.2, 1.0, 1.0]], [[True] * 3], 1.0)[0][0] is False


def test_left_to_right_rule_on_hand_made_confidences():
    rule = lambda conf, masked, tau: choose(torch.tensor(conf), torch.tensor(masked), tau, "left-to-right").tolist()
    # products from the leftmost mask: 0.95, 0.9025, 0.857: the third would take the product below 0.9
    assert rule([[0.95, 0.95, 0.95, 0.5]], [[True] * 4], 0.9) == [[True, True, False, False]]
    # the leftmost mask is committed however unsure; the sure ones after it wait for it
    assert rule([[-1.0, 0.5, 0.99, 0.97]], [[False, True, True, True]], 0.9) == [[False, True, False, False]]
    assert rule([[-1.0, 0.99, 0.98, 0.3]], [[False, True, True, True]], 0.9) == [[False, True, True, False]]
    assert rule([[1.0, 1.0, 1.0]], [[True] * 3], 1.0) == [[True, False, False]]  # tau 1: one token, leftmost
    assert rule([[0.9, 0.9, 0.9], [0.2, 0.99, 0.99]], [[True] * 3] * 2, 0.75) == [[True, True, False], [True, False, False]]


def rule_by_hand(conf, masked, tau, commit):
    """The positions a step must commit, from the docstring of decode.choose, position by position."""
    idx = [j for j in range(len(conf)) if masked[j]]
    if commit == "threshold":
        chosen = {max(idx, key=lambda j: (conf[j], -j))} | ({j for j in idx if conf[j] >= tau} if tau < 1 else set())
    else:
        chosen, product = {idx[0]}, conf[idx[0]]
        for j in idx[1:] if tau < 1 else []:
            product *= conf[j]
            if product < tau:
                break
            chosen.add(j)
    return chosen


@pytest.mark.parametrize("commit", COMMIT_RULES)
@pytest.mark.parametrize("tau", [1.0, 0.3])  # 0.3: several commits per step on this micro model
def test_every_decoding_step_commits_what_its_rule_says(commit, tau):
    model, block = tiny(sharpen=30.0), 8
    prompts, sizes = random_prompts(3, 4, 14), []

    def check(b, s, canvas, committed, pred):
        lo = b * block
        before = (canvas[:, lo:] == MASK) | committed  # the masks this step saw
        conf = torch.softmax(pred.index_fill(-1, torch.tensor([MASK]), -float("inf")), -1).amax(-1)
        for i in range(len(prompts)):
            if committed[i].any():  # a finished row commits nothing more
                got = set(committed[i].nonzero()[:, 0].tolist())
                assert got == rule_by_hand(conf[i].tolist(), before[i].tolist(), tau, commit), (b, s, i)
                sizes.append(len(got))

    gen(model, prompts, block=block, tau=tau, max_new=32, commit=commit, on_step=check)
    assert sizes and (max(sizes) == 1) == (tau == 1.0)  # several positions in one forward happened below tau 1


def test_an_unknown_commit_rule_is_refused():
    with pytest.raises(ValueError, match="commit must be one of"):
        gen(tiny(), random_prompts(1), block=4, tau=0.9, commit="random")


# ----------------------------------------------------------------------------- stopping and the mask token
def test_a_row_finishes_only_when_nothing_before_its_first_end_token_is_masked():
    E, M = EOS, MASK
    canvas = torch.tensor([[5, M, E, M], [5, 6, E, M], [5, 6, E, E], [E, M, M, M], [5, 6, 7, 8], [M, M, M, M]])
    assert finished(canvas, M, E).tolist() == [False, True, True, True, False, False]


def test_decoding_goes_on_past_an_early_end_token_and_drops_what_follows_the_first():
    model, block = tiny(sharpen=4.0), 4
    prompts = random_prompts(6, 4, 12)
    out = gen(model, prompts, block=block, tau=0.5, max_new=16, temperature=1.0, generator=torch.Generator().manual_seed(1))
    early = beyond = 0
    for tokens, canvas, steps in zip(out.tokens, out.canvas, out.steps):
        if EOS not in canvas:
            assert tokens == canvas
            continue
        e = canvas.index(EOS)
        assert tokens == canvas[:e + 1] and MASK not in tokens  # up to the first end token, every position filled
        lo = e // block * block
        early += any(steps[j] > steps[e] for j in range(lo, e))  # committed while a mask was left before it
        beyond += any(s >= 0 for s in steps[e + 1:])              # committed after it, then dropped
    assert early and beyond  # both cases happened in this draw
    keep = [len(t) for t in out.tokens]
    order = [o for _, od in replay_chunks(model, prompts, out.canvas, out.steps, block, MASK, keep, PAD) for o in od]
    assert sorted(order) == [(i, r) for i, n in enumerate(keep) for r in range(n)]  # the kept tokens, each once


def test_the_policy_never_emits_the_mask_token():
    """A head that puts most of the probability on the mask token: neither greedy nor sampled decoding commits
    it, and the replayed policy gives it zero probability."""
    model, block = tiny(sharpen=4.0), 4
    prompts = random_prompts(4, 4, 12)
    with torch.no_grad():  # the mask row along the mean hidden state: the mask token wins almost everywhere
        h = hidden_states(model, build_rows(prompts, random_prompts(4, 8, 9, seed=2), block)).reshape(-1, 32).mean(0)
        model.lm_head.weight[MASK] = 30 * h / h.norm() ** 2
    raw_wins = []
    on_step = lambda b, s, canvas, committed, pred: raw_wins.append((pred.argmax(-1) == MASK).float().mean().item())
    for temperature in (0.0, 1.0):
        out = gen(model, prompts, block, 0.5, max_new=16, temperature=temperature,
                  generator=torch.Generator().manual_seed(1), on_step=on_step)
        assert all(t != MASK for c, st in zip(out.canvas, out.steps) for t, s in zip(c, st) if s >= 0)
    assert sum(raw_wins) / len(raw_wins) > 0.5  # without the exclusion the mask token would be chosen
    keep = [len(t) for t in out.tokens]
    for logits, _ in replay_chunks(model, prompts, out.canvas, out.steps, block, MASK, keep, PAD):
        probs = torch.softmax(logits, -1)
        assert (probs[:, MASK] == 0).all() and torch.isfinite(probs).all()


# ----------------------------------------------------------------------------- step map and replay
def test_tau_one_commits_exactly_one_token_per_forward():
    model = tiny(sharpen=100.0)  # float32 softmax saturates at exactly 1.0 here
    for commit in COMMIT_RULES:
        out = gen(model, random_prompts(2), block=4, tau=1.0, commit=commit)
        for steps in out.steps:
            for b in range(0, len(steps), 4):
                done = sorted(s for s in steps[b:b + 4] if s >= 0)
                assert done == list(range(len(done)))  # one commit per step, no step twice
                if commit == "left-to-right":
                    assert steps[b:b + len(done)] == done  # position j of a block at step j


def test_replay_canvases_mask_exactly_the_uncommitted_positions():
    model = tiny(sharpen=30.0)
    out = gen(model, random_prompts(1), block=4, tau=0.7)
    canvas, steps = out.canvas[0], out.steps[0]
    noisy, targets = replay_rows(canvas, steps, MASK)
    assert len(noisy) == max(steps) + 1
    for s, (row, tg) in enumerate(zip(noisy, targets)):
        for r, (tok, st) in enumerate(zip(row, steps)):
            assert (tok == MASK) == (st < 0 or st >= s)
        assert tg == [r for r, st in enumerate(steps) if st == s]


@pytest.mark.parametrize("commit,pack", [("threshold", 1), ("threshold", 2), ("left-to-right", 3)])  # canvases per row
def test_replayed_logits_equal_the_decoders_logits_at_commit_time(attn, commit, pack):
    model = tiny(attn, sharpen=30.0)
    prompts = random_prompts(2, 5, 12)
    seen, sizes = {}, []
    out = gen(model, prompts, block=4, tau=0.3, on_step=recorder(seen, 4, sizes), commit=commit)
    assert max(sizes) > 1  # canvases from which several tokens were committed at once
    keep = [len(t) for t in out.tokens]
    parts = list(replay_chunks(model, prompts, out.canvas, out.steps, 4, MASK, keep, pad_id=PAD, max_rows=3, pack=pack))
    logits, order = torch.cat([lg for lg, _ in parts]), [o for _, od in parts for o in od]
    assert len(parts) > 1 and len(order) == sum(keep) and len(set(order)) == len(order)  # every kept token once
    others = torch.arange(logits.shape[1]) != MASK
    for row, key in zip(logits, order):
        assert (row[others] - seen[key][others]).abs().max() <= 1e-4
    assert (torch.softmax(logits, -1)[:, MASK] == 0).all()  # the policy's distribution: no mask token


class WordTok:  # what the viewer needs of a tokenizer
    mask_token_id, eos_token_id, pad_token_id = MASK, EOS, PAD

    def convert_ids_to_tokens(self, i):
        return [f"t{j}" for j in i]

    def decode(self, ids):
        return " ".join(f"t{i}" for i in ids)


def test_viewer_highlights_exactly_the_tokens_committed_at_each_step(capsys):
    from harness import show
    show(tiny(sharpen=30.0), WordTok(), {"prompt_ids": random_prompts(1)[0]}, block=4, tau=0.7, max_new=16)
    steps = [line for line in capsys.readouterr().out.splitlines() if line.startswith("block ")]
    assert {line.split()[1] for line in steps} >= {"0", "1"}  # it got past the first block
    for line in steps:
        head, shown = line.split(": ", 1)
        assert sum(w.startswith("*") for w in shown.split()) == int(head.split("+")[1])


def test_a_fused_commit_and_draft_forward_equals_the_two_forwards():
    """CachedModel.commit_and_draft: the finished block's K/V, the next block's first logit (edge) and its
    denoising logits equal a commit forward followed by a denoising forward."""
    model = tiny(seed=0)
    prompts = [[3, 4, 5, 6, 7], [8, 9]]
    block = 4
    clean = torch.randint(1, 40, (2, block), generator=torch.Generator().manual_seed(0))
    nxt = torch.full((2, block), MASK)
    nxt[:, 0] = torch.tensor([11, 12])  # a given first token, as draft-verify's verify can leave one
    two = CachedModel(model, prompts, PAD)
    edge = two.forward(clean, two.response_desc(0, block, block), keep=True)
    draft = two.forward(nxt, two.response_desc(block, block, block, NOISY), keep=False)
    one = CachedModel(model, prompts, PAD)
    fused_edge, fused_draft = one.commit_and_draft(clean, 0, nxt, block)
    assert torch.allclose(fused_edge, edge, atol=1e-5) and torch.allclose(fused_draft, draft, atol=1e-5)
    assert one.cache.get_seq_length() == two.cache.get_seq_length() == one.keys[0].shape[1]
    for a, b in zip(one.cache.layers, two.cache.layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)
