"""
Warm-up: teach a random-init model to copy candidates' SIDs, the part pretraining plays in the paper.

The paper starts from a pretrained Qwen3 that already copies strings from its prompt. A tiny model
initialised at random has to learn that, and on a real catalogue it is the hard part: many items share
a SID's first code, so writing a candidate means looking it up in the prompt and copying all its codes.
An AR re-ranker trained on the teacher's traces alone learns to reason but writes SIDs that are not
candidates (README, "Amazon Beauty").

This stage trains on the training prompts with a response that lists the candidates in a *random*
order, each with its number and SID, then the answer in that order:

    <think> ranking : c7 <a_3><b_9><c_0><d_0> ; c2 <a_..> ... ; </think> [<a_3><b_9><c_0><d_0> <a_..> ...]

with the AR loss of sft.py (reasoning weighted lambda_r, answer lambda_o). The order is random, so it
holds no user's choice: the model learns the answer's format and how to copy, not how to rank. Every
step draws new orders (seeded by the step, so a resumed run sees the same ones). It validates on
held-out prompts by teacher forcing: the share of SIDs whose four codes the model predicts exactly, and
the share of each code level, and the exact share again under random SIDs (below), which only copying can
predict. sft.py continues from OUT with `--model OUT`.

With `--random-sids P` a share P of the training examples show their items under random SIDs, the same in
prompt and response. A model can predict a catalogue SID's later codes from its first ones by memorising the
catalogue, and on a real one that is what it learns first; a random SID gives memory nothing to hold, so those
examples reward copying alone. Random SIDs drawn from whole codebooks rarely share a code, so a model can copy each
code from behind the code before it; the catalogue's often share their first codes, and then only the candidate's
number says which SID to copy. With `--random-pool K` half of the random-SID examples draw each level from only K
codes, so their SIDs share prefixes and copying must follow the number.

With `--curriculum F` the prompts start short (one candidate, no history) and grow linearly to the whole
prompt over the first F of the steps: published studies find that induction heads (the copying circuit)
form faster on short contexts, and a short prompt is a cheap step. Validation always reads whole prompts.

    python warmup.py --data data/beauty --out out-beauty/warmup                # CPU, tiny model
    python warmup.py --data data/beauty --out out-beauty/warmup --curriculum 0.5   # short prompts first
    python warmup.py --data data/beauty --out out-beauty/warmup --random-sids 0.5  # half the SIDs random
    python warmup.py --data data/beauty --out out-beauty/warmup --random-sids 0.5 --random-pool 3  # shared prefixes too
    python warmup.py --data data/beauty --out /tmp/rates --model out-beauty/warmup --steps 0   # a model's rates
    python sft.py --data data/beauty --out out-beauty/sft --model out-beauty/warmup
"""
import argparse
import json
import math
import re
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import data
from model import PRESETS, ar_logits, ar_loss, create_model
from plumbing import (HelpFormatter, Log, add_training_args, batch_indices, check_positive, check_tokenizer, collate, compute,
                      lr_at, read_jsonl, resume, save_checkpoint, save_progress, setup, write_atomic)
from teacher import answer_text

SID_CODE = re.compile(r"<[a-d]_\d+>")  # one code of a SID, a token of its own in every tokenizer (data.py)
WHOLE_SID = re.compile(r"<a_\d+><b_\d+><c_\d+><d_\d+>")  # a whole SID as prompts write it, codes a-d in a row


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--out", default="out/warmup", help="checkpoint folder to write (sft.py reads it with --model)")
    ap.add_argument("--model", default="tiny", help=f"a random-init preset ({', '.join(PRESETS)}) or a local folder")
    add_training_args(ap, steps=2000, batch_size=32, lr=3e-3, warmup=30, eval_every=250, tau_n=False, test=False)
    ap.add_argument("--curriculum", type=float, default=0.0,
                    help="the share of the steps over which the prompt grows from one candidate and no history to "
                         "the whole prompt (0: the whole prompt from the first step)")
    ap.add_argument("--random-sids", type=float, default=0.0,
                    help="the share of training examples whose items get random SIDs (each code drawn from the "
                         "tokenizer's codes of its level, the same in prompt and response): only copying can predict them")
    ap.add_argument("--random-pool", type=int, default=0,
                    help="with --random-sids: half of the random-SID examples draw each level's codes from only this "
                         "many (at least 2), so their SIDs share prefixes (0: every code of the level)")
    args = ap.parse_args(argv)
    check_positive(ap, args, "batch_size", "eval_every")
    if not 0.0 <= args.random_sids <= 1.0:
        ap.error(f"--random-sids must be in [0, 1], got {args.random_sids}")
    if args.random_pool and (args.random_pool < 2 or not args.random_sids):
        ap.error(f"--random-pool must be 0, or at least 2 with --random-sids, got {args.random_pool}")
    if not 0.0 <= args.curriculum <= 1.0:
        ap.error(f"--curriculum must be in [0, 1], got {args.curriculum}")
    return args


