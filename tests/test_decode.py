"""decode.py: exact equivalences of the cached decoders, the step map and its replay."""
import pytest
import torch

from conftest import EOS, MASK, PAD, random_prompts, tiny
from decode import COMMIT_RULES, ar_generate, choose, diffusion_generate, replay_chunks, replay_rows


def gen(model, prompts, block, tau, max_new=24, **kw):
    return diffusion_generate(model, prompts, block, tau, max_new, MASK, EOS, PAD, **kw)


# The two context rules of model.CONTEXTS: the decoders must be exact under both. Block under both kernels,
# causal under sdpa (the mask rule is one tensor for both kernels, and test_model.py runs it under both).
KERNELS_AND_CONTEXTS = pytest.mark.parametrize("attn,context", [("eager", "block"), ("sdpa", "block"), ("sdpa", "causal")])


def tiny_in(context, *args, **kw):
    model = tiny(*args, **kw)
    model.config.diffusion_context = context
    return model


@KERNELS_AND_CONTEXTS
def test_block_size_one_is_ar_greedy(attn, context):
    model = tiny_in(context, attn, sharpen=4.0)
    prompts = random_prompts(3)
    ar = ar_generate(model, prompts, 20, EOS, PAD)
    bd = gen(model, prompts, block=1, tau=0.9, max_new=20)
    assert bd.tokens == ar.tokens
    assert bd.nfe == ar.nfe  # with B = 1 every forward is a commit forward: exactly AR's count


@pytest.mark.parametrize("commit", COMMIT_RULES)
@KERNELS_AND_CONTEXTS
def test_cache_and_no_cache_decode_the_same(attn, commit, context):
    model = tiny_in(context, attn, sharpen=30.0)  # confident logits: several commits per step
    prompts = random_prompts(3, 4, 14)
    a = gen(model, prompts, block=4, tau=0.7, commit=commit)
    b = gen(model, prompts, block=4, tau=0.7, use_cache=False, commit=commit)
    assert a.tokens == b.tokens and a.steps == b.steps
    assert max(a.nfe) < 1 + 24 + 6  # parallel commits really happened


def test_tau_one_commits_exactly_one_token_per_forward():
    model = tiny(sharpen=100.0)  # float32 softmax saturates at exactly 1.0 here
    out = gen(model, random_prompts(2), block=4, tau=1.0)
    for steps in out.steps:
        for b in range(0, len(steps), 4):
            done = sorted(s for s in steps[b:b + 4] if s >= 0)
            assert done == list(range(len(done)))  # one commit per step, no step twice


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


def test_replay_canvases_mask_exactly_the_uncommitted_positions():
    model = tiny(sharpen=30.0)
    out = gen(model, random_prompts(1), block=4, tau=0.7)
    canvas, steps = out.canvas[0], out.steps[0]
    noisy, targets = replay_rows(canvas, steps, MASK)
    for s, (row, tg) in enumerate(zip(noisy, targets)):
        for r, (tok, st) in enumerate(zip(row, steps)):
            assert (tok == MASK) == (st < 0 or st >= s)
        assert tg == [r for r, st in enumerate(steps) if st == s]


