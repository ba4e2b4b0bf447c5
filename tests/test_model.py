"""model.py: masks, the training layout, token shift, noise and losses on micro random models."""
import pytest
import torch
import torch.nn.functional as F

from conftest import MASK, PAD, VOCAB, random_prompts, tiny
from model import (ar_loss, attention_mask, build_rows, diffusion_loss, hidden_states, init_mask_embedding,
                   noisy_copy, sample_noise, target_sources, token_kl)


def logits_of(model, rows):
    return model.lm_head(hidden_states(model, rows))


def batch_of(ps, rs, n_reasoning=None):
    return {"prompt_ids": ps, "response_ids": rs, "n_reasoning": n_reasoning or [len(r) // 2 for r in rs]}


# ----------------------------------------------------------------------------- masks and layouts
def test_block_size_one_is_the_causal_model(attn):
    model = tiny(attn)
    p, r = random_prompts(1)[0], random_prompts(1, 20, 21, seed=1)[0]
    ours = logits_of(model, build_rows([p], [r], block=1))
    plain = model(input_ids=torch.tensor([p + r])).logits  # HF's own causal path, no mask passed
    assert (ours - plain).abs().max() <= 1e-5


def test_noisy_half_equals_block_causal_forward_when_noisy_is_clean(attn):
    model = tiny(attn)
    p, r = random_prompts(1)[0], random_prompts(1, 23, 24, seed=1)[0]
    block = 4
    plain = logits_of(model, build_rows([p], [r], block))              # [prompt | response], block-causal
    both = logits_of(model, build_rows([p], [r], block, noisy=[[r]]))  # [prompt | x_t = x_0 | x_0]
    P, R = len(p), len(r)
    assert (both[:, P:P + R] - plain[:, P:P + R]).abs().max() <= 1e-5
    assert (both[:, P + R:] - plain[:, P:]).abs().max() <= 1e-5


def test_a_later_block_never_changes_earlier_blocks(attn):
    model = tiny(attn)
    p, r = random_prompts(1)[0], random_prompts(1, 16, 17, seed=2)[0]
    block, k = 4, 2
    changed = list(r)
    changed[k * block + 1] = (changed[k * block + 1] + 7) % 50 + 1
    a = logits_of(model, build_rows([p], [r], block))
    b = logits_of(model, build_rows([p], [changed], block))
    cut = len(p) + k * block
    assert (a[:, :cut] - b[:, :cut]).abs().max() == 0
    assert (a[:, cut:cut + block] - b[:, cut:cut + block]).abs().max() > 1e-4  # but its own block does see it


def test_mask_is_bidirectional_inside_a_block_and_causal_across():
    rows = build_rows([[1, 2]], [[3, 4, 5, 6, 7]], block=2, noisy=[[[MASK] * 6]])  # x_t padded to 3 whole blocks
    desc = (rows["seg"], rows["blk"], rows["pos"])
    m = attention_mask(desc, desc)[0, 0]
    N, C = 2, 8  # segment starts: noisy, clean (the prompt is columns 0-1)
    assert m[1, 0] and not m[0, 1]                        # prompt is causal
    assert m[N:, 0].all() and m[N:, 1].all()              # every response position sees the whole prompt
    assert m[N + 0, N + 1] and m[N + 1, N + 0]            # noisy block 0 is bidirectional
    assert not m[N + 0, N + 2]                            # ... and cannot see noisy block 1
    assert m[N + 5, N + 4] and m[N + 4, N + 5]            # the padded last block is one block too
    assert m[N + 2, C + 1] and not m[N + 2, C + 2]        # noisy block 1 sees clean block 0, not clean block 1
    assert m[C + 2, C + 3] and m[C + 3, C + 2] and not m[C + 1, C + 2]  # clean copy is block-causal
    assert not m[C:, N:C].any()                           # clean tokens never see noisy ones


@pytest.mark.parametrize("layout", ["ar", "block", "one copy", "two copies"])
def test_eager_and_sdpa_agree_on_every_training_layout(layout):
    """Eager adds the mask to the scores, sdpa takes it as a bool: every layout must come out the same on the
    real positions, with rows of different lengths right-padded in one batch."""
    eager, sdpa = tiny("eager"), tiny("sdpa")
    ps, rs = random_prompts(3), random_prompts(3, 9, 19, seed=3)
    block = 1 if layout == "ar" else 4
    copies = {"ar": 0, "block": 0, "one copy": 1, "two copies": 2}[layout]
    noisy = [[noisy_copy(r, [(i + c) % 3 == 0 for i in range(len(r))], block, MASK) for r in rs] for c in range(copies)]
    rows = build_rows(ps, rs, block, noisy=noisy, pad_id=PAD)
    real = rows["seg"] != 0
    a, b = logits_of(eager, rows)[real], logits_of(sdpa, rows)[real]
    assert (a - b).abs().max() <= 1e-5


def test_token_shift_sources():
    response = [4, 5, 6, 7, 8]
    x_t = noisy_copy(response, [True] * 5, 2, MASK)
    assert x_t == [MASK] * 6  # padded with masks to whole blocks, as the decoder's last block
    rows = build_rows([[1, 2, 3]], [response], block=2, noisy=[[x_t]])
    src, real = target_sources(rows, [5], 2)
    P, N, C = 3, 3, 9
    # j = 0 of a block: x_0's previous position (the commit forward's logit); j > 0: the noisy block itself
    assert src[0].tolist() == [P - 1, N + 0, C + 1, N + 2, C + 3] and real.all()
    plain = build_rows([[1, 2, 3]], [response], block=2)
    assert target_sources(plain, [5], 2)[0][0].tolist() == [2, 3, 4, 5, 6]


def test_noisy_copies_sharing_a_row_get_the_logits_of_rows_of_their_own(attn):
    model, block = tiny(attn), 4
    ps, rs = random_prompts(2), random_prompts(2, 6, 11, seed=5)  # different lengths: padding in both layouts
    g = torch.Generator().manual_seed(1)
    copies = [[noisy_copy(r, (torch.rand(len(r), generator=g) < 0.5).tolist(), block, MASK) for r in rs] for _ in range(2)]
    shared = build_rows(ps, rs, block, noisy=copies, pad_id=PAD)
    h = logits_of(model, shared)
    lengths = [len(r) for r in rs]
    for c in range(2):  # every logit that predicts a response token from copy c, read in both layouts
        alone = build_rows(ps, rs, block, noisy=[copies[c]], pad_id=PAD)
        a = logits_of(model, alone)
        src_shared, _ = target_sources(shared, lengths, block, copy=c)
        src_alone, _ = target_sources(alone, lengths, block)
        for i, n in enumerate(lengths):
            assert (h[i, src_shared[i, :n]] - a[i, src_alone[i, :n]]).abs().max() <= 1e-5


# ----------------------------------------------------------------------------- noise and losses
def test_noise_has_one_level_per_block_and_never_reaches_past_the_response():
    lengths, block, t_range = [5, 12, 9], 4, (0.1, 0.7)
    masked, t = sample_noise(lengths, block, t_range, torch.Generator().manual_seed(0))
    again, t2 = sample_noise(lengths, block, t_range, torch.Generator().manual_seed(0))
    assert torch.equal(masked, again) and torch.equal(t, t2)  # the generator alone decides (resumable runs)
    assert masked.shape == t.shape == (3, 12)
    assert ((t >= t_range[0]) & (t <= t_range[1])).all()
    for lo in range(0, 12, block):
        assert (t[:, lo:lo + block] == t[:, lo:lo + 1]).all()  # one level for the whole block
    for i, n in enumerate(lengths):
        assert not masked[i, n:].any()


def weighted_ce_by_hand(model, p, r, masked_row, block, n_reasoning, lam_r, lam_o):
    """(sum of w * CE, sum of w) over the masked tokens of one response, from a forward of its own row."""
    x_t = noisy_copy(r, masked_row, block, MASK)
    rows = build_rows([p], [r], block, noisy=[[x_t]])
    logits = logits_of(model, rows)[0]
    src, _ = target_sources(rows, [len(r)], block, copy=0)
    num, den = 0.0, 0.0
    for j in range(len(r)):
        if masked_row[j]:
            w = lam_r if j < n_reasoning else lam_o
            num = num + w * F.cross_entropy(logits[src[0, j]][None], torch.tensor([r[j]]))
            den += w
    return num, den


def test_the_mask_padding_of_the_last_block_is_never_scored():
    """x_t is padded with masks to whole blocks: the real tokens of the last block see that padding, but
    the padding itself is no target, whatever the noise asks for beyond the end and whatever fills the row."""
    model, block = tiny(), 4
    ps = random_prompts(2)
    rs = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19]]  # last blocks: 2 real + 2 pad, 1 real + 3 pad
    n_reasoning = [2, 4]
    wide = torch.rand(2, 16, generator=torch.Generator().manual_seed(4)) < 0.5  # wider than any response
    wide[0, 5] = wide[1, 8] = True  # a real token of each last block is a target
    wide[:, 9:] = True
    narrow = wide.clone()
    narrow[0, 6:] = narrow[1, 9:] = False  # the same noise on the real tokens, nothing asked for beyond them
    results = [diffusion_loss(model, batch_of(ps, rs, n_reasoning), block, MASK, complementary=False,
                              masked=m, pad_id=pad) for m in (wide, narrow) for pad in (PAD, 7, MASK)]
    n_real_masked = int(wide[0, :6].sum() + wide[1, :9].sum())
    for loss, n in results:
        assert n == n_real_masked and torch.allclose(loss, results[0][0], atol=1e-6)
    # by hand, each response in a row of its own, only its real masked tokens: the batch's padding leaks nothing
    parts = [weighted_ce_by_hand(model, p, r, wide[i, :len(r)].tolist(), block, n_reasoning[i], 0.5, 1.0)
             for i, (p, r) in enumerate(zip(ps, rs))]
    assert torch.allclose(results[0][0], sum(p[0] for p in parts) / sum(p[1] for p in parts), atol=1e-5)


