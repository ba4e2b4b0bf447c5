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
the share of each code level. sft.py continues from OUT with `--model OUT`.

With `--curriculum F` the prompts start short (one candidate, no history) and grow linearly to the whole
prompt over the first F of the steps: published studies find that induction heads (the copying circuit)
form faster on short contexts, and a short prompt is a cheap step. Validation always reads whole prompts.

    python warmup.py --data data/beauty --out out-beauty/warmup                # CPU, tiny model
    python warmup.py --data data/beauty --out out-beauty/warmup --curriculum 0.5   # short prompts first
    python sft.py --data data/beauty --out out-beauty/sft --model out-beauty/warmup
"""
import argparse
import json
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


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--out", default="out/warmup", help="checkpoint folder to write (sft.py reads it with --model)")
    ap.add_argument("--model", default="tiny", help=f"a random-init preset ({', '.join(PRESETS)}) or a local folder")
    add_training_args(ap, steps=2000, batch_size=32, lr=3e-3, warmup=30, eval_every=250, tau_n=False, test=False)
    ap.add_argument("--curriculum", type=float, default=0.0,
                    help="the share of the steps over which the prompt grows from one candidate and no history to "
                         "the whole prompt (0: the whole prompt from the first step)")
    args = ap.parse_args(argv)
    check_positive(ap, args, "batch_size", "eval_every")
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


@torch.no_grad()
def copy_accuracy(model, tok, examples, sid, batch_size, seed=0):
    """The share of SIDs in held-out copy responses whose every code the model predicts (argmax), given the
    response so far (teacher forcing), and the share of each code level (a, b, c, d) predicted. It measures copying
    alone: which number comes next is free to choose."""
    model.eval()
    rng = np.random.default_rng(seed)
    copies = [copy_example(ex, sid, tok, rng) for ex in examples]
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
        batch = collate([copy_example(train[i], sid, tok, rng, n_cands, n_hist)
                         for i in batch_indices(step, len(train), args.batch_size, args.seed)])
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
            exact, levels = copy_accuracy(model, tok, valid, sid, args.eval_batch, args.seed)
            rec = log(step=step + 1, minutes=(time.time() - t0) / 60, loss=sum(losses) / len(losses),
                      prompt_candidates=n_cands, prompt_history=n_hist, val_copy_exact=exact,
                      **{f"val_copy_{level}": rate for level, rate in zip("abcd", levels)})
            losses = []
            tqdm.write(f"step {rec['step']:5d} | {rec['minutes']:5.1f} min | loss {rec['loss']:.4f} | prompt "
                       f"{n_cands} candidates, {n_hist} history | val SIDs copied exactly {exact:.3f} (codes a-d "
                       + " ".join(f"{rate:.3f}" for rate in levels) + ")")
            save_progress(out, model, tok, stage, opt, step + 1, time.time() - t0)

    save_checkpoint(out, model, tok, {**stage, "step": args.steps})
    last = read_jsonl(Path(out) / "log.jsonl")[-1]  # the last step's validation: the model saved
    result = {k: v for k, v in last.items() if k.startswith("val_copy")} | {"minutes": (time.time() - t0) / 60}
    write_atomic(Path(out) / "metrics.json", json.dumps(result, indent=2))  # marks the stage finished (run.sh)
    print(f"warm-up took {result['minutes']:.1f} min; it copies {result['val_copy_exact']:.3f} of the SIDs "
          f"of {len(valid)} held-out prompts exactly")
    return result


if __name__ == "__main__":
    main()
