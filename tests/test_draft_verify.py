"""Draft-verify decoding (draft_verify.draft_verify_generate): a block-diffusion student drafts, an AR teacher verifies.
Whatever the student, the tokens must equal the teacher's own greedy AR decoding, token for token."""
import copy
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import decode  # noqa: E402
import draft_verify  # noqa: E402
from decode import ar_generate  # noqa: E402
from draft_verify import draft_verify_generate  # noqa: E402
from model import PRESETS, init_mask_embedding  # noqa: E402

VOCAB, MASK, EOS, PAD = 61, 60, 59, 0


def micro(seed, sharpen=1.0):
    """A random-init 'micro' Qwen3 (no download); sharpen scales the LM head (confident drafts, several per step)."""
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, tie_word_embeddings=False, max_position_embeddings=512, pad_token_id=PAD,
                      eos_token_id=EOS, bos_token_id=None, rope_theta=10000.0, **PRESETS["micro"])
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    return model


def prompts_of(n, seed=0, lo=4, hi=11):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, EOS, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def dv(student, teacher, prompts, block, tau, max_new, eos=EOS):
    return draft_verify_generate(student, teacher, prompts, block, tau, max_new, MASK, eos, PAD)


def check_counts(out):
    """Bookkeeping every decode must satisfy: each round accepts at least one token, each model prefills once."""
    for toks, c, nfe in zip(out.tokens, out.counts, out.nfe):
        assert c["teacher"] == 1 + c["verifies"] and nfe == c["student"] + c["teacher"]
        assert 1 <= c["verifies"] <= len(toks) and c["corrections"] <= c["verifies"]


@pytest.mark.parametrize("block,tau,max_new", [(4, 0.9, 13), (4, 0.0, 12), (3, 1.0, 10), (1, 0.5, 6)])
def test_equals_ar_whatever_the_student(block, tau, max_new):
    teacher, student = micro(1, sharpen=4.0), micro(2, sharpen=4.0)  # unrelated weights: most drafts are rejected
    init_mask_embedding(student, MASK, VOCAB)
    prompts = prompts_of(5)
    ar = ar_generate(teacher, prompts, max_new, EOS, PAD)
    for batch in (prompts[:1], prompts):  # one prompt, and left-padded prompts of different lengths
        out = dv(student, teacher, batch, block, tau, max_new)
        assert out.tokens == ar.tokens[:len(batch)]
        check_counts(out)


def test_a_batch_of_16_decodes_together_and_equals_ar():
    """Sixteen rows of different prompt lengths, each accepting its own counts, in one batched decode."""
    teacher, student = micro(1, sharpen=4.0), micro(1, sharpen=4.0)  # the same weights: long accepted drafts
    init_mask_embedding(student, MASK, VOCAB)
    with torch.no_grad():
        student.lm_head.weight.add_(0.5 * torch.randn(student.lm_head.weight.shape, generator=torch.Generator().manual_seed(0)))
    prompts = prompts_of(16, seed=3)
    out = dv(student, teacher, prompts, 4, 0.6, 14)
    assert out.tokens == ar_generate(teacher, prompts, 14, EOS, PAD).tokens
    check_counts(out)
    assert len({c["corrections"] for c in out.counts}) > 1  # the rows really accepted different counts


def test_agreeing_student_has_every_draft_accepted():
    """All-zero logits in both models: every greedy choice is token 0 (argmax takes the first of equal maxima),
    so every draft is the teacher's answer: one verify per block, no corrections."""
    teacher = micro(3)
    with torch.no_grad():
        teacher.model.norm.weight.zero_()  # the final hidden state is 0, so is every logit
    student = copy.deepcopy(teacher)
    ar = ar_generate(teacher, [[5, 6, 7]], 12, EOS, PAD)
    out = dv(student, teacher, [[5, 6, 7]], 4, 0.0, 12)
    assert out.tokens == ar.tokens and len(out.tokens[0]) == 12
    c = out.counts[0]
    # 3 blocks of 4: one verify each, which also accepts the teacher's token opening the next block;
    # student: prefill + the first block's draft step + 2 commit forwards, each with the next block's draft step
    assert (c["verifies"], c["corrections"], c["teacher"], c["student"]) == (3, 0, 4, 4)


