"""
Decoding: KV-cached AR decoding, block-diffusion decoding with the paper's commit rule, the stopping
rule, and the step map with its replay. This file and model.py are the mechanism; harness.py decodes
and scores whole splits with it (a stage's validation and test, the speed benchmark, the viewer).

Block diffusion (METHOD.md section 5). The prompt is prefilled into a KV cache. The response is made
block by block, left to right. A block starts as B mask tokens; each denoising step is one forward of
the block against the cache (the cache is cropped back afterwards, so it never grows while a block is
being denoised), then for every masked position, with token shift,

    p_j = softmax(logit at j-1)            (j = 0 uses the logit that closed the previous block)
    commit j  if  max p_j >= tau,   and always the single most confident masked position

A committed token is never re-masked. tau = 1.0 commits exactly one token per forward (a float32
softmax can return exactly 1.0, so it is a special case, not a `>=` test). That is the paper's rule
("threshold"). Beyond the paper, `commit="left-to-right"` commits from the leftmost mask rightwards
while the product of the committed confidences stays >= tau (`choose` below; the README measures
both side by side). When the block has no masks left it is run once more, as finished tokens, to
write its K/V into the cache (the commit forward); its last logit predicts the next block's first
token. A row stops as soon as its end token is committed with every position before it filled;
tokens after the end token are dropped. Batched: left-padded prompts, each row commits its own positions.
With B = 1 there is nothing to denoise: each block is one token read from the previous logit, which is
AR decoding (a test checks it token for token).

The *step map* records, for every generated token, the step of its block at which it was committed.
`replay_rows` turns a trajectory back into the canvases it was decoded from, in the noisy+clean
training layout of model.py; `replay_chunks` scores every token from the canvas it was committed from,
a bounded number of canvases at a time, two to a row. OPD and RL train through exactly these two functions.
"""
import math
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from model import (CLEAN, NOISY, PAD, PROMPT, attention_mask, build_rows, for_attention, gather_logits, hidden_states,
                   target_sources, without_mask)
from plumbing import compute

COMMIT_RULES = ("threshold", "left-to-right")  # [diffusion] which confident positions a step commits (`choose`)


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

    def commit_and_draft(self, clean, start, nxt, block):  # [diffusion]
        """One forward for two: the finished block `clean` (B, block) at response position `start` joins the cache,
        and the next block's canvas `nxt` (B, block) is denoised beside it, reading that block as a clean one
        would. Returns (edge, draft): the logits predicting the next block's token 0 (B, V), and those of `nxt`'s
        positions (B, block, V): both equal to a commit forward followed by a denoising forward."""
        desc = tuple(torch.cat(pair, 1) for pair in zip(self.response_desc(start, block, block),
                                                         self.response_desc(start + block, block, block, NOISY)))
        logits = self.forward(torch.cat([clean, nxt], 1), desc, keep=True, every=True)
        self.crop(self.keys[0].shape[1] - block)  # the noisy block's K/V are not the cache's
        return logits[:, block - 1], logits[:, block:]

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
    # assumption: a sampled token's confidence, what the commit rule compares with tau, is its own probability,
    # not the top probability of its position (greedy decoding has the two equal)
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
