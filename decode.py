"""
Decoding: KV-cached AR and block-diffusion decoding, the step map and its replay, a stage's final
test, a speed benchmark, and a terminal viewer of parallel denoising.

Block diffusion (METHOD.md section 5). The prompt is prefilled into a KV cache. The response is made
block by block, left to right. A block starts as B mask tokens; each denoising step is one forward of
the block against the cache (the cache is cropped back afterwards, so it never grows while a block is
being denoised), then for every masked position, with token shift,

    p_j = softmax(logit at j-1)            (j = 0 uses the logit that closed the previous block)
    commit j  if  max p_j >= tau,   and always the single most confident masked position

A committed token is never re-masked. tau = 1.0 commits exactly one token per forward (a float32
softmax can return exactly 1.0, so it is a special case, not a `>=` test). That is the paper's rule
("threshold"). Beyond the paper, `--commit left-to-right` commits from the leftmost mask rightwards
while the product of the committed confidences stays >= tau (`choose` below; the README measures
both side by side). When the block has no masks left it is run once more, as finished tokens, to
write its K/V into the cache (the commit forward); its last logit predicts the next block's first
token. A row stops as soon as its end token is committed with every position before it filled;
tokens after the end token are dropped. Batched: left-padded prompts, each row commits its own positions.

Beyond the paper, `draft_verify_generate` gives exactly the AR model's greedy answer at diffusion speed:
the diffusion model drafts a block, the AR model checks the whole draft in one forward and keeps the
longest prefix it would have written itself, plus its own token where they first disagree.

The *step map* records, for every generated token, the step of its block at which it was committed.
`replay_rows` turns a trajectory back into the canvases it was decoded from, in the noisy+clean
training layout of model.py; `replay_chunks` scores every token from the canvas it was committed from,
a bounded number of canvases at a time, two to a row. OPD and RL train through exactly these two functions.

    python decode.py --show --ckpt out/rl --data data/synthetic              # watch one example denoise
    python decode.py --bench --ar out/sft --diffusion out/rl --data data/synthetic --json out/bench.json
"""
import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

import eval as metrics
from model import (CLEAN, NOISY, PAD, PROMPT, attention_mask, build_rows, for_attention, gather_logits, hidden_states,
                   target_sources, without_mask)
from plumbing import HelpFormatter, add_runtime_args, compute, load_checkpoint, read_jsonl, resolve_dtype, write_atomic

COMMIT_RULES = ("threshold", "left-to-right")  # [diffusion] which confident positions a step commits (`choose`)
SPEED_TAUS = (0.9, 0.6, 0.4)  # the paper's speed settings (the speed table; a stage's test adds --taus to tau = 1.0)


@dataclass
class Rollout:
    """What a decoder produced for a batch of prompts (lists, one entry per row)."""
    tokens: list                  # response ids up to and including the end token
    canvas: list = None           # [diffusion] every decoded position (mask id where never committed)
    steps: list = None            # [diffusion] step of its block at which each canvas position was committed (-1: never)
    nfe: list = field(default_factory=list)  # forward passes each row took part in (prefill included)
    counts: list = None           # draft-verify, per row: {"student", "teacher": forwards, "verifies", "corrections": rounds}

    def select(self, idx):
        """The rollouts at positions idx (for chunked backward passes)."""
        pick = lambda xs: None if xs is None else [xs[i] for i in idx]
        return Rollout(pick(self.tokens), pick(self.canvas), pick(self.steps), pick(self.nfe), pick(self.counts))


def left_pad(prompts, pad_id):
    """Prompts right-aligned in a (B, P) tensor, so every row's response starts at the same column."""
    P = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (P - len(p)) + list(p) for p in prompts])
    seg = torch.tensor([[PAD] * (P - len(p)) + [PROMPT] * len(p) for p in prompts])
    pos = torch.tensor([[0] * (P - len(p)) + list(range(len(p))) for p in prompts])
    return ids, (seg, torch.full_like(seg, -1), pos), torch.tensor([len(p) for p in prompts])


