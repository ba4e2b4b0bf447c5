"""
Decoding: KV-cached AR and block-diffusion decoding, the step map and its replay, a speed benchmark,
and a terminal viewer of parallel denoising.

Block diffusion (METHOD.md section 5). The prompt is prefilled into a KV cache. The response is made
block by block, left to right. A block starts as B mask tokens; each denoising step is one forward of
the block against the cache (the cache is cropped back afterwards, so it never grows while a block is
being denoised), then for every masked position, with token shift,

    p_j = softmax(logit at j-1)            (j = 0 uses the logit that closed the previous block)
    commit j  if  max p_j >= tau,   and always the single most confident masked position

A committed token is never re-masked. tau = 1.0 commits exactly one token per forward (a float32
softmax can return exactly 1.0, so it is a special case, not a `>=` test). When the block has no
masks left it is run once more to write its K/V into the cache (the commit forward); its last logit
predicts the next block's first token. A row stops as soon as its end token is committed with every
position before it filled. Batched: left-padded prompts, each row commits its own positions.

The *step map* records, for every generated token, the step of its block at which it was committed.
`replay_rows` turns a trajectory back into the canvases it was decoded from, in the noisy+clean
training layout of model.py; `replay_logits` scores every token from the canvas it was committed from.
OPD and RL train through exactly these two functions.

    python decode.py --show --ckpt out/cft --data data/synthetic            # watch one example denoise
    python decode.py --bench --ar out/sft --diffusion out/rl --data data/synthetic --json out/bench.json
"""
import argparse
import json
import sys
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

import eval as metrics
from model import (CLEAN, PAD, PROMPT, attention_mask, build_rows, for_attention, gather_logits, hidden_states,
                   load_checkpoint, target_sources)