def prompt_size(step, steps, curriculum, n_cands, n_hist):
    """(candidates, history items) shown at this step: one candidate and no history at step 0, growing linearly
    to the whole prompt at `curriculum` of the steps (0: the whole prompt throughout)."""
    grown = min(1.0, step / (curriculum * steps)) if curriculum > 0 else 1.0
    return 1 + round(grown * (n_cands - 1)), round(grown * n_hist)


# assumption: the warm-up reuses the training prompts and the teacher's ranking-line layout (without scores), so
# it adds no data and teaches copying in the very context SFT needs it; the paper has no such stage.
def copy_example(ex, sid, tok, rng, n_cands=None, n_hist=None):
    """A training example whose response copies its candidates in a random order (the docstring's layout). With
    n_cands / n_hist its prompt shrinks to a random n_cands of its candidates (renumbered) and its last n_hist items."""
    cands, history, prompt = ex["candidates"], ex["history"], ex["prompt"]
    n_cands = len(cands) if n_cands is None else min(n_cands, len(cands))
    n_hist = len(history) if n_hist is None else min(n_hist, len(history))
    if n_cands < len(cands) or n_hist < len(history):  # the curriculum's shorter prompt
        hist_lines, cand_lines = data.prompt_lines(prompt)
        keep = np.sort(rng.choice(len(cands), n_cands, replace=False))
        cands = [cands[k] for k in keep]
        prompt = data.layout_prompt(hist_lines[len(hist_lines) - n_hist:], [cand_lines[k] for k in keep])
    order = rng.permutation(len(cands))
    lines = [f"c{p + 1} {sid[cands[p]]} ;" for p in order]
    reasoning = "<think>\nranking :\n" + "\n".join(lines) + "\n</think>"
    prompt_ids, response, n_reasoning = data.tokenize(tok, prompt, reasoning, answer_text(sid, cands, order))
    return {"prompt_ids": prompt_ids, "response_ids": response, "n_reasoning": n_reasoning}


def sid_codes(tok):
    """The tokenizer's SID codes by level: {'a': ['<a_0>', ...], 'b': [...], ...}."""
    codes = {}
    for token in sorted(tok.get_vocab()):
        if SID_CODE.fullmatch(token):
            codes.setdefault(token[1], []).append(token)
    return codes


def with_random_sids(ex, sid, codes, rng, pool=0):
    """(ex, sid) with every item of ex given a random SID, distinct within the example, written into its prompt.
    The catalogue's SIDs can be memorised item by item; random ones can only be copied from the prompt. With `pool`
    each level's codes come from `pool` of them drawn for this example, so the SIDs share prefixes."""
    items = list(dict.fromkeys(ex["history"] + ex["candidates"]))
    levels = [[level[i] for i in rng.choice(len(level), min(pool, len(level)), replace=False)] if pool else level
              for level in codes.values()]
    if math.prod(map(len, levels)) < len(items):
        raise ValueError(f"{math.prod(map(len, levels))} distinct SIDs (pool {pool}) for the {len(items)} items of {ex['id']}")
    fresh = []  # a list, not a set: its order must not depend on string hashing (a resumed run draws the same)
    while len(fresh) < len(items):
        new = "".join(level[rng.integers(len(level))] for level in levels)
        if new not in fresh:
            fresh.append(new)
    new_sid = dict(zip(items, fresh))
    return ex | {"prompt": rewrite_sids(ex["prompt"], {sid[item]: new_sid[item] for item in items})}, new_sid


def rewrite_sids(text, new):
    """`text` with every SID that is a key of `new` written as its value, in one pass: a new SID that happens to
    equal another item's old one is never rewritten twice."""
    return WHOLE_SID.sub(lambda m: new.get(m.group(0), m.group(0)), text)


@torch.no_grad()
def copy_accuracy(model, tok, examples, sid, batch_size, seed=0, codes=None):
    """The share of SIDs in held-out copy responses whose every code the model predicts (argmax), given the
    response so far (teacher forcing), and the share of each code level (a, b, c, d) predicted. It measures copying
    alone: which number comes next is free to choose. With `codes` (sid_codes) the items get random SIDs first, so
    a memorised catalogue cannot help: what is left is copying."""
    model.eval()
    rng = np.random.default_rng(seed)
    pairs = [with_random_sids(ex, sid, codes, rng) if codes else (ex, sid) for ex in examples]
    copies = [copy_example(ex, ex_sid, tok, rng) for ex, ex_sid in pairs]
    sid_token = torch.zeros(len(tok), dtype=torch.bool)
    sid_token[[i for t, i in tok.get_vocab().items() if SID_CODE.fullmatch(t)]] = True
    right, level_right, total = 0, torch.zeros(4, dtype=torch.long), 0
    for k in range(0, len(copies), batch_size):
        chunk = copies[k:k + batch_size]
        responses = [c["response_ids"] for c in chunk]
        with compute(model):
            pred = ar_logits(model, [c["prompt_ids"] for c in chunk], responses, tok.pad_token_id).argmax(-1).cpu()
        target = torch.tensor([t for r in responses for t in r])
        codes = sid_token[target]  # SIDs are runs of 4 codes: group the code positions 4 by 4
        hit = (pred[codes] == target[codes]).view(-1, 4)  # (SIDs, 4 levels)
        right, level_right, total = right + int(hit.all(1).sum()), level_right + hit.sum(0), total + len(hit)
    return right / max(total, 1), [n / max(total, 1) for n in level_right.tolist()]


