"""
Draft-verify (beyond the paper): exactly the AR model's greedy answer, at diffusion speed.

The block-diffusion model drafts a block with the commit rule of decode.py; the AR model checks the whole
draft in one cached forward and keeps the longest prefix it would have written itself, plus its own next
token; the rest of a rejected draft waits for the next check. The answer is AR's token for token whatever
the draft; the draft only sets how many tokens each AR forward accepts. The README's speed table measures it
beside the paper's decoder, at batch 1 and 16.
"""
import torch

from decode import COMMIT_RULES, CachedModel, Rollout, choose, finished, pick
from model import NOISY, without_mask


@torch.no_grad()
def draft_verify_generate(student, teacher, prompts, block, tau, max_new, mask_id, eos_id, pad_id, commit="threshold"):
    """Exact AR answers at diffusion speed: the block-diffusion student drafts a block at threshold tau, the AR
    teacher checks every row's draft in one cached forward and keeps, per row, the longest prefix equal to its
    own greedy choices, plus its own next token (at the first disagreement, or after the whole draft). Greedy
    only: the tokens equal ar_generate(teacher, ...) token for token, whatever the student; the student only
    sets the speed.

    The batch decodes together, block by block: a row that has finished the block waits for the others. Rows
    accept different counts, and a DynamicCache crops every row alike, so the teacher's cache keeps the prefix
    that is right for every row; a row that accepted more is fed again from there at its next verify.
    Returns a Rollout with tokens, nfe (both models) and per-row counts."""
    if commit not in COMMIT_RULES:
        raise ValueError(f"commit must be one of {COMMIT_RULES}, got {commit!r}")
    B, n_blocks = len(prompts), -(-max_new // block)
    s, t = CachedModel(student, prompts, pad_id), CachedModel(teacher, prompts, pad_id)  # prefill both
    dev = student.device
    n = [{"student": 1, "teacher": 1, "verifies": 0, "corrections": 0} for _ in prompts]
    canvas = torch.full((B, n_blocks * block), mask_id, device=dev)
    acc = [0] * B  # tokens accepted per row
    done = [False] * B  # its end token accepted, or max_new reached
    fed, last = 0, t.edge  # response tokens in the teacher's cache, all rows alike; the logits predicting token `fed`
    ready = None  # [diffusion] a block's first denoising step, computed by the commit forward of the block before
    for b in range(n_blocks):
        lo, hi = b * block, (b + 1) * block
        noisy = s.response_desc(lo, block, block, NOISY)  # [diffusion]
        while True:
            active = [i for i in range(B) if not done[i] and acc[i] < hi]
            if not active:
                break
            is_active = torch.zeros(B, dtype=torch.bool, device=dev)
            is_active[active] = True
            # an AR teacher may emit the mask id itself: only a row's positions from `acc` on are open
            open_ = (torch.arange(lo, hi, device=dev)[None] >= torch.tensor(acc, device=dev)[:, None]) & is_active[:, None]
            while True:  # [diffusion] draft: denoise the open positions, exactly as diffusion_generate does
                masked = (canvas[:, lo:hi] == mask_id) & open_ & ~finished(canvas[:, :hi], mask_id, eos_id)[:, None]
                if not masked.any():
                    break  # nothing after an end token with no mask before it can matter
                if masked[:, 1:].any():
                    if ready is None:
                        ready = s.forward(canvas[:, lo:hi], noisy, keep=False)
                        for i in masked.any(1).nonzero()[:, 0].tolist():
                            n[i]["student"] += 1
                    logits, ready = ready, None
                    pred = torch.cat([s.edge[:, None], logits[:, :-1]], 1)
                else:  # only position 0 is left: the previous block's logit predicts it
                    pred = s.edge[:, None].expand(B, block, -1)
                tok, conf = pick(without_mask(pred, mask_id), 0.0, None)
                chosen = choose(torch.where(masked, conf, -1.0), masked, tau, commit)
                canvas[:, lo:hi] = torch.where(chosen, tok, canvas[:, lo:hi])
                ready = None  # only the block's first step may use it: the canvas has changed since
            ends = {}
            for i in active:  # a row's draft ends at its end token, its block's end or max_new
                draft = canvas[i, acc[i]:hi].tolist()
                ends[i] = min(acc[i] + (draft.index(eos_id) + 1 if eos_id in draft else len(draft)), max_new)
            end = max(ends.values())
            # verify: every row's tokens fed..end in one forward; logit k predicts token fed + k
            logits = t.forward(canvas[:, fed:end].to(teacher.device), t.response_desc(fed, end - fed, 1), keep=True, every=True)
            logits = torch.cat([last[:, None], logits], 1)
            want = pick(logits, 0.0, None)[0].to(dev)  # (B, end - fed + 1): the teacher's greedy tokens
            right = {}  # per row still writing: how far the teacher's cache is right for it after this forward
            for i in [i for i in range(B) if not done[i]]:
                if i not in ends:  # waiting, its block written: what it fed is its own accepted text
                    right[i] = min(acc[i], end)
                    continue
                a, e = acc[i], ends[i]
                n[i]["teacher"], n[i]["verifies"] = n[i]["teacher"] + 1, n[i]["verifies"] + 1
                good = a + int((canvas[i, a:e] == want[i, a - fed:e - fed]).long().cumprod(0).sum())
                # the teacher's own next token comes free: at the first disagreement it replaces the draft's, and
                # after a whole draft it opens the next block (its K/V come with a later verify)
                extra = good < e or (e < max_new and eos_id not in canvas[i, a:e].tolist())
                if extra:
                    canvas[i, good], n[i]["corrections"] = want[i, good - fed], n[i]["corrections"] + (good < e)
                acc[i] = good + extra
                # [diffusion] the rest of a rejected draft stays for the next verify: a wrong token then costs one
                # verify, where drafting again would cost student forwards as well
                done[i] = acc[i] >= max_new or eos_id in canvas[i, :acc[i]].tolist()
                right[i] = good
            new_fed = min([right[i] for i in right if not done[i]] or right.values())  # never below `fed`
            t.crop(t.prompt_ids.shape[1] + new_fed)  # drop every K/V that is wrong for some row
            fed, last = new_fed, logits[:, new_fed - fed]
        if all(done) or b == n_blocks - 1:
            break
        # [diffusion] the commit forward also takes the next block's first denoising step
        s.edge, ready = s.commit_and_draft(canvas[:, lo:hi], lo, canvas[:, hi:hi + block], block)
        for i in range(B):
            if not done[i]:
                n[i]["student"] += 1
    rows = [canvas[i, :acc[i]].tolist() for i in range(B)]
    tokens = [row[:row.index(eos_id) + 1] if eos_id in row else row for row in rows]
    return Rollout(tokens=tokens, nfe=[c["student"] + c["teacher"] for c in n], counts=n)