def test_a_rejected_draft_is_kept_for_the_next_verify():
    """Both models write token 0 everywhere, but the student drafts token 1 at the third position of every block.
    Per block: a verify keeps 2 tokens and corrects the third; the draft's fourth token waits, unchanged, for the
    next verify, which accepts it. So the corrections cost teacher verifies, never another student forward."""
    teacher = micro(3)
    with torch.no_grad():
        teacher.model.norm.weight.zero_()
    student = copy.deepcopy(teacher)

    def third_position_says_1(module, inputs, logits):
        if logits.dim() == 3:  # a draft step: (1, 4, V), or (1, 8, V) fused with the commit forward before it
            logits = logits.clone()
            logits[:, -3, 1] = 10.0  # the logit at block index 1 predicts block index 2 (token shift)
            return logits

    student.lm_head.register_forward_hook(third_position_says_1)
    out = dv(student, teacher, [[5, 6, 7]], 4, 0.0, 12)
    assert out.tokens == ar_generate(teacher, [[5, 6, 7]], 12, EOS, PAD).tokens == [[0] * 12]
    c = out.counts[0]
    assert (c["verifies"], c["corrections"], c["student"]) == (6, 3, 4)  # student: as if every draft were right


def test_copied_teacher_as_student_at_block_1():
    """The teacher's own weights as a block-1 student draft exactly the teacher's next token: no corrections."""
    teacher = micro(4, sharpen=3.0)
    student = copy.deepcopy(teacher)
    init_mask_embedding(student, MASK, VOCAB)
    prompts = prompts_of(3, seed=1)
    out = dv(student, teacher, prompts, 1, 0.9, 9)
    ar = ar_generate(teacher, prompts, 9, EOS, PAD)
    assert out.tokens == ar.tokens
    for toks, c in zip(out.tokens, out.counts):
        # a verify accepts the drafted token and, free, the teacher's next one: two blocks of 1 per verify
        assert c["corrections"] == 0 and c["verifies"] == (len(toks) + 1) // 2
        assert c["student"] == len(toks)  # prefill + a commit forward after every block but the last


@pytest.mark.parametrize("stop_at", [5, 7, 8])
def test_stops_at_the_end_token_like_ar(stop_at):
    """Make the end token whatever the teacher writes at position stop_at (mid-block, block end, block start)."""
    teacher, student = micro(5, sharpen=4.0), micro(6, sharpen=4.0)
    prompt = [3, 14, 15, 9, 2, 6]
    free = ar_generate(teacher, [prompt], 16, -1, PAD).tokens[0]  # -1: no end token at all
    eos = free[stop_at]
    assert eos != MASK
    ar = ar_generate(teacher, [prompt], 16, eos, PAD).tokens[0]
    assert ar[-1] == eos and len(ar) <= stop_at + 1
    for s in (student, copy.deepcopy(teacher)):  # a rejecting and a mostly accepting student
        init_mask_embedding(s, MASK, VOCAB)
        for tau in (0.9, 0.0):
            out = dv(s, teacher, [prompt, prompt[:3]], 4, tau, 16, eos=eos)
            assert out.tokens[0] == ar
            assert out.tokens[1] == ar_generate(teacher, [prompt[:3]], 16, eos, PAD).tokens[0]


def test_teacher_cache_holds_exactly_the_fed_tokens(monkeypatch):
    """After decoding a batch, the teacher's cache holds the prompts and a prefix of every row's accepted tokens
    (masks after a row's end), and its keys are those of a fresh prefill of exactly that text: never computed
    from a rejected draft."""
    made = []

    class Recorded(decode.CachedModel):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(draft_verify, "CachedModel", Recorded)
    teacher, student = micro(7, sharpen=4.0), micro(8, sharpen=4.0)
    prompts = prompts_of(4, seed=2)
    out = dv(student, teacher, prompts, 4, 0.5, 11)
    assert out.tokens == ar_generate(teacher, prompts, 11, EOS, PAD).tokens
    t = made[1]  # the batch decodes together: (student, teacher)
    assert t.model is teacher and len(made) == 2
    cached = t.cache.get_seq_length()
    assert cached == t.keys[0].shape[1]  # the mask descriptors follow the cache
    fed = cached - max(map(len, prompts))
    assert 0 < fed <= max(map(len, out.tokens))
    # a row that ended before `fed` was fed masks after its end (its canvas), never a draft it rejected
    fresh = Recorded(teacher, [p + (toks + [MASK] * fed)[:fed] for p, toks in zip(prompts, out.tokens)], PAD)
    real = max(map(len, prompts)) - torch.tensor([len(p) for p in prompts])  # pad columns differ: compare the rest
    for layer, ref in zip(t.cache.layers, fresh.cache.layers):
        for i, r in enumerate(real.tolist()):
            assert torch.allclose(layer.keys[i, :, r:], ref.keys[i, :, r:], atol=1e-5)