def test_sub_blocks_are_committed_left_to_right():
    model = tiny(sharpen=30.0)
    prompts, block, sub = random_prompts(3, 4, 14), 8, 2
    parallel = []

    def check(b, s, canvas, commit, pred):
        for i in range(len(prompts)):
            cols = commit[i].nonzero()[:, 0]
            if len(cols):
                assert len(set((cols // sub).tolist())) == 1  # one sub-block per step
                left = canvas[i, b * block: b * block + int(cols[0]) // sub * sub]
                assert (left != MASK).all()  # every sub-block to its left is finished
                parallel.append(len(cols))

    out = gen(model, prompts, block=block, tau=0.7, max_new=32, sub_block=sub, on_step=check)
    assert max(parallel) == 2  # both positions of a sub-block committed in one step happened
    for steps in out.steps:  # the step map says the same: sub-block k finishes before k + 1 starts
        for lo in range(0, len(steps), sub):
            here, after = [s for s in steps[lo:lo + sub] if s >= 0], [s for s in steps[lo + sub:(lo // block + 1) * block] if s >= 0]
            assert not here or not after or max(here) < min(after)


def test_prefix_rule_commits_the_leftmost_mask_and_the_confident_run_after_it():
    model = tiny(sharpen=30.0)
    prompts, block, tau = random_prompts(3, 4, 14), 8, 0.7
    runs = []

    def check(b, s, canvas, commit, pred):
        lo = b * block
        before = (canvas[:, lo:] == MASK) | commit  # the masks this step saw
        sure = pred.softmax(-1).amax(-1) >= tau
        for i in range(len(prompts)):
            cols = commit[i].nonzero()[:, 0].tolist()
            if not cols:
                continue
            first = int(before[i].float().argmax())
            assert cols == list(range(first, first + len(cols)))  # one unbroken run from the leftmost mask
            assert all(sure[i, j] for j in cols[1:])  # every commit after the first is confident
            nxt = first + len(cols)
            assert nxt == block or not before[i, nxt] or not sure[i, nxt]  # and the run is as long as it can be
            runs.append(len(cols))

    gen(model, prompts, block=block, tau=tau, max_new=32, commit="prefix", on_step=check)
    assert max(runs) > 1  # several positions committed in one forward happened


def test_prefix_rule_at_tau_one_is_left_to_right_one_token_per_step():
    model = tiny(sharpen=4.0)
    prompts = random_prompts(3, 4, 14)
    out = gen(model, prompts, block=4, tau=1.0, commit="prefix")
    one = gen(model, prompts, block=4, tau=0.9, sub_block=1)  # a sub-block of one: the same order by construction
    assert out.tokens == one.tokens and out.steps == one.steps
    for steps in out.steps:
        assert all(s == j % 4 for j, s in enumerate(steps) if s >= 0)  # position j of a block at step j


def test_commit_rules_on_hand_made_confidences():
    # four masked positions at 0.95, 0.95, 0.95, 0.5 and tau 0.9: products 0.95, 0.9025, 0.857, ...
    conf, masked = torch.tensor([[0.95, 0.95, 0.95, 0.5]]), torch.ones(1, 4, dtype=torch.bool)
    picked = {rule: choose(conf, masked, 0.9, rule)[0].tolist() for rule in COMMIT_RULES}
    assert picked == {"any": [True, True, True, False], "prefix": [True, True, True, False],
                      "joint": [True, True, False, False], "prefix-joint": [True, True, False, False]}
    # an unsure leftmost mask (0.5) is still committed by the prefix rules; only prefix goes on past it
    conf = torch.tensor([[-1.0, 0.5, 0.99, 0.97]])  # position 0 is already filled
    masked = torch.tensor([[False, True, True, True]])
    picked = {rule: choose(conf, masked, 0.9, rule)[0].tolist() for rule in COMMIT_RULES}
    assert picked == {"any": [False, False, True, True], "prefix": [False, True, True, True],
                      "joint": [False, False, True, True], "prefix-joint": [False, True, False, False]}
    # nothing sure: every rule commits exactly one position; a row without masks commits nothing
    conf, masked = torch.tensor([[0.3, 0.6, 0.4], [-1.0, -1.0, -1.0]]), torch.tensor([[True] * 3, [False] * 3])
    for rule in COMMIT_RULES:
        assert choose(conf, masked, 0.9, rule).sum(1).tolist() == [1, 0], rule
        assert choose(torch.tensor([[1.0, 1.0, 1.0]]), masked[:1], 1.0, rule).sum().item() == 1, rule  # tau 1: one


@pytest.mark.parametrize("commit", ["joint", "prefix-joint"])
def test_joint_rules_keep_the_product_of_a_steps_confidences_above_tau(commit):
    model = tiny(sharpen=30.0)
    prompts, tau, sizes = random_prompts(3, 4, 14), 0.7, []

    def check(b, s, canvas, committed, pred):
        conf = pred.softmax(-1).amax(-1)
        for i in range(len(prompts)):
            cols = committed[i].nonzero()[:, 0]
            assert len(cols) <= 1 or conf[i, cols].prod() >= tau  # one forced commit, or a product >= tau
            sizes.append(len(cols))

    gen(model, prompts, block=8, tau=tau, max_new=32, commit=commit, on_step=check)
    assert max(sizes) > 1  # several positions committed in one forward happened
    left_to_right = gen(model, prompts, block=8, tau=1.0, commit="prefix-joint")  # tau 1: the prefix rule exactly
    assert left_to_right.tokens == gen(model, prompts, block=8, tau=1.0, commit="prefix").tokens


def test_an_unknown_commit_rule_is_refused():
    with pytest.raises(ValueError, match="commit must be one of"):
        gen(tiny(), random_prompts(1), block=4, tau=0.9, commit="random")


@pytest.mark.parametrize("sub_block,commit,pack", [(0, "any", 1), (2, "any", 2), (0, "prefix", 3), (0, "joint", 2),
                                                   (2, "prefix-joint", 3)])  # pack: canvases sharing a row
@KERNELS_AND_CONTEXTS
def test_replayed_logits_equal_the_decoders_logits_at_commit_time(attn, sub_block, commit, pack, context):
    model = tiny_in(context, attn, sharpen=30.0)
    prompts = random_prompts(2, 5, 12)
    seen = {}

    def record(b, s, canvas, commit, pred):
        for i, j in commit.nonzero().tolist():
            seen[(i, b * 4 + j)] = pred[i, j].clone()

    out = gen(model, prompts, block=4, tau=0.7, on_step=record, sub_block=sub_block, commit=commit)
    keep = [len(t) for t in out.tokens]
    parts = list(replay_chunks(model, prompts, out.canvas, out.steps, 4, MASK, keep, pad_id=PAD, max_rows=3, pack=pack))
    logits, order = torch.cat([lg for lg, _ in parts]), [o for _, od in parts for o in od]
    assert len(order) == sum(keep) and sorted(order) == sorted(set(order))  # every kept token exactly once
    for row, key in zip(logits, order):
        ref = seen[key]
        ok = torch.isfinite(ref)
        assert (row[ok] - ref[ok]).abs().max() <= 1e-4


class WordTok:  # what the viewer needs of a tokenizer
    mask_token_id, eos_token_id, pad_token_id = MASK, EOS, PAD

    def convert_ids_to_tokens(self, i):
        return f"t{i}"

    def decode(self, ids):
        return " ".join(f"t{i}" for i in ids)


def test_viewer_highlights_exactly_the_tokens_committed_at_each_step(capsys):
    from decode import show
    show(tiny(sharpen=30.0), WordTok(), {"prompt_ids": random_prompts(1)[0]}, block=4, tau=0.7, max_new=16)
    steps = [line for line in capsys.readouterr().out.splitlines() if line.startswith("block ")]
    assert {line.split()[1] for line in steps} >= {"0", "1"}  # it got past the first block
    for line in steps:
        head, shown = line.split(": ", 1)
        assert sum(w.startswith("*") for w in shown.split()) == int(head.split("+")[1])


@pytest.mark.parametrize("sub_block", [-1, 5])
def test_a_sub_block_outside_the_block_is_refused(sub_block, capsys):
    import cft
    with pytest.raises(ValueError, match="sub_block must be between 0"):
        gen(tiny(), random_prompts(1), block=4, tau=0.9, sub_block=sub_block)
    with pytest.raises(SystemExit):
        cft.parse_args(["--block", "4", "--sub-block", str(sub_block)])
    assert "--sub-block must be between 0" in capsys.readouterr().err
