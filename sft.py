"""
Stage 0: the AR re-ranker (GR2) that every Diffusion-GR2 stage starts from.

A Qwen3 causal LM is fine-tuned on the teacher's traces, loss on the response only, with reasoning
tokens weighted below answer tokens (METHOD.md section 2):

    L_AR = sum_i w_i * -log p(y_i | prompt, y_<i) / sum_i w_i,   w_i = lambda_r (reasoning) or lambda_o (answer)

It validates with greedy KV-cached decoding while it trains, keeps the best checkpoint in OUT (the HF
layout every later stage reads with --init / --teacher), and ends with the test metrics next to the
retriever floor (OUT/metrics.json, OUT/predictions.jsonl). Interrupted? Run the same command again:
it resumes from OUT/last.

    python sft.py --data data/synthetic --out out/sft                       # CPU, tiny model (25-50 min)
    python sft.py --data data/synthetic-qwen3 --out out/sft-qwen --model Qwen/Qwen3-0.6B \\
        --dtype bf16-mixed --device cuda --batch-size 16 --lr 2e-5 --steps 2000          # one GPU
"""
import argparse
import time
from pathlib import Path

import torch
from tqdm import tqdm

import data
import eval as metrics
from decode import validate
from model import (HelpFormatter, Log, add_common_args, ar_loss, batch_indices, collate, create_model, keep_best,
                   load_best, lr_at, resume, setup)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--out", default="out/sft", help="checkpoint folder to write (best model, metrics, log)")
    ap.add_argument("--model", default="tiny", help="a random-init preset (model.PRESETS: tiny, micro, qwen3-0.6b), a hub id or a local folder")
    ap.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    ap.add_argument("--max-new", type=int, default=0, help="decode budget in tokens for every stage (0 = 1.25x the longest trace)")
    add_common_args(ap, steps=1200, batch_size=32, lr=3e-3, warmup=60, eval_every=150, val_n=200, tau_n=None)
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    out = setup(args)
    train, valid, test, sid = data.load_splits(args.data, args.val_n, args.test_n)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(Path(args.data) / "tokenizer")
    max_new = args.max_new or data.max_new_tokens(train)
    model = create_model(args.model, tok, args.attn, args.dtype, args.seed).to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.model}, {n_params / 1e6:.2f}M parameters, vocab {model.config.vocab_size}; "
          f"{len(train)} training examples, decode budget {max_new} tokens")
    stage = {"stage": "sft", "parent": args.model, "block_size": None, "mask_token_id": tok.mask_token_id,
             "data": str(args.data), "max_new": max_new, "args": vars(args)}

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.98))
    start, state = (0, {}) if args.fresh else resume(out, model, opt)
    best = state.get("best", -1.0)
    log = Log(out, start)
    t0, losses = time.time() - state.get("elapsed", 0.0), []
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="sft", dynamic_ncols=True)
    for step in bar:
        model.train()
        batch = collate([train[i] for i in batch_indices(step, len(train), args.batch_size, args.seed)])
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        loss = ar_loss(model, batch, args.lambda_r, args.lambda_o, tok.pad_token_id)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{opt.param_groups[0]['lr']:.1e}")
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val, _ = validate(model, tok, valid, sid, "ar", 1, max_new, args.eval_batch)
            score = val["val_valid_rate"] + val["val_recall1"]  # the best checkpoint: valid and accurate
            rec = log(step=step + 1, minutes=(time.time() - t0) / 60, loss=sum(losses) / len(losses), **val)
            losses = []
            tqdm.write(f"step {rec['step']:5d} | {rec['minutes']:5.1f} min | loss {rec['loss']:.4f} | "
                       f"val valid {rec['val_valid_rate']:.3f} R@1 {rec['val_recall1']:.3f}")
            best = keep_best(out, model, tok, stage, opt, step + 1, val, score, best, t0)

    model, tok, stage = load_best(out, args, "SFT", t0, tok)
    return metrics.run_test(out, model, tok, test, sid, "ar", max_new=max_new, batch_size=args.eval_batch)


if __name__ == "__main__":
    main()