def test_complementary_loss_in_one_row_equals_the_two_rows_of_its_masks():
    model, block = tiny(), 4
    ps, rs = random_prompts(2), [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    masked = torch.rand(2, 6, generator=torch.Generator().manual_seed(2)) < 0.4
    real = torch.arange(6)[None] < torch.tensor([[6], [3]])
    args = (model, batch_of(ps, rs), block, MASK)
    pair, n = diffusion_loss(*args, complementary=True, masked=masked)
    one, n1 = diffusion_loss(*args, complementary=False, masked=masked)
    two, n2 = diffusion_loss(*args, complementary=False, masked=~masked & real)
    w = torch.tensor([0.5] * 3 + [1.0] * 3), torch.tensor([0.5] + [1.0] * 2)  # lambda_r on the first n_reasoning
    w1, w2 = (sum(float(wi[m[i, :len(wi)]].sum()) for i, wi in enumerate(w)) for m in (masked & real, ~masked & real))
    assert n == n1 + n2 == 6 + 3  # every real response token is a target exactly once per pair
    assert torch.allclose(pair, (w1 * one + w2 * two) / (w1 + w2), atol=1e-5)


def test_inverse_t_weights_each_target_by_its_blocks_noise_level():
    model, block = tiny(), 4
    batch = batch_of(random_prompts(1), [[5, 6, 7, 8, 9, 10, 11, 12]], [8])  # all reasoning: one weight
    g = lambda: torch.Generator().manual_seed(9)
    masked, t = sample_noise([8], block, (0.2, 0.9), g())
    plain, n = diffusion_loss(model, batch, block, MASK, t_range=(0.2, 0.9), complementary=False, generator=g())
    weighted, _ = diffusion_loss(model, batch, block, MASK, t_range=(0.2, 0.9), complementary=False, generator=g(),
                                 inv_t=True)
    by_block = [diffusion_loss(model, batch, block, MASK, complementary=False,
                               masked=masked & (torch.arange(8) // block == b))[0] for b in range(2)]
    count = [int(masked[0, b * block:(b + 1) * block].sum()) for b in range(2)]
    assert n == sum(count) > 0 and all(count)  # both blocks have targets in this draw
    # a block's targets are conditionally independent of the other block's noise: the sum splits block by block
    assert torch.allclose(plain, sum(c * l for c, l in zip(count, by_block)) / n, atol=1e-5)
    assert torch.allclose(weighted, sum(c * l / t[0, b * block] for b, (c, l) in enumerate(zip(count, by_block))) / n,
                          atol=1e-5)


def test_ar_loss_is_weighted_response_cross_entropy():
    model = tiny()
    p, r = random_prompts(1)[0], [5, 6, 7, 8]
    loss = ar_loss(model, {"prompt_ids": [p], "response_ids": [r], "n_reasoning": [2]}, lam_r=0.5, lam_o=1.0)
    logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1:-1]
    ce = F.cross_entropy(logits, torch.tensor(r), reduction="none")
    w = torch.tensor([0.5, 0.5, 1.0, 1.0])
    assert torch.allclose(loss, (w * ce).sum() / w.sum(), atol=1e-6)


def test_token_kl_leaves_the_mask_token_out_of_both_distributions():
    mask = 2  # a column in the middle: renormalising must not shift the others
    teacher = torch.tensor([[1.0, 2.0, 9.0, 0.5], [0.0, 0.0, -3.0, 1.0], [3.0, -1.0, 0.0, 0.0]])
    student = torch.tensor([[0.5, 2.5, 30.0, 1.0], [2.0, -1.0, 0.0, 0.0], [3.0, -1.0, 50.0, 0.0]])
    keep = [0, 1, 3]
    p, q = teacher[:, keep].softmax(-1), student[:, keep].softmax(-1)
    by_hand = (p * (p / q).log()).sum(-1)
    got = token_kl(teacher, student, mask)
    assert torch.isfinite(got).all() and torch.allclose(got, by_hand, atol=1e-6)
    assert got[2] == 0  # the same distribution once the mask column is gone, however large that column
    assert token_kl(teacher.bfloat16(), student.bfloat16(), mask).dtype == torch.float32


def test_the_mask_token_starts_as_the_mean_of_the_real_rows():
    model = tiny(vocab=VOCAB + 3)  # 3 rows beyond the tokenizer (the 64-multiple padding): not real tokens
    before = model.get_input_embeddings().weight.detach().clone()
    init_mask_embedding(model, MASK, VOCAB)
    after = model.get_input_embeddings().weight.detach()
    others = torch.ones(VOCAB + 3, dtype=torch.bool)
    others[MASK] = False
    assert torch.equal(after[others], before[others])
    real = torch.arange(VOCAB + 3) < VOCAB
    assert torch.allclose(after[MASK], before[others & real].mean(0), atol=1e-7)
