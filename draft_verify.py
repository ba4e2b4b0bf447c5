"""
Draft-verify (beyond the paper): exactly the AR model's greedy answer, at diffusion speed.

The block-diffusion model drafts a block with the commit rule of decode.py; the AR model checks the whole
draft in one cached forward and keeps the longest prefix it would have written itself, plus its own token
where they first disagree. The answer is AR's token for token whatever the draft; the draft only sets how
many tokens each AR forward accepts. The README's speed table measures it beside the paper's decoder.
"""
import torch

from decode import COMMIT_RULES, CachedModel, Rollout, choose, finished, pick
from model import NOISY, without_mask


@torch.no_grad()
def draft_verify_generate(student, teacher, prompts, block, tau, max_new, mask_id, eos_id, pad_id, commit="threshold"):
    """Exact AR answers at diffusion speed (beyond the paper): the block-diffusion student drafts a block at
    threshold tau, the AR teacher checks the draft in one cached forward and keeps the longest prefix equal to
    its own greedy choices, plus its own token at the first disagreement. Greedy only: the tokens equal
    ar_generate(teacher, ...) token for token, whatever the student; the student only sets the speed.

    Rows run one at a time (the API stays batched): each row accepts its own count, and a DynamicCache crops
    every row by the same amount. Returns a Rollout with tokens, nfe (both models) and per-row counts."""
    if commit not in COMMIT_RULES:
        raise ValueError(f"commit must be one of {COMMIT_RULES}, got {commit!r}")
    out = Rollout(tokens=[], nfe=[], counts=[])
    for prompt in prompts:
        s, t = CachedModel(student, [prompt], pad_id), CachedModel(teacher, [prompt], pad_id)  # prefill both
        n = {"student": 1, "teacher": 1, "verifies": 0, "corrections": 0}
        canvas = torch.full((1, -(-max_new // block) * block), mask_id, device=student.device)
        acc, fed, last = 0, 0, t.edge  # accepted tokens; those in the teacher's cache; the logit predicting token `fed`
        while acc < max_new and eos_id not in canvas[0, :acc].tolist():
            lo, hi = acc // block * block, acc // block * block + block  # blocks stay aligned at multiples of B
            noisy = s.response_desc(lo, block, block, NOISY)  # [diffusion]
            open_ = torch.arange(lo, hi, device=canvas.device)[None] >= acc  # an AR teacher may emit the mask id itself
            while True:  # [diffusion] draft: denoise the undecided positions, exactly as diffusion_generate does
                masked = (canvas[:, lo:hi] == mask_id) & open_
                if not masked.any() or finished(canvas[:, :hi], mask_id, eos_id).item():
                    break  # nothing after an end token with no mask before it can matter
                if masked[:, 1:].any():
                    logits = s.forward(canvas[:, lo:hi], noisy, keep=False)
                    pred, n["student"] = torch.cat([s.edge[:, None], logits[:, :-1]], 1), n["student"] + 1
                else:  # only position 0 is left: the previous block's logit predicts it
                    pred = s.edge[:, None].expand(1, block, -1)
                tok, conf = pick(without_mask(pred, mask_id), 0.0, None)
                chosen = choose(torch.where(masked, conf, -1.0), masked, tau, commit)
                canvas[:, lo:hi] = torch.where(chosen, tok, canvas[:, lo:hi])
            draft = canvas[0, acc:hi].tolist()
            end = min(acc + (draft.index(eos_id) + 1 if eos_id in draft else len(draft)), max_new)
            # verify: feed the accepted-but-unfed token (if any) and the draft; logit i predicts token fed + i
            logits = t.forward(canvas[:, fed:end].to(teacher.device), t.response_desc(fed, end - fed, 1), keep=True, every=True)
            n["teacher"], n["verifies"] = n["teacher"] + 1, n["verifies"] + 1
            logits = torch.cat([last[:, None], logits], 1)
            want = pick(logits, 0.0, None)[0][0].to(canvas.device)  # the teacher's greedy tokens for fed..end
            agree = (canvas[0, acc:end] == want[acc - fed:end - fed]).long().cumprod(0)
            good = acc + int(agree.sum())  # the draft up to here is what the teacher itself would have written
            if good < end:  # first disagreement: the teacher's token instead; its K/V come with the next verify
                canvas[0, good], n["corrections"] = want[good - fed], n["corrections"] + 1
                t.crop(t.prompt_ids.shape[1] + good)  # drop the K/V of the rejected draft tokens
            fed, last = good, logits[:, good - fed]
            acc = good + (good < end)
            canvas[0, acc:hi] = mask_id  # [diffusion] rejected draft positions are drafted again
            if acc == hi and acc < max_new and eos_id not in canvas[0, lo:hi].tolist():  # [diffusion] commit forward
                s.edge, n["student"] = s.forward(canvas[:, lo:hi], s.response_desc(lo, block, block), keep=True), n["student"] + 1
        row = canvas[0, :acc].tolist()
        out.tokens.append(row[:row.index(eos_id) + 1] if eos_id in row else row)
        out.nfe.append(n["student"] + n["teacher"])
        out.counts.append(n)
    return out