def validation(model, tok, valid, sid, codes, args):
    """The log's copy rates: exact and per code level on the catalogue's SIDs, exact on random ones."""
    exact, levels = copy_accuracy(model, tok, valid, sid, args.eval_batch, args.seed)
    return {"val_copy_exact": exact, **{f"val_copy_{level}": rate for level, rate in zip("abcd", levels)},
            "val_copy_random_exact": copy_accuracy(model, tok, valid, sid, args.eval_batch, args.seed, codes)[0]}


def describe(rec):
    """validation()'s rates in one line of the log."""
    return (f"val SIDs copied exactly {rec['val_copy_exact']:.3f} (codes a-d "
            + " ".join(f"{rec[f'val_copy_{level}']:.3f}" for level in "abcd")
            + f"; random SIDs {rec['val_copy_random_exact']:.3f})")


def main(argv=None):
    args = parse_args(argv)
    out = setup(args)
    train, valid, _, sid = data.load_splits(args.data, args.val_n, 1)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(Path(args.data) / "tokenizer")
    if (Path(args.model) / "stage.json").exists():  # one of this project's checkpoints: it must read this data's ids
        check_tokenizer(args.model, AutoTokenizer.from_pretrained(args.model), args.data)
    model = create_model(args.model, tok, args.attn, args.dtype, args.seed).to(args.device)
    print(f"model: {args.model}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; "
          f"{len(train)} training prompts")
    codes = sid_codes(tok)
    if args.random_pool:  # refuse now a pool too small for the largest example, not at the step that draws it
        distinct = math.prod(min(args.random_pool, len(level)) for level in codes.values())
        largest = max(len(set(ex["history"] + ex["candidates"])) for ex in train)
        if distinct < largest:
            raise SystemExit(f"error: --random-pool {args.random_pool} gives {distinct} distinct SIDs, fewer than the "
                             f"{largest} items of the largest training example")
    max_cands, max_hist = max(len(ex["candidates"]) for ex in train), max(len(ex["history"]) for ex in train)
    stage = {"stage": "warmup", "parent": args.model, "block_size": None, "mask_token_id": tok.mask_token_id,
             "data": str(args.data), "args": vars(args)}

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    start, elapsed = (0, 0.0) if args.fresh else resume(out, model, opt)
    log, t0, losses = Log(out, start), time.time() - elapsed, []
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="warmup", dynamic_ncols=True)
    for step in bar:
        model.train()
        rng = np.random.default_rng([args.seed, step])  # this step's orders, the same after a resume
        n_cands, n_hist = prompt_size(step, args.steps, args.curriculum, max_cands, max_hist)
        examples = [(train[i], sid) for i in batch_indices(step, len(train), args.batch_size, args.seed)]
        if args.random_sids:  # draws per example only when asked: the default run's orders do not depend on it
            drawn = []
            for ex, ex_sid in examples:
                if rng.random() < args.random_sids:
                    pool = args.random_pool if args.random_pool and rng.random() < 0.5 else 0  # half share prefixes
                    ex, ex_sid = with_random_sids(ex, ex_sid, codes, rng, pool)
                drawn.append((ex, ex_sid))
            examples = drawn
        batch = collate([copy_example(ex, ex_sid, tok, rng, n_cands, n_hist) for ex, ex_sid in examples])
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        loss = ar_loss(model, batch, args.lambda_r, args.lambda_o, tok.pad_token_id)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{opt.param_groups[0]['lr']:.1e}")
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            rec = log(step=step + 1, minutes=(time.time() - t0) / 60, loss=sum(losses) / len(losses),
                      prompt_candidates=n_cands, prompt_history=n_hist, **validation(model, tok, valid, sid, codes, args))
            losses = []
            tqdm.write(f"step {rec['step']:5d} | {rec['minutes']:5.1f} min | loss {rec['loss']:.4f} | prompt "
                       f"{n_cands} candidates, {n_hist} history | {describe(rec)}")
            save_progress(out, model, tok, stage, opt, step + 1, time.time() - t0)

    save_checkpoint(out, model, tok, {**stage, "step": args.steps})
    if args.steps:  # the last step's validation: the model saved
        result = {k: v for k, v in read_jsonl(Path(out) / "log.jsonl")[-1].items() if k.startswith("val_copy")}
    else:  # --steps 0: the copy rates of the model as loaded
        result = validation(model, tok, valid, sid, codes, args)
        print(describe(result))
    result |= {"minutes": (time.time() - t0) / 60}
    write_atomic(Path(out) / "metrics.json", json.dumps(result, indent=2))  # marks the stage finished (run.sh)
    print(f"warm-up took {result['minutes']:.1f} min; it copies {result['val_copy_exact']:.3f} of the SIDs "
          f"of {len(valid)} held-out prompts exactly")
    return result


if __name__ == "__main__":
    main()
