"""
Stage 0: the AR re-ranker (GR2) that every Diffusion-GR2 stage starts from.

A Qwen3 causal LM is fine-tuned on the teacher's traces, loss on the response only, with reasoning
tokens weighted below answer tokens (METHOD.md section 2):

    L_AR = sum_i w_i * -log p(y_i | prompt, y_<i) / sum_i w_i,   w_i = lambda_r (reasoning) or lambda_o (answer)

It validates with greedy KV-cached decoding every --eval-every steps (the learning curve in OUT/log.jsonl),
saves the final weights in OUT (the HF layout every later stage reads with --init / --teacher) and ends with
the test metrics next to the retriever floor (OUT/metrics.json, OUT/predictions.jsonl). Interrupted? Run
the same command again: it resumes from OUT/last.

    python sft.py --data data/synthetic --out out/sft                       # CPU, tiny model: 1000 steps
    python sft.py --data data/synthetic-qwen3 --out out/sft-qwen --model Qwen/Qwen3-0.6B \\
        --dtype bf16-mixed --device cuda --batch-size 16 --lr 2e-5 --steps 2000          # one GPU
    torchrun --standalone --nproc_per_node 4 sft.py ... --batch-size 4   # 4 processes of 4 = one of 16 (plumbing.py)
"""
import argparse
import time
from pathlib import Path

import torch
from tqdm import tqdm

import data
from harness import test_stage, validate
from model import PRESETS, ar_loss, create_model
from plumbing import (HelpFormatter, Log, add_training_args, all_mean, batch_indices, check_positive, check_tokenizer, collate,
                      ddp_setup, is_main, lr_at, my_share, resume, save_checkpoint, save_progress, setup, sync_grads)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--out", default="out/sft", help="checkpoint folder to write (model, metrics, log)")
    ap.add_argument("--model", default="tiny",
                    help=f"a random-init preset ({', '.join(PRESETS)}), a hub id such as Qwen/Qwen3-0.6B, or a local folder")
    ap.add_argument("--max-new", type=int, default=0,
                    help="decoding budget in tokens, inherited by every later stage (0 = 1.25x the longest trace)")
    add_training_args(ap, steps=1000, batch_size=32, lr=3e-3, warmup=60, eval_every=250, tau_n=False)
    args = ap.parse_args(argv)
    check_positive(ap, args, "batch_size", "eval_every")  # --eval-every 0 would divide by zero after the first step
    return args


def main(argv=None):
    args = parse_args(argv)
    rank, world = ddp_setup(args)
    out = setup(args)
    train, valid, test, sid = data.load_splits(args.data, args.val_n, args.test_n)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(Path(args.data) / "tokenizer")
    if (Path(args.model) / "stage.json").exists():  # one of this project's checkpoints: it must read this data's ids
        check_tokenizer(args.model, AutoTokenizer.from_pretrained(args.model), args.data)
    max_new = args.max_new or data.max_new_tokens(train)
    model = create_model(args.model, tok, args.attn, args.dtype, args.seed).to(args.device)
    print(f"model: {args.model}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, vocab "
          f"{model.config.vocab_size}; {len(train)} training traces, decoding budget {max_new} tokens")
    stage = {"stage": "sft", "parent": args.model, "block_size": None, "mask_token_id": tok.mask_token_id,
             "data": str(args.data), "max_new": max_new, "args": vars(args)}

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    start, elapsed = (0, 0.0) if args.fresh else resume(out, model, opt)
    log, t0, losses = Log(out, start) if is_main() else None, time.time() - elapsed, []
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="sft", dynamic_ncols=True, disable=not is_main())
    for step in bar:
        model.train()
        # each rank its slice of the global batch (the ranks' losses are per-rank means, averaged: see plumbing.py)
        batch = collate([train[i] for i in my_share(batch_indices(step, len(train), args.batch_size * world, args.seed))])
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        loss = ar_loss(model, batch, args.lambda_r, args.lambda_o, tok.pad_token_id)
        loss.backward()
        sync_grads(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(all_mean([loss.item()])[0])
        bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{opt.param_groups[0]['lr']:.1e}")
        if not is_main():  # validation and saving are rank 0's
            continue
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val, _ = validate(model, tok, valid, sid, "ar", 1, max_new, args.eval_batch)
            rec = log(step=step + 1, minutes=(time.time() - t0) / 60, loss=sum(losses) / len(losses), **val)
            losses = []
            tqdm.write(f"step {rec['step']:5d} | {rec['minutes']:5.1f} min | loss {rec['loss']:.4f} | "
                       f"val valid {rec['val_valid_rate']:.3f} R@1 {rec['val_recall1']:.3f}")
            save_progress(out, model, tok, stage, opt, step + 1, time.time() - t0)

    if not is_main():  # rank 0 saves and tests alone
        return None
    # assumption: the last step is the checkpoint, in every stage (no choice among steps by the validation curve)
    save_checkpoint(out, model, tok, {**stage, "step": args.steps})
    print(f"SFT took {(time.time() - t0) / 60:.1f} min; testing ...")
    return test_stage(out, model.eval(), tok, test, sid, "ar", max_new=max_new, batch_size=args.eval_batch,
                      train_minutes=(time.time() - t0) / 60)


if __name__ == "__main__":
    main()