class CachedModel:
    """A model, its DynamicCache, and the descriptors of what the cache holds (to build each mask)."""

    def __init__(self, model, prompts, pad_id):
        self.model, self.cache, dev = model, DynamicCache(config=model.config), model.device
        ids, desc, lengths = left_pad(prompts, pad_id)
        self.prompt_ids, self.prompt_desc, self.prompt_len = ids.to(dev), tuple(t.to(dev) for t in desc), lengths.to(dev)
        self.keys = tuple(t[:, :0] for t in self.prompt_desc)
        self.edge = self.forward(self.prompt_ids, self.prompt_desc, keep=True)  # predicts response token 0

    def forward(self, ids, desc, keep, every=False):
        """keep=False: logits (B, n, V) at the n positions of `ids`, the cache cropped back afterwards. keep=True:
        they join the cache and only the last logits (B, V) come back (a prefill's P x V would be wasted), or
        all n of them with every=True (a draft-verify round reads each one)."""
        keys = tuple(torch.cat([a, b], 1) for a, b in zip(self.keys, desc))
        mask = attention_mask(desc, keys)
        with compute(self.model):
            h = self.model.model(input_ids=ids, attention_mask=for_attention(mask, self.model), position_ids=desc[2],
                                 cache=self.cache, use_cache=True).last_hidden_state
            logits = self.model.lm_head(h[:, -1] if keep and not every else h).float()
        if keep:
            self.keys = keys
        else:
            self.cache.crop(-ids.shape[1])  # [diffusion] a denoising step only reads the cache
        return logits

    def crop(self, length):
        """Keep only the first `length` cached positions (prompt included): drops a rejected draft's K/V."""
        self.cache.crop(length - self.keys[0].shape[1])  # transformers 5 crops by a negative count
        self.keys = tuple(t[:, :length] for t in self.keys)

    def response_desc(self, start, n, block, seg=CLEAN):  # [diffusion] seg=NOISY: the block being denoised
        """Descriptors of response positions start..start+n-1: finished (CLEAN) or being denoised (NOISY)."""
        r = torch.arange(start, start + n, device=self.prompt_len.device)
        B = len(self.prompt_len)
        return (torch.full((B, n), seg, device=r.device), (r // block).expand(B, n), self.prompt_len[:, None] + r[None])

    def recompute(self, response, block):
        """No cache: logits predicting response tokens 0..n-1 (token shift), from one full forward."""
        ids = torch.cat([self.prompt_ids, response], 1)
        desc = tuple(torch.cat([a, b], 1) for a, b in zip(self.prompt_desc, self.response_desc(0, response.shape[1], block)))
        desc[0][:, -block:] = NOISY  # [diffusion] the last block is the one being denoised
        mask = for_attention(attention_mask(desc, desc), self.model)
        P = self.prompt_ids.shape[1]
        with compute(self.model):
            h = self.model.model(input_ids=ids, attention_mask=mask, position_ids=desc[2]).last_hidden_state
            return self.model.lm_head(h[:, P - 1:-1]).float()


def pick(logits, temperature, generator):
    """(token, confidence) per position: argmax, or a sample at `temperature` with its probability."""
    probs = torch.softmax(logits / temperature if temperature > 0 else logits, -1)
    tok = (torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator).reshape(probs.shape[:-1])
           if temperature > 0 else probs.argmax(-1))
    return tok, probs.gather(-1, tok[..., None])[..., 0]


@torch.no_grad()
def ar_generate(model, prompts, max_new, eos_id, pad_id, temperature=0.0, generator=None):
    """Plain AR decoding with a KV cache: one token per forward."""
    state = CachedModel(model, prompts, pad_id)
    out, done, nfe = [[] for _ in prompts], torch.zeros(len(prompts), dtype=torch.bool, device=model.device), [1] * len(prompts)
    logits = state.edge
    for r in range(max_new):
        tok, _ = pick(logits, temperature, generator)
        for i in (~done).nonzero()[:, 0].tolist():
            out[i].append(tok[i].item())
        done |= tok == eos_id
        if done.all() or r == max_new - 1:
            break
        for i in (~done).nonzero()[:, 0].tolist():
            nfe[i] += 1
        logits = state.forward(tok[:, None], state.response_desc(r, 1, 1), keep=True)
    return Rollout(tokens=out, nfe=nfe)


@torch.no_grad()
def diffusion_generate(model, prompts, block, tau, max_new, mask_id, eos_id, pad_id, temperature=0.0,
                       generator=None, use_cache=True, on_step=None, commit="threshold"):  # [diffusion]
    """Block-diffusion decoding (module docstring). Returns a Rollout with canvas, step map and NFE.

    use_cache=False recomputes the whole sequence at every step (the reference the cache must match).
    commit picks which confident positions a step commits (`choose`).
    on_step(block, step, canvas, committed, logits) is called after every step (viewer, tests).
    """
    if commit not in COMMIT_RULES:
        raise ValueError(f"commit must be one of {COMMIT_RULES}, got {commit!r}")
    B, n_blocks = len(prompts), -(-max_new // block)
    state = CachedModel(model, prompts, pad_id)
    dev = model.device  # the decoding state lives where the model does
    canvas = torch.full((B, n_blocks * block), mask_id, device=dev)
    steps = torch.full((B, n_blocks * block), -1, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    nfe = torch.ones(B, dtype=torch.long, device=dev)
    for b in range(n_blocks):
        lo, hi = b * block, (b + 1) * block
        desc, noisy = state.response_desc(lo, block, block), state.response_desc(lo, block, block, NOISY)  # [diffusion]
        for s in range(block):
            masked = (canvas[:, lo:hi] == mask_id) & ~done[:, None]
            if not masked.any():
                break
            if not use_cache:
                pred = state.recompute(canvas[:, :hi], block)[:, lo:hi]
                nfe += masked.any(1)
            elif masked[:, 1:].any():  # positions j >= 1 need a forward; j = 0 reads the previous block's logit
                logits = state.forward(canvas[:, lo:hi], noisy, keep=False)
                pred = torch.cat([state.edge[:, None], logits[:, :-1]], 1)  # token shift
                nfe += masked.any(1)
            else:  # only position 0 is left (always so with block 1): no forward needed
                pred = state.edge[:, None].expand(B, block, -1).clone()
            tok, conf = pick(without_mask(pred, mask_id), temperature, generator)  # never emit the mask token
            chosen = choose(torch.where(masked, conf, -1.0), masked, tau, commit)
            canvas[:, lo:hi] = torch.where(chosen, tok, canvas[:, lo:hi])
            steps[:, lo:hi] = torch.where(chosen, s, steps[:, lo:hi])
            done |= finished(canvas[:, :hi], mask_id, eos_id)
            if on_step:
                on_step(b, s, canvas[:, :hi], chosen, pred)
        if done.all() or b == n_blocks - 1:
            break
        if use_cache:
            nfe += ~done
            state.edge = state.forward(canvas[:, lo:hi], desc, keep=True)  # the commit forward
    rows = canvas.tolist()
    tokens = [row[:row.index(eos_id) + 1 if eos_id in row else len(row)] for row in rows]  # up to the end token
    return Rollout(tokens=tokens, canvas=rows, steps=steps.tolist(), nfe=nfe.tolist())


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


def choose(conf, masked, tau, commit):  # [diffusion]
    """Which masked positions one step commits: (B, block) bool. conf (B, block) is each position's
    confidence, -1 where it is not masked. Both rules commit at least one position per row with masks.

    threshold:      every position >= tau, and at least the most confident one (the paper, METHOD.md 5)
    left-to-right:  from the leftmost mask rightwards while the product of the committed confidences
                    stays >= tau, and at least the leftmost mask (beyond the paper)
    The product bounds the chance that a step commits a wrong token (at most 1 - tau if the positions were
    independent), so a step cannot commit ten tokens at 0.95 each that depend on one another.
    """
    if tau >= 1.0:  # one token per step (a float32 softmax can round to exactly 1.0: not a >= test)
        chosen = torch.zeros_like(masked)
    elif commit == "threshold":
        chosen = conf >= tau
    else:  # the committed tokens are a prefix of the block, so the masks from the leftmost one on are a suffix
        log_conf = torch.where(masked, conf.clamp_min(1e-30).log(), 0.0)
        chosen = log_conf.cumsum(1) >= (math.log(tau) if tau > 0 else -math.inf)
    first = conf.argmax(1) if commit == "threshold" else masked.float().argmax(1)
    chosen = chosen & masked
    chosen[torch.arange(conf.shape[0], device=conf.device), first] |= masked.any(1)
    return chosen


def finished(canvas, mask_id, eos_id):
    """Rows whose first end token is committed and every position before it is filled."""
    is_eos = canvas == eos_id
    first = torch.where(is_eos.any(1), is_eos.float().argmax(1), canvas.shape[1])
    before = torch.arange(canvas.shape[1], device=canvas.device)[None] < first[:, None]
    return is_eos.any(1) & ~((canvas == mask_id) & before).any(1)


# ----------------------------------------------------------------------------- replay (OPD and RL)
def replay_rows(canvas, steps, mask_id):  # [diffusion]
    """The canvases a trajectory (response canvas, step map) was decoded from, several blocks per row.

    In the noisy+clean layout a noisy block sees only itself and the clean blocks before it, so row s
    can carry the step-s canvas of *every* block at once: position r shows its token if it was committed
    before step s (steps[r] < s), else the mask. Returns (noisy canvases, one per step s; for each row the
    response positions committed at that step).
    """
    n_steps = max(steps) + 1
    noisy, targets = [], []
    for s in range(n_steps):
        noisy.append([tok if 0 <= st < s else mask_id for tok, st in zip(canvas, steps)])
        targets.append([r for r, st in enumerate(steps) if st == s])
    return noisy, targets


def replay_chunks(model, prompts, canvases, steps, block, mask_id, keep, pad_id=0, max_rows=64, pack=2):  # [diffusion]
    """The policy's logits (model.without_mask) of every kept token from the canvas it was committed from.

    keep[i]: how many leading response positions of trajectory i to score (up to its end token). Yields
    (logits (n, V), the (trajectory, position) of each logits row) per chunk: a caller that trains calls
    backward on each chunk's loss as it comes, so only max_rows canvases' activations are alive at once.
    Up to `pack` canvases of one trajectory share a row [prompt | canvas | canvas' | response] (model.py's
    noisy copies): the same logits, with the prompt and response computed once per row, not per canvas."""
    pack = min(pack, max_rows)
    packs = []  # (trajectory, up to `pack` of its (canvas, positions committed from it))
    for i, (c, st) in enumerate(zip(canvases, steps)):
        noisy, targets = replay_rows(c, st, mask_id)
        scored = [(row, tg) for row, tg in zip(noisy, ([r for r in t if r < keep[i]] for t in targets)) if tg]
        packs += [(i, scored[k:k + pack]) for k in range(0, len(scored), pack)]
    per_chunk = max_rows // pack
    for chunk in (packs[s:s + per_chunk] for s in range(0, len(packs), per_chunk)):
        n_copies = max(len(cs) for _, cs in chunk)  # a shorter pack repeats its last canvas, scoring nothing from it
        noisy = [[cs[min(c, len(cs) - 1)][0] for _, cs in chunk] for c in range(n_copies)]
        responses = [canvases[i] for i, _ in chunk]
        rows = build_rows([prompts[i] for i, _ in chunk], responses, block, noisy=noisy, pad_id=pad_id)
        src = torch.stack([target_sources(rows, [len(r) for r in responses], block, copy=c)[0] for c in range(n_copies)])
        # canvas by canvas (copy c of row k, position r): the order does not depend on pack or max_rows
        c, k, r = torch.tensor([(c, k, r) for k, (_, cs) in enumerate(chunk) for c, (_, tg) in enumerate(cs) for r in tg]).T
        order = [(i, r) for i, cs in chunk for _, tg in cs for r in tg]
        yield without_mask(gather_logits(model, hidden_states(model, rows), (k, src[c, k, r])), mask_id), order


# ----------------------------------------------------------------------------- decode and score a split
def generate(model, tok, prompts, mode, block=32, tau=1.0, max_new=256, batch_size=32, temperature=0.0,
             generator=None, progress=False, commit="threshold", teacher=None):
    """Decode `prompts` in length-sorted batches; returns a Rollout in the input order and the seconds taken.
    mode: "ar", "diffusion", or "draft-verify" (`model` drafts, the AR `teacher` verifies; greedy only)."""
    from tqdm import tqdm
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    synchronize(model.device)
    parts, t0 = {}, time.perf_counter()
    batches = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
    for idx in tqdm(batches, desc=f"decode {mode}" + (f" tau={tau}" if mode != "ar" else ""),
                    disable=not progress, leave=False):
        batch = [prompts[i] for i in idx]
        if mode == "ar":
            out = ar_generate(model, batch, max_new, tok.eos_token_id, tok.pad_token_id, temperature, generator)
        elif mode == "draft-verify":
            out = draft_verify_generate(model, teacher, batch, block, tau, max_new, tok.mask_token_id, tok.eos_token_id,
                                        tok.pad_token_id, commit)
        else:
            out = diffusion_generate(model, batch, block, tau, max_new, tok.mask_token_id, tok.eos_token_id,
                                     tok.pad_token_id, temperature, generator, commit=commit)
        for k, i in enumerate(idx):
            parts[i] = (out.tokens[k], out.canvas[k] if out.canvas else None, out.steps[k] if out.steps else None, out.nfe[k],
                        out.counts[k] if out.counts else None)
    synchronize(model.device)
    seconds = time.perf_counter() - t0
    return Rollout(*map(list, zip(*[parts[i] for i in range(len(prompts))]))), seconds  # fields in Rollout's order


@torch.no_grad()
def evaluate(model, tok, examples, sid, mode, block=32, tau=1.0, max_new=256, batch_size=32, progress=False,
             commit="threshold", teacher=None):
    """Decode `examples` greedily and score them: (summary dict, per-example rows, texts, rollout)."""
    model.eval()
    out, seconds = generate(model, tok, [ex["prompt_ids"] for ex in examples], mode, block, tau, max_new,
                            batch_size, progress=progress, commit=commit, teacher=teacher)
    texts = [tok.decode(t, skip_special_tokens=False) for t in out.tokens]
    rows = metrics.score_responses(texts, examples, sid)
    summary = metrics.summarize(rows)
    n_tok = sum(len(t) for t in out.tokens)
    summary.update(tokens_per_forward=n_tok / max(1, sum(out.nfe)), tokens_per_s=n_tok / max(seconds, 1e-9),
                   seconds=seconds, mean_length=n_tok / max(1, len(examples)))
    return summary, rows, texts, out


def validate(model, tok, valid, sid, mode, block, max_new, batch):
    """The training-time check: valid rate and Recall@1 of greedy decoding (and, for diffusion, at tau = 0.9).
    Returns the numbers (with the seconds they took: test_stage splits a stage's time by them) and the
    tau = 1.0 / AR responses (rl.py scores its held-out reward on them)."""
    t0 = time.perf_counter()
    q, _, texts, _ = evaluate(model, tok, valid, sid, mode, block, 1.0, max_new, batch, progress=True)
    res = {"val_valid_rate": q["valid_rate"], "val_recall1": q["recall@1"]}
    if mode == "diffusion":
        f, *_ = evaluate(model, tok, valid, sid, mode, block, 0.9, max_new, batch, progress=True)
        res.update({"val_valid_rate_0.9": f["valid_rate"], "val_recall1_0.9": f["recall@1"],
                    "val_tokens_per_forward_0.9": f["tokens_per_forward"]})
    res["val_seconds"] = time.perf_counter() - t0
    return res, texts


def write_predictions(path, examples, sid_of, texts, rows, roll):
    """OUT/predictions*.jsonl: everything needed to recompute the metrics and study the errors."""
    lines = []
    for k, (ex, text, row) in enumerate(zip(examples, texts, rows)):
        lines.append(json.dumps({"id": ex["id"], "candidates": [sid_of[i] for i in ex["candidates"]],
                                 "target": sid_of[ex["target"]], "response": text, "parsed": row["parsed"],
                                 "validity": row["validity"], "n_tokens": len(roll.tokens[k]), "nfe": roll.nfe[k]}) + "\n")
    write_atomic(path, "".join(lines))


def test_stage(out, model, tok, examples, sid_of, mode, block=32, max_new=256, batch_size=64, tau_n=0, extra=None,
               taus=(0.9,), train_minutes=None, test_since=None):
    """A stage's final test: greedy (AR) or tau = 1.0, plus (diffusion) each of `taus` on the first tau_n examples
    (0 = all). Writes OUT/predictions*.jsonl and then OUT/metrics.json (with `extra` merged in), which marks the
    stage finished, and prints the table. train_minutes: the stage's wall time before the test, which metrics.json
    splits into training and validation (the `val_seconds` of OUT/log.jsonl) beside the test's own minutes, counted
    from now or from `test_since` (a time.time() taken where the stage's test began before this call)."""
    t0 = test_since or time.time()
    quality, rows, texts, roll = evaluate(model, tok, examples, sid_of, mode, block, 1.0, max_new, batch_size, True)
    write_predictions(Path(out) / "predictions.jsonl", examples, sid_of, texts, rows, roll)
    sub, by_tau = examples[:tau_n] if tau_n else examples, {}
    for t in (taus if mode == "diffusion" else ()):  # each threshold keeps its predictions: the report pairs them
        by_tau[t], rows, texts, roll = evaluate(model, tok, sub, sid_of, mode, block, t, max_new, batch_size, True)
        write_predictions(Path(out) / f"predictions_tau{t}.jsonl", sub, sid_of, texts, rows, roll)
    result = {**metrics.stage_metrics(quality, examples, by_tau), **(extra or {})}
    if train_minutes is not None:
        log = Path(out) / "log.jsonl"
        val = sum(r.get("val_seconds", 0.0) for r in read_jsonl(log)) / 60 if log.exists() else 0.0
        result["minutes"] = {"train": max(0.0, train_minutes - val), "validation": val,
                             "test": (time.time() - t0) / 60}
    write_atomic(Path(out) / "metrics.json", json.dumps(result, indent=2))
    print(f"test (n={result['n']})   R@1     R@3     NDCG@3  valid   tok/fwd")
    print(f"  retriever floor   {result['floor']['recall@1']:.4f}  {result['floor']['recall@3']:.4f}  {result['floor']['ndcg@3']:.4f}")
    for label, m in [("AR greedy" if mode == "ar" else "tau=1.0", quality)] + [(f"tau={t}", m) for t, m in by_tau.items()]:
        print(f"  {label:<16}  {m['recall@1']:.4f}  {m['recall@3']:.4f}  {m['ndcg@3']:.4f}  {m['valid_rate']:.3f}  "
              f"{m['tokens_per_forward']:.2f}")
    if "minutes" in result:
        print("minutes: " + ", ".join(f"{k} {v:.1f}" for k, v in result["minutes"].items()))
    return result


# ----------------------------------------------------------------------------- benchmark
def synchronize(device):
    """A GPU runs kernels asynchronously: wait for them before reading a clock (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def forward_seconds(model, prompts, sizes, repeats=20):
    """{n: seconds of one forward of n new tokens per row} against the same cached prompts, for n in `sizes`."""
    state, times = CachedModel(model, prompts, 0), {}
    for n in list(sizes) * 2:  # alternate, keep the second round (warm)
        desc = state.response_desc(0, n, n)
        ids = torch.zeros(len(prompts), n, dtype=torch.long, device=model.device)
        synchronize(model.device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            state.forward(ids, desc, keep=False)
        synchronize(model.device)
        times[n] = (time.perf_counter() - t0) / repeats
    return times


def bench(ar_model, diff_model, tok, examples, sid, taus, batch_sizes, block, max_new, commits=("threshold",), log=print,
          draft_verify=True):
    """Decode the same prompts with AR, with block diffusion at each (commit rule, tau) and (draft_verify) with the
    diffusion model drafting for the AR model at each tau, interleaved chunk by chunk so that every decoder sees the
    same machine load. Returns the rows of the speed table."""
    configs = [("ar", None, None)] + [("diffusion", c, t) for c in commits for t in taus]
    configs += [("draft-verify", "threshold", t) for t in taus] if draft_verify else []  # exact AR answers, faster
    run = lambda c, prompts, bs: generate(ar_model if c[0] == "ar" else diff_model, tok, prompts, c[0], block,
                                          c[2] or 1.0, max_new, bs, commit=c[1] or "threshold", teacher=ar_model)
    for c in configs:  # one untimed decode each: one-off costs (CUDA start-up, kernel choice) would land on AR, run first
        run(c, [examples[0]["prompt_ids"]], 1)
    rows = []
    for bs in batch_sizes:
        acc = {c: {"tokens": 0, "nfe": 0, "seconds": 0.0, "texts": [], "ids": [], "counts": []} for c in configs}
        chunks = range(0, len(examples), bs)
        from tqdm import tqdm
        for s in tqdm(chunks, desc=f"bench batch {bs}", leave=False):
            prompts = [ex["prompt_ids"] for ex in examples[s:s + bs]]
            for c in configs:  # interleaved: AR, then every decoder, on this chunk
                (out, sec), a = run(c, prompts, bs), acc[c]
                a["tokens"] += sum(map(len, out.tokens)); a["nfe"] += sum(out.nfe); a["seconds"] += sec
                a["texts"] += [tok.decode(t) for t in out.tokens]; a["ids"] += out.tokens; a["counts"] += out.counts or []
        ar_speed = acc[configs[0]]["tokens"] / acc[configs[0]]["seconds"]
        for c in configs:
            a, q = acc[c], metrics.summarize(metrics.score_responses(acc[c]["texts"], examples, sid))
            rows.append({"decoder": c[0], "commit": c[1], "tau": c[2], "block": None if c[0] == "ar" else block,
                         "batch": bs, "n": len(examples), "tokens_per_s": a["tokens"] / a["seconds"],
                         "tokens_per_forward": a["tokens"] / a["nfe"], "speedup": a["tokens"] / a["seconds"] / ar_speed,
                         "valid_rate": q["valid_rate"], "recall@1": q["recall@1"], "ndcg@3": q["ndcg@3"],
                         "mean_length": a["tokens"] / len(examples)})
            if c[0] == "draft-verify":  # exact by construction: same_as_ar checks it (float ties aside)
                k = {key: sum(n[key] for n in a["counts"]) for key in ("student", "teacher", "verifies")}
                rows[-1].update(same_as_ar=sum(x == y for x, y in zip(a["ids"], acc[configs[0]]["ids"])) / len(examples),
                                tokens_per_verify=a["tokens"] / max(1, k["verifies"]), student_forwards=k["student"],
                                teacher_forwards=k["teacher"])
            log(format_row(rows[-1]))
    return rows


def bench_checkpoints(ar_path, diff_path, examples, sid, taus, batch_sizes, device="cpu", commits=COMMIT_RULES,
                      attn="sdpa", dtype="float32"):
    """Load an AR and a block-diffusion checkpoint in the same dtype and `bench` them on `examples`.
    Returns (rows, cost of one block forward over a 1-token AR step at batch 1)."""
    ar_model, tok, _ = load_checkpoint(ar_path, attn, dtype, diffusion=False)
    diff_model, _, stage = load_checkpoint(diff_path, attn, dtype, tok, diffusion=True)
    ar_model, diff_model = ar_model.to(device).eval(), diff_model.to(device).eval()
    block = stage["block_size"]
    seconds = forward_seconds(diff_model, [examples[0]["prompt_ids"]], (1, block))
    ratio = seconds[block] / seconds[1]
    print(f"speed ({dtype}): {diff_path} against {ar_path}; a {block}-token block forward costs {ratio:.2f}x a 1-token step")
    return bench(ar_model, diff_model, tok, examples, sid, taus, batch_sizes, block, stage["max_new"], commits), ratio


def format_row(r):
    name = "AR" if r["decoder"] == "ar" else f"{r['decoder']} B={r['block']} {r['commit']} tau={r['tau']}"
    extra = (f" | same as AR {r['same_as_ar']:.3f} | {r['tokens_per_verify']:.2f} tok/verify | forwards student "
             f"{r['student_forwards']} teacher {r['teacher_forwards']}" if r["decoder"] == "draft-verify" else "")
    return (f"{name:<40} batch {r['batch']:>3} | {r['tokens_per_s']:8.1f} tok/s | {r['tokens_per_forward']:5.2f} tok/fwd | "
            f"speed-up {r['speedup']:5.2f}x | valid {r['valid_rate']:.3f} | R@1 {r['recall@1']:.3f}" + extra)


# ----------------------------------------------------------------------------- viewer
def show(model, tok, example, block, tau, max_new, commit="threshold"):
    """Print one example being denoised: masks as '·', new commits highlighted, steps per block."""
    tty = sys.stdout.isatty()
    new = (lambda w: f"\033[1;32m{w}\033[0m") if tty else (lambda w: f"*{w}*")
    print(tok.decode(example["prompt_ids"]), "\n")
    per_block = {}

    def on_step(b, s, canvas, committed, logits):  # committed: (1, block) bool, the positions this step wrote
        lo = b * block
        ids = canvas[0, lo:].tolist()
        shown = [("·" if t == tok.mask_token_id else (new(w) if committed[0, j] else w))
                 for j, (t, w) in enumerate(zip(ids, tok.convert_ids_to_tokens(ids)))]
        print(f"block {b} step {s:2d} +{int(committed[0].sum())}: " + " ".join(shown))
        per_block[b] = s + 1

    out = diffusion_generate(model, [example["prompt_ids"]], block, tau, max_new, tok.mask_token_id, tok.eos_token_id,
                             tok.pad_token_id, on_step=on_step, commit=commit)
    n = len(out.tokens[0])
    print(f"\n{n} tokens in {out.nfe[0]} forwards ({n / out.nfe[0]:.2f} tokens per forward); "
          f"steps per block: {[per_block[b] for b in sorted(per_block)]}")
    print("\n" + tok.decode(out.tokens[0]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--bench", action="store_true", help="time AR against block diffusion and draft-verify on test prompts")
    ap.add_argument("--show", action="store_true", help="print one example being denoised step by step")
    ap.add_argument("--ar", default="out/sft", help="AR checkpoint (bench)")
    ap.add_argument("--diffusion", default="out/rl", help="block-diffusion checkpoint (bench)")
    ap.add_argument("--ckpt", default="out/rl", help="block-diffusion checkpoint (show)")
    ap.add_argument("--data", default="data/synthetic", help="folder written by data.py")
    ap.add_argument("--n", type=int, default=64, help="test examples to decode (bench)")
    ap.add_argument("--index", type=int, default=0, help="which test example to show")
    ap.add_argument("--taus", type=float, nargs="+", default=[1.0, *SPEED_TAUS], help="commit thresholds (bench)")
    ap.add_argument("--tau", type=float, default=0.9, help="commit threshold (show)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16], help="decoding batch sizes (bench)")
    ap.add_argument("--commit", choices=COMMIT_RULES, default=None,
                    help="commit rule: threshold (the paper's) or left-to-right (beyond the paper); bench: both by default, "
                         "show: threshold")
    ap.add_argument("--json", default=None, help="write the benchmark rows here")
    add_runtime_args(ap)
    args = ap.parse_args(argv)
    dtype = "float32" if args.dtype == "auto" and args.bench else resolve_dtype(args.dtype, args.device)  # fair timing
    import data
    if args.show:
        model, tok, stage = load_checkpoint(args.ckpt, args.attn, dtype, diffusion=True)
        test, _ = data.load_split(args.data, "test", args.index + 1)
        show(model.to(args.device).eval(), tok, test[args.index], stage["block_size"], args.tau, stage["max_new"],
             args.commit or "threshold")
    elif args.bench:
        test, sid = data.load_split(args.data, "test", args.n)
        rows, ratio = bench_checkpoints(args.ar, args.diffusion, test, sid, args.taus, args.batch_sizes, args.device,
                                        [args.commit] if args.commit else COMMIT_RULES, args.attn, dtype)
        if args.json:
            write_atomic(args.json, json.dumps({"rows": rows, "forward_cost_ratio": ratio, "device": args.device,
                                                "dtype": dtype, "threads": torch.get_num_threads()}, indent=2))
    else:
        ap.error("choose --bench or --show")


if __name__ == "__main__":
    main()