@dataclass
class Rollout:
    """What a decoder produced for a batch of prompts (lists, one entry per row)."""
    tokens: list                  # response ids up to and including the end token
    canvas: list = None           # [diffusion] every decoded position (mask id where never committed)
    steps: list = None            # [diffusion] step of its block at which each canvas position was committed (-1: never)
    nfe: list = field(default_factory=list)  # forward passes each row took part in (prefill included)


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
        self.model, self.cache = model, DynamicCache(config=model.config)
        self.prompt_ids, self.prompt_desc, self.prompt_len = left_pad(prompts, pad_id)
        self.keys = tuple(t[:, :0] for t in self.prompt_desc)
        self.edge = self.forward(self.prompt_ids, self.prompt_desc, keep=True)[:, -1]  # predicts response token 0

    def forward(self, ids, desc, keep):
        """Logits (B, n, V) at the n positions of `ids`; keep=False crops the cache back afterwards."""
        keys = tuple(torch.cat([a, b], 1) for a, b in zip(self.keys, desc))
        mask = attention_mask(desc, keys)
        out = self.model.model(input_ids=ids, attention_mask=for_attention(mask, self.model), position_ids=desc[2],
                               cache=self.cache, use_cache=True)
        if keep:
            self.keys = keys
        else:
            self.cache.crop(-ids.shape[1])  # [diffusion] a denoising step only reads the cache
        return self.model.lm_head(out.last_hidden_state).float()

    def response_desc(self, start, n, block):
        """Descriptors of response positions start..start+n-1 (clean, block-causal)."""
        r = torch.arange(start, start + n)
        B = len(self.prompt_len)
        return (torch.full((B, n), CLEAN), (r // block).expand(B, n), self.prompt_len[:, None] + r[None])

    def recompute(self, response, block):
        """No cache: logits predicting response tokens 0..n-1 (token shift), from one full forward."""
        ids = torch.cat([self.prompt_ids, response], 1)
        desc = tuple(torch.cat([a, b], 1) for a, b in zip(self.prompt_desc, self.response_desc(0, response.shape[1], block)))
        mask = for_attention(attention_mask(desc, desc), self.model)
        h = self.model.model(input_ids=ids, attention_mask=mask, position_ids=desc[2]).last_hidden_state
        P = self.prompt_ids.shape[1]
        return self.model.lm_head(h[:, P - 1:-1]).float()


def pick(logits, temperature, generator):
    """(token, confidence) per position: argmax, or a sample at `temperature` with its probability."""
    if temperature > 0:
        probs = torch.softmax(logits / temperature, -1)
        tok = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator).reshape(probs.shape[:-1])
    else:
        probs = torch.softmax(logits, -1)
        tok = probs.argmax(-1)
    return tok, probs.gather(-1, tok[..., None])[..., 0]


@torch.no_grad()
def ar_generate(model, prompts, max_new, eos_id, pad_id, temperature=0.0, generator=None):
    """Plain AR decoding with a KV cache: one token per forward."""
    state = CachedModel(model, prompts, pad_id)
    B = len(prompts)
    out, done, nfe = [[] for _ in range(B)], torch.zeros(B, dtype=torch.bool), [1] * B
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
        logits = state.forward(tok[:, None], state.response_desc(r, 1, 1), keep=True)[:, -1]
    return Rollout(tokens=out, nfe=nfe)


@torch.no_grad()
def diffusion_generate(model, prompts, block, tau, max_new, mask_id, eos_id, pad_id, temperature=0.0,
                       generator=None, use_cache=True, on_step=None):  # [diffusion]
    """Block-diffusion decoding (module docstring). Returns a Rollout with canvas, step map and NFE.

    use_cache=False recomputes the whole sequence at every step (the reference the cache must match).
    on_step(block, step, canvas, committed, logits) is called after every step (viewer, tests).
    """
    B, n_blocks = len(prompts), -(-max_new // block)
    state = CachedModel(model, prompts, pad_id)
    canvas = torch.full((B, n_blocks * block), mask_id)
    steps = torch.full((B, n_blocks * block), -1)
    done = torch.zeros(B, dtype=torch.bool)
    nfe = torch.ones(B, dtype=torch.long)
    for b in range(n_blocks):
        lo, hi = b * block, (b + 1) * block
        desc = state.response_desc(lo, block, block)
        for s in range(block):
            masked = (canvas[:, lo:hi] == mask_id) & ~done[:, None]
            if not masked.any():
                break
            if not use_cache:
                pred = state.recompute(canvas[:, :hi], block)[:, lo:hi]
                nfe += masked.any(1)
            elif masked[:, 1:].any():  # positions j >= 1 need a forward; j = 0 reads the previous block's logit
                logits = state.forward(canvas[:, lo:hi], desc, keep=False)
                pred = torch.cat([state.edge[:, None], logits[:, :-1]], 1)  # token shift
                nfe += masked.any(1)
            else:  # only position 0 is left (always so with block 1): no forward needed
                pred = state.edge[:, None].expand(B, block, -1).clone()
            pred[..., mask_id] = -float("inf")  # never emit the mask token
            tok, conf = pick(pred, temperature, generator)
            conf = torch.where(masked, conf, -1.0)
            commit = (conf >= tau) & masked if tau < 1.0 else torch.zeros_like(masked)
            commit[torch.arange(B), conf.argmax(1)] |= masked.any(1)  # at least the most confident one
            canvas[:, lo:hi] = torch.where(commit, tok, canvas[:, lo:hi])
            steps[:, lo:hi] = torch.where(commit, s, steps[:, lo:hi])
            done |= finished(canvas[:, :hi], mask_id, eos_id)
            if on_step:
                on_step(b, s, canvas[:, :hi], commit, pred)
        if done.all() or b == n_blocks - 1:
            break
        if use_cache:
            nfe += ~done
            state.edge = state.forward(canvas[:, lo:hi], desc, keep=True)[:, -1]  # the commit forward
    tokens = []
    for i in range(B):
        row = canvas[i].tolist()
        end = row.index(eos_id) + 1 if eos_id in row else len(row)
        tokens.append(row[:end])
    return Rollout(tokens=tokens, canvas=canvas.tolist(), steps=steps.tolist(), nfe=nfe.tolist())


def finished(canvas, mask_id, eos_id):
    """Rows whose first end token is committed and every position before it is filled."""
    is_eos = canvas == eos_id
    first = torch.where(is_eos.any(1), is_eos.float().argmax(1), canvas.shape[1])
    before = torch.arange(canvas.shape[1])[None] < first[:, None]
    return is_eos.any(1) & ~((canvas == mask_id) & before).any(1)


# ----------------------------------------------------------------------------- replay (OPD and RL)
def replay_rows(prompt, canvas, steps, block, mask_id):  # [diffusion]
    """The canvases a trajectory was decoded from, several blocks per row.

    In the noisy+clean layout a noisy block sees only itself and the clean blocks before it, so row s
    can carry the step-s canvas of *every* block at once. Returns (noisy canvases, one per step s;
    for each row the response positions committed at that step).
    """
    n_steps = max(steps) + 1
    noisy, targets = [], []
    for s in range(n_steps):
        noisy.append([tok if 0 <= st < s else mask_id for tok, st in zip(canvas, steps)])
        targets.append([r for r, st in enumerate(steps) if st == s])
    return noisy, targets


def replay_logits(model, prompts, canvases, steps, block, mask_id, keep, pad_id=0):  # [diffusion]
    """Logits (N, V) of every kept token from the canvas it was committed from, in trajectory order.

    keep[i] is the number of leading response positions of trajectory i to score (its length up to
    the end token). Returns the logits and the (trajectory, position) of each row of them.
    """
    all_p, all_resp, all_noisy, where = [], [], [], []
    for i, (p, c, st) in enumerate(zip(prompts, canvases, steps)):
        noisy, targets = replay_rows(p, c, st, block, mask_id)
        for row, tg in zip(noisy, targets):
            tg = [r for r in tg if r < keep[i]]
            if tg:
                all_p.append(p); all_resp.append(c); all_noisy.append(row); where.append((i, tg))
    rows = build_rows(all_p, all_resp, block, noisy=all_noisy, pad_id=pad_id)
    src, _ = target_sources(rows, [len(c) for c in all_resp], block)
    b = torch.tensor([k for k, (_, tg) in enumerate(where) for _ in tg])
    r = torch.tensor([x for _, tg in where for x in tg])
    logits = gather_logits(model, hidden_states(model, rows), (b, src[b, r]))
    order = [(i, x) for i, tg in where for x in tg]
    return logits, order
