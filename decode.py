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
softmax can return exactly 1.0, so it is a special case, not a `>=` test). Two settings, saved with a
checkpoint, restrict which positions may commit. With sub-blocks (Fast-dLLM v2; `sub_block`, 0 = off)
only the leftmost sub-block that still has masks may: the block is still run whole, but filled a few
positions at a time. The commit rule (`commit`; `choose` below) is "any" (the paper's), "prefix" (the
leftmost mask and the confident run after it: the block fills left to right, several tokens per forward
where the model is sure, and tau = 1.0 is AR order), or "joint" / "prefix-joint" (the same two orders,
bounding the product of a step's confidences instead of each one). When the block has no masks left
it is run once more, as finished tokens (model.py's context rule), to write its K/V into the cache (the
commit forward); its last logit predicts the next block's first token. A row stops as soon as its end
token is committed with every position before it filled. Batched: left-padded prompts, each row commits its own positions.

The *step map* records, for every generated token, the step of its block at which it was committed.
`replay_rows` turns a trajectory back into the canvases it was decoded from, in the noisy+clean
training layout of model.py; `replay_chunks` scores every token from the canvas it was committed from,
a bounded number of canvases at a time, two to a row. OPD and RL train through exactly these two functions.

    python decode.py --show --ckpt out/cft --data data/synthetic            # watch one example denoise
    python decode.py --bench --ar out/sft --diffusion out/rl --data data/synthetic --json out/bench.json
"""
import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

import eval as metrics
from model import (CLEAN, NOISY, PAD, PROMPT, HelpFormatter, add_runtime_args, attention_mask, build_rows, compute,
                   context_of, for_attention, gather_logits, hidden_states, load_checkpoint, start, target_sources)

COMMIT_RULES = ("any", "prefix", "joint", "prefix-joint")  # [diffusion] which confident positions a step may commit (docstring)
COMMIT_HELP = ("which confident positions a decoding step commits: any (the paper's rule, METHOD.md 5), prefix "
               "(the leftmost mask and the confident run after it, left to right), or joint / prefix-joint (the same "
               "orders, while the product of the committed confidences stays >= tau)")


@dataclass
class Rollout:
    """What a decoder produced for a batch of prompts (lists, one entry per row)."""
    tokens: list                  # response ids up to and including the end token
    canvas: list = None           # [diffusion] every decoded position (mask id where never committed)
    steps: list = None            # [diffusion] step of its block at which each canvas position was committed (-1: never)
    nfe: list = field(default_factory=list)  # forward passes each row took part in (prefill included)

    def select(self, idx):
        """The rollouts at positions idx (for chunked backward passes)."""
        pick = lambda xs: None if xs is None else [xs[i] for i in idx]
        return Rollout(pick(self.tokens), pick(self.canvas), pick(self.steps), pick(self.nfe))


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

    def forward(self, ids, desc, keep):
        """keep=False: logits (B, n, V) at the n positions of `ids`, the cache cropped back afterwards. keep=True:
        they join the cache and only the last logits (B, V) come back (a prefill's P x V would be wasted)."""
        keys = tuple(torch.cat([a, b], 1) for a, b in zip(self.keys, desc))
        mask = attention_mask(desc, keys, context_of(self.model))
        with compute(self.model):
            h = self.model.model(input_ids=ids, attention_mask=for_attention(mask, self.model), position_ids=desc[2],
                                 cache=self.cache, use_cache=True).last_hidden_state
            logits = self.model.lm_head(h[:, -1] if keep else h).float()
        if keep:
            self.keys = keys
        else:
            self.cache.crop(-ids.shape[1])  # [diffusion] a denoising step only reads the cache
        return logits

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
        mask = for_attention(attention_mask(desc, desc, context_of(self.model)), self.model)
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
                       generator=None, use_cache=True, on_step=None, sub_block=0, commit="any"):  # [diffusion]
    """Block-diffusion decoding (module docstring). Returns a Rollout with canvas, step map and NFE.

    use_cache=False recomputes the whole sequence at every step (the reference the cache must match).
    sub_block > 0 only commits inside the leftmost sub-block of that size that still has masks (Fast-dLLM
    v2's small blocks; 0: anywhere in the block); commit picks which positions a step commits (`choose`).
    on_step(block, step, canvas, committed, logits) is called after every step (viewer, tests).
    """
    if not 0 <= sub_block <= block:
        raise ValueError(f"sub_block must be between 0 (off) and the block size {block}, got {sub_block}")
    if commit not in COMMIT_RULES:
        raise ValueError(f"commit must be one of {COMMIT_RULES}, got {commit!r}")
    B, n_blocks = len(prompts), -(-max_new // block)
    state = CachedModel(model, prompts, pad_id)
    dev = model.device  # the decoding state lives where the model does
    canvas = torch.full((B, n_blocks * block), mask_id, device=dev)
    steps = torch.full((B, n_blocks * block), -1, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    nfe = torch.ones(B, dtype=torch.long, device=dev)
    cols = torch.arange(block, device=dev)  # position in the block, used at every step
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
            pred[..., mask_id] = -float("inf")  # never emit the mask token
            tok, conf = pick(pred, temperature, generator)
            if sub_block:  # only the leftmost sub-block with masks may commit
                first = masked.float().argmax(1, keepdim=True) // sub_block
                masked = masked & (cols[None] // sub_block == first)
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
    confidence, -1 where it may not commit. Every rule commits at least one position per row with masks.

    any:          every position >= tau, and at least the most confident one (METHOD.md 5)
    prefix:       the leftmost mask, then the unbroken run of positions >= tau right after it
    joint:        most confident first, while the product of the committed confidences stays >= tau
    prefix-joint: left to right from the leftmost mask, while that product stays >= tau
    The joint rules bound the chance that a step commits a wrong token (if the positions were independent,
    it is at most 1 - tau) instead of each position's own chance, so a step can no longer commit ten
    tokens at 0.95 each that depend on one another (the mixed SIDs of the README).
    """
    left_to_right = commit.startswith("prefix")
    # the position every rule commits first: the leftmost mask, or the most confident one
    first = masked.float().argmax(1) if left_to_right else conf.argmax(1)
    rows = torch.arange(conf.shape[0], device=conf.device)
    if tau >= 1.0:  # one token per step (a float32 softmax can round to exactly 1.0: not a >= test)
        chosen = torch.zeros_like(masked)
    elif commit == "any":
        chosen = conf >= tau
    elif commit == "prefix":  # masks are a suffix of the block here, so a run from the left is what may commit
        sure = conf >= tau
        sure[rows, first] = True
        chosen = masked & ((sure | ~masked).long().cumprod(1) == 1)
    else:  # joint, prefix-joint: a cumulative sum of log-confidences along the rule's order
        log_conf = torch.where(masked, conf.clamp_min(1e-30).log(), 0.0)
        order = (torch.arange(conf.shape[1], device=conf.device).expand_as(conf) if left_to_right
                 else conf.argsort(dim=1, descending=True, stable=True))
        along = log_conf.gather(1, order).cumsum(1) >= (math.log(tau) if tau > 0 else -math.inf)  # tau 0: all
        chosen = masked & torch.zeros_like(masked).scatter(1, order, along)
    chosen[rows, first] |= masked.any(1)
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
    """Logits of every kept token from the canvas it was committed from, max_rows canvases at a time.

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
        yield gather_logits(model, hidden_states(model, rows), (k, src[c, k, r])), order


def add_decoder_args(ap, rollout_commit="any"):  # [diffusion]
    """--sub-block, --commit (None: the parent checkpoint's) and --rollout-commit (OPD: `any`; RL: None, --commit's)."""
    ap.add_argument("--sub-block", type=int, default=None,
                    help="decode with sub-blocks of this size (0 = commit anywhere in the block; default: the parent checkpoint's)")
    ap.add_argument("--commit", choices=COMMIT_RULES, default=None,
                    help=COMMIT_HELP + "; default: the parent checkpoint's")
    ap.add_argument("--rollout-commit", choices=COMMIT_RULES, default=rollout_commit,  # assumption: OPD, the paper's rule
                    # (prefix-joint helped it less: README, Stage 2); RL, its tested rule (`any` lowered its reward: Stage 3)
                    help="commit rule of the training rollouts only; validation, test and the saved checkpoint use --commit"
                    + ("" if rollout_commit else "; default: the --commit rule, on-policy"))


def inherited_decoder(parent, sub_block=None, commit=None):  # [diffusion]
    """The decoder settings a stage uses (and saves): the parent checkpoint's, unless given (not None)."""
    return {"sub_block": parent.get("sub_block", 0) if sub_block is None else sub_block,
            "commit": parent.get("commit", "any") if commit is None else commit}


# ----------------------------------------------------------------------------- decode and score a split
def generate(model, tok, prompts, mode, block=32, tau=1.0, max_new=256, batch_size=32, temperature=0.0,
             generator=None, progress=False, sub_block=0, commit="any"):
    """Decode `prompts` in length-sorted batches; returns a Rollout in the input order and the seconds taken."""
    from tqdm import tqdm
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    synchronize(model.device)
    parts, t0 = {}, time.perf_counter()
    batches = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
    for idx in tqdm(batches, desc=f"decode {mode}" + (f" tau={tau}" if mode == "diffusion" else ""),
                    disable=not progress, leave=False):
        batch = [prompts[i] for i in idx]
        if mode == "ar":
            out = ar_generate(model, batch, max_new, tok.eos_token_id, tok.pad_token_id, temperature, generator)
        else:
            out = diffusion_generate(model, batch, block, tau, max_new, tok.mask_token_id, tok.eos_token_id,
                                     tok.pad_token_id, temperature, generator, sub_block=sub_block, commit=commit)
        for k, i in enumerate(idx):
            parts[i] = (out.tokens[k], out.canvas[k] if out.canvas else None, out.steps[k] if out.steps else None, out.nfe[k])
    synchronize(model.device)
    seconds = time.perf_counter() - t0
    return Rollout(*map(list, zip(*[parts[i] for i in range(len(prompts))]))), seconds  # fields in Rollout's order


@torch.no_grad()
def evaluate(model, tok, examples, sid, mode, block=32, tau=1.0, max_new=256, batch_size=32, progress=False, sub_block=0,
             commit="any"):
    """Decode `examples` greedily and score them: (summary dict, per-example rows, texts, rollout)."""
    model.eval()
    out, seconds = generate(model, tok, [ex["prompt_ids"] for ex in examples], mode, block, tau, max_new,
                            batch_size, progress=progress, sub_block=sub_block, commit=commit)
    texts = [tok.decode(t, skip_special_tokens=False) for t in out.tokens]
    rows = metrics.score_responses(texts, examples, sid)
    summary = metrics.summarize(rows)
    n_tok = sum(len(t) for t in out.tokens)
    summary.update(tokens_per_forward=n_tok / max(1, sum(out.nfe)), tokens_per_s=n_tok / max(seconds, 1e-9),
                   seconds=seconds, mean_length=n_tok / max(1, len(examples)))
    return summary, rows, texts, out


def validate(model, tok, valid, sid, mode, block, max_new, batch, sub_block=0, commit="any"):
    """The training-time check: valid rate and Recall@1 of greedy decoding (and, for diffusion, at tau = 0.9).
    Returns the numbers and the tau = 1.0 / AR responses (rl.py scores its held-out reward on them)."""
    q, _, texts, _ = evaluate(model, tok, valid, sid, mode, block, 1.0, max_new, batch, sub_block=sub_block, commit=commit)
    res = {"val_valid_rate": q["valid_rate"], "val_recall1": q["recall@1"]}
    if mode == "diffusion":
        f, *_ = evaluate(model, tok, valid, sid, mode, block, 0.9, max_new, batch, sub_block=sub_block, commit=commit)
        res.update({"val_valid_rate_0.9": f["valid_rate"], "val_recall1_0.9": f["recall@1"],
                    "val_tokens_per_forward_0.9": f["tokens_per_forward"]})
    return res, texts


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


def bench(ar_model, diff_model, tok, examples, sid, taus, batch_sizes, blocks, max_new, log=print, sub_blocks=(0,),
          commit="any"):
    """Decode the same prompts with AR and with block diffusion at each (block, sub-block, tau), interleaved
    chunk by chunk so that every decoder sees the same machine load. Returns the rows of the speed table."""
    configs = [("ar", None, None, None)] + [("diffusion", t, b, sb) for b in blocks for sb in sub_blocks for t in taus]
    run = lambda c, prompts, bs: generate(ar_model if c[0] == "ar" else diff_model, tok, prompts, c[0], c[2] or 32,
                                          c[1] or 1.0, max_new, bs, sub_block=c[3] or 0, commit=commit)
    for c in configs:  # one untimed decode each: one-off costs (CUDA start-up, kernel choice) would land on AR, run first
        run(c, [examples[0]["prompt_ids"]], 1)
    rows = []
    for bs in batch_sizes:
        acc = {c: {"tokens": 0, "nfe": 0, "seconds": 0.0, "texts": []} for c in configs}
        for s in range(0, len(examples), bs):
            prompts = [ex["prompt_ids"] for ex in examples[s:s + bs]]
            for c in configs:  # interleaved: AR, then every tau, on this chunk
                (out, sec), a = run(c, prompts, bs), acc[c]
                a["tokens"] += sum(map(len, out.tokens)); a["nfe"] += sum(out.nfe); a["seconds"] += sec
                a["texts"] += [tok.decode(t) for t in out.tokens]
        ar_speed = acc[configs[0]]["tokens"] / acc[configs[0]]["seconds"]
        for c in configs:
            a, q = acc[c], metrics.summarize(metrics.score_responses(acc[c]["texts"], examples, sid))
            rows.append({"decoder": c[0], "tau": c[1], "block": c[2], "sub_block": c[3], "batch": bs, "n": len(examples),
                         "commit": None if c[0] == "ar" else commit, "tokens_per_s": a["tokens"] / a["seconds"],
                         "tokens_per_forward": a["tokens"] / a["nfe"], "speedup": a["tokens"] / a["seconds"] / ar_speed,
                         "valid_rate": q["valid_rate"], "recall@1": q["recall@1"], "ndcg@3": q["ndcg@3"],
                         "mean_length": a["tokens"] / len(examples)})
            log(format_row(rows[-1]))
    return rows


def bench_checkpoints(ar_path, diff_path, examples, sid, taus, batch_sizes, device="cpu", blocks=None, sub_blocks=None,
                      commit=None, attn="sdpa", dtype="float32"):
    """Load an AR and a block-diffusion checkpoint and `bench` them on `examples`, decoding with the diffusion
    checkpoint's block size, sub-block and commit rule unless given. Returns (rows, {block: forward cost ratio})."""
    ar_model, tok, _ = load_checkpoint(ar_path, attn, dtype)
    diff_model, _, stage = load_checkpoint(diff_path, attn, dtype, tok)  # one tokenizer, parsed once
    ar_model, diff_model = ar_model.to(device).eval(), diff_model.to(device).eval()
    blocks = blocks or [stage["block_size"]]
    seconds = forward_seconds(diff_model, [examples[0]["prompt_ids"]], (1, *blocks))  # against one cached prompt
    ratio = {b: seconds[b] / seconds[1] for b in blocks}  # a B-token block forward over a 1-token AR step
    print(f"speed: {diff_path} against {ar_path}; block size: cost of its forward over a 1-token step (batch 1) "
          f"{ {b: round(r, 2) for b, r in ratio.items()} }")
    dec = inherited_decoder(stage, commit=commit)
    return bench(ar_model, diff_model, tok, examples, sid, taus, batch_sizes, blocks, stage["max_new"],
                 sub_blocks=sub_blocks or [dec["sub_block"]], commit=dec["commit"]), ratio


def format_row(r):
    sub = (f"/{r['sub_block']}" if r.get("sub_block") else "") + (f" {r['commit']}" if r.get("commit", "any") != "any" else "")
    name = "AR" if r["decoder"] == "ar" else f"diffusion B={r['block']}{sub} tau={r['tau']}"
    return (f"{name:<36} batch {r['batch']:>3} | {r['tokens_per_s']:8.1f} tok/s | {r['tokens_per_forward']:5.2f} tok/fwd | "
            f"speed-up {r['speedup']:5.2f}x | valid {r['valid_rate']:.3f} | R@1 {r['recall@1']:.3f}")


# ----------------------------------------------------------------------------- viewer
def show(model, tok, example, block, tau, max_new, sub_block=0, commit="any"):
    """Print one example being denoised: masks as '·', new commits highlighted, steps per block."""
    tty = sys.stdout.isatty()
    new = (lambda w: f"\033[1;32m{w}\033[0m") if tty else (lambda w: f"*{w}*")
    print(tok.decode(example["prompt_ids"]), "\n")
    per_block = {}

    def on_step(b, s, canvas, committed, logits):  # committed: (1, block) bool, the positions this step wrote
        lo = b * block
        shown = [("·" if t == tok.mask_token_id else (new(w) if committed[0, j] else w))
                 for j, (t, w) in enumerate(zip(canvas[0, lo:].tolist(), tok.convert_ids_to_tokens(canvas[0, lo:].tolist())))]
        print(f"block {b} step {s:2d} +{int(committed[0].sum())}: " + " ".join(shown))
        per_block[b] = s + 1

    out = diffusion_generate(model, [example["prompt_ids"]], block, tau, max_new, tok.mask_token_id, tok.eos_token_id,
                             tok.pad_token_id, on_step=on_step, sub_block=sub_block, commit=commit)
    n = len(out.tokens[0])
    print(f"\n{n} tokens in {out.nfe[0]} forwards ({n / out.nfe[0]:.2f} tokens per forward); "
          f"steps per block: {[per_block[b] for b in sorted(per_block)]}")
    print("\n" + tok.decode(out.tokens[0]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--bench", action="store_true", help="time AR against block diffusion on test prompts")
    ap.add_argument("--show", action="store_true", help="print one example being denoised step by step")
    ap.add_argument("--ar", default="out/sft", help="AR checkpoint (bench)")
    ap.add_argument("--diffusion", default="out/rl", help="block-diffusion checkpoint (bench)")
    ap.add_argument("--ckpt", default="out/cft", help="block-diffusion checkpoint (show)")
    ap.add_argument("--data", default="data/synthetic", help="folder written by data.py")
    ap.add_argument("--n", type=int, default=64, help="test examples to decode (bench)")
    ap.add_argument("--index", type=int, default=0, help="which test example to show")
    ap.add_argument("--taus", type=float, nargs="+", default=[1.0, 0.9, 0.6, 0.4], help="commit thresholds (bench)")
    ap.add_argument("--tau", type=float, default=0.9, help="commit threshold (show)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16], help="decoding batch sizes (bench)")
    ap.add_argument("--blocks", type=int, nargs="+", default=None, help="block sizes to decode with (default: the trained one)")
    ap.add_argument("--sub-blocks", type=int, nargs="+", default=None,
                    help="sub-block sizes to decode with: commit only inside the leftmost sub-block with masks "
                         "(0 = anywhere in the block; default: the checkpoint's; --show uses the first)")
    ap.add_argument("--commit", choices=COMMIT_RULES, default=None, help=COMMIT_HELP + "; default: the checkpoint's")
    ap.add_argument("--json", default=None, help="write the benchmark rows here")
    add_runtime_args(ap)
    args = ap.parse_args(argv)
    start(args)
    import data
    if args.show:
        model, tok, stage = load_checkpoint(args.ckpt, args.attn, args.dtype)
        test, _ = data.load_split(args.data, "test", args.index + 1)
        show(model.to(args.device).eval(), tok, test[args.index], args.blocks[0] if args.blocks else stage["block_size"],
             args.tau, stage["max_new"], **inherited_decoder(stage, args.sub_blocks[0] if args.sub_blocks else None, args.commit))
    elif args.bench:
        test, sid = data.load_split(args.data, "test", args.n)
        rows, ratio = bench_checkpoints(args.ar, args.diffusion, test, sid, args.taus, args.batch_sizes, args.device,
                                        args.blocks, args.sub_blocks, args.commit, args.attn, args.dtype)
        result = {"ar": {str(r["batch"]): r for r in rows if r["decoder"] == "ar"},  # keyed by batch size
                  "diffusion": [r for r in rows if r["decoder"] != "ar"],
                  "forward_cost_ratio": ratio, "device": args.device, "dtype": args.dtype, "threads": torch.get_num_threads()}
        if args.json:
            metrics.write_atomic(args.json, json.dumps(result, indent=2))
    else:
        ap.error("choose --bench or --show")


if __name__ == "__main__":
    main()
