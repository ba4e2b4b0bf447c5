"""
Stage 2: on-policy distillation (OPD) from the AR teacher closes the distributional gap.

CFT trained on the teacher's fixed traces (off-policy). Here the CFT student decodes its *own*
trajectories with the real block-diffusion decoder (G' per prompt), and the frozen AR re-ranker of
sft.py says, at every generated position, what it would have predicted there:

    L_OPD = mean_trajectories  mean_{i <= end}  KL( p_teacher(. | prompt, y_<i)  ||  p_student(. | canvas_i) )

The teacher needs one causal forward over prompt + completion (no gradient, once per trajectory).
canvas_i is the state token i was committed from, rebuilt from the decoder's step map by
decode.replay_chunks -- the same function rl.py uses. Token shift lines the two up position for
position: both logits for token i sit at position i-1. Divergences are computed in float32 from
log-probabilities. `--reverse` uses KL(student || teacher); `--clean-prefix` scores each token with
everything before it clean and the rest of its block masked, instead of the replayed canvas
(assumption: the paper does not give the exact context).

    python opd.py --data data/synthetic --init out/cft --teacher out/sft --out out/opd      # CPU (25-56 min)
    python opd.py --data data/synthetic-qwen3 --init out/cft-qwen --teacher out/sft-qwen --out out/opd-qwen \\
        --dtype bf16-mixed --device cuda --prompts-per-step 32 --rows 16 --lr 1e-6 --steps 200   # one GPU
"""
import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

import data
import eval as metrics
from decode import add_decoder_args, generate, inherited_decoder, replay_chunks, validate
from model import (HelpFormatter, Log, add_common_args, ar_logits, batch_indices, keep_best, load_best, load_checkpoint,
                   lr_at, resume, setup, token_kl)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--init", default="out/cft", help="the CFT student checkpoint")
    ap.add_argument("--teacher", default="out/sft", help="the frozen AR teacher checkpoint")
    ap.add_argument("--out", default="out/opd", help="checkpoint folder to write")
    ap.add_argument("--group", type=int, default=4, help="G': trajectories the student decodes per prompt")
    ap.add_argument("--prompts-per-step", type=int, default=4,  # assumption: 4 (the paper: 128), sized for a CPU
                    help="training prompts per step (the paper: 128)")
    ap.add_argument("--tau", type=float, default=0.9,  # [diffusion] assumption: 0.9, the paper's first speed setting
                    help="commit threshold of the student's rollouts")
    add_decoder_args(ap)  # [diffusion] --sub-block, --commit: the parent checkpoint's unless given
    ap.add_argument("--temperature", type=float, default=1.0,  # assumption: 1.0, sampling from the student as it is
                    help="sampling temperature of the rollouts")
    ap.add_argument("--reverse", action="store_true", help="KL(student || teacher) instead of KL(teacher || student)")
    ap.add_argument("--clean-prefix", action="store_true",
                    help="score each token from a clean prefix instead of its replayed canvas (assumption: replay)")
    ap.add_argument("--chunk", type=int, default=8, help="trajectories per teacher forward (memory, not maths)")
    ap.add_argument("--rows", type=int, default=64, help="replayed canvases per backward pass (memory, not maths)")
    ap.add_argument("--pack", type=int, default=2, help="replayed canvases of one trajectory per row (speed, not maths)")
    ap.add_argument("--kl-n", type=int, default=100, help="test prompts for the KL-to-teacher figure")
    # assumption: lr 1e-4 with warm-up and cosine, sized for 80 steps of 4 prompts on the tiny model (the paper: 1e-6
    # constant, ~1.5k steps of 128 prompts at 8B scale; the README's Qwen3-0.6B preset passes --lr 1e-6). A 40-step
    # cosine skips the 12.5 float32 CPU minutes of steps 41-80 (about 8 in bf16-mixed) but ended less valid: 0.840
    # against 0.900 at tau 0.9 (docs/stage-notes.md, the run at 2dd6242)
    add_common_args(ap, token_weights=False, steps=80, batch_size=0, lr=1e-4, warmup=5, eval_every=40, val_n=200)
    args = ap.parse_args(argv)
    if min(args.group, args.prompts_per_step) < 1:
        ap.error(f"--group and --prompts-per-step must be at least 1, got {args.group}, {args.prompts_per_step}")
    if min(args.rows, args.pack, args.chunk) < 1:
        ap.error(f"--rows, --pack and --chunk must be at least 1, got {args.rows}, {args.pack}, {args.chunk}")
    return args


def check_vocab(student, s_tok, teacher, t_tok):
    """Distillation compares distributions row by row: the two vocabularies must be the same."""
    if student.config.vocab_size != teacher.config.vocab_size or s_tok.get_vocab() != t_tok.get_vocab():
        raise SystemExit(f"error: student and teacher vocabularies differ ({student.config.vocab_size} vs "
                         f"{teacher.config.vocab_size} rows, or different tokenizers)")


def opd_losses(student, teacher, prompts, roll, block, mask_id, pad_id, reverse=False, clean_prefix=False, max_rows=64,
               pack=2):
    """The loss in parts, one per chunk of replayed canvases: each token's KL divided by its trajectory's
    length. The parts sum to the sum over trajectories of the mean KL per generated token (divide by
    the number of trajectories); a caller that trains backwards each part as it comes (memory)."""
    keep = [len(t) for t in roll.tokens]
    with torch.no_grad():  # the teacher: one causal forward per trajectory, full next-token distributions
        logp_t = torch.log_softmax(ar_logits(teacher, prompts, roll.tokens, pad_id), -1)
    offset = [0] + list(torch.tensor(keep).cumsum(0)[:-1].tolist())
    steps = roll.steps
    if clean_prefix:  # replaying a left-to-right step map gives exactly the clean-prefix canvases
        steps = [[r % block if s >= 0 else -1 for r, s in enumerate(st)] for st in steps]
    for logits, order in replay_chunks(student, prompts, roll.canvas, steps, block, mask_id, keep, pad_id, max_rows, pack):
        kl = token_kl(logp_t[[offset[i] + r for i, r in order]], logits, reverse)
        length = torch.tensor([keep[i] for i, _ in order], device=kl.device, dtype=kl.dtype)
        yield (kl / length).sum()


def opd_loss(*args, **kwargs):
    """Summed per-trajectory mean KL over generated tokens (divide by the number of trajectories)."""
    return sum(opd_losses(*args, **kwargs))


@torch.no_grad()
def test_kl(student, teacher, tok, examples, block, max_new, batch, sub_block=0, commit="any"):
    """Mean KL(teacher || student) along the student's own greedy tau = 1.0 trajectories."""
    total, n = 0.0, 0
    for s in range(0, len(examples), batch):
        prompts = [ex["prompt_ids"] for ex in examples[s:s + batch]]
        roll, _ = generate(student, tok, prompts, "diffusion", block, 1.0, max_new, len(prompts), sub_block=sub_block,
                           commit=commit)
        total += opd_loss(student, teacher, prompts, roll, block, tok.mask_token_id, tok.pad_token_id).item()
        n += len(prompts)
    return total / max(n, 1)


def main(argv=None):
    args = parse_args(argv)
    out = setup(args)
    train, valid, test, sid = data.load_splits(args.data, args.val_n, args.test_n)
    student, tok, parent = load_checkpoint(args.init, args.attn, args.dtype)
    teacher, t_tok, _ = load_checkpoint(args.teacher, args.attn, args.dtype)
    check_vocab(student, tok, teacher, t_tok)
    student.to(args.device), teacher.to(args.device).eval().requires_grad_(False)
    block, max_new = parent["block_size"], parent["max_new"]
    dec = inherited_decoder(parent, args.sub_block, args.commit)  # [diffusion] {sub_block, commit}
    stage = {"stage": "opd", "parent": str(args.init), "teacher": str(args.teacher), "block_size": block, **dec,
             "mask_token_id": tok.mask_token_id, "data": str(args.data), "max_new": max_new, "args": vars(args)}
    kl_examples = test[:args.kl_n]
    print(f"rollouts: G'={args.group} x {args.prompts_per_step} prompts, tau={args.tau}, temperature={args.temperature}, "
          f"sub-block {dec['sub_block']}, commit {args.rollout_commit} (validation and test: {dec['commit']})")

    opt = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    start, state = (0, {}) if args.fresh else resume(out, student, opt)
    best, log = state.get("best", -1.0), Log(out, start)
    t0 = time.time() - state.get("elapsed", 0.0)
    if start == 0:
        state["kl_init"] = test_kl(student, teacher, tok, kl_examples, block, max_new, 16, **dec)
        val, _ = validate(student, tok, valid, sid, "diffusion", block, max_new, args.eval_batch, **dec)
        log(step=0, minutes=0.0, kl_test=state["kl_init"], **val)
        print(f"before OPD: test KL to the teacher {state['kl_init']:.4f}")
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="opd", dynamic_ncols=True)
    for step in bar:
        idx = batch_indices(step, len(train), args.prompts_per_step, args.seed)
        examples = [train[i] for i in idx for _ in range(args.group)]
        prompts = [ex["prompt_ids"] for ex in examples]
        student.eval()  # [diffusion] the student's own trajectories, from the real decoder
        gen = torch.Generator(device=args.device).manual_seed(args.seed * 100003 + step)
        roll, _ = generate(student, tok, prompts, "diffusion", block, args.tau, max_new, len(prompts), args.temperature, gen,
                           **{**dec, "commit": args.rollout_commit})  # [diffusion] explore with the rollout rule
        student.train()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        kl_sum = 0.0
        for c in range(0, len(prompts), args.chunk):  # the teacher's distributions, chunk trajectories at a time
            part = roll.select(range(c, min(c + args.chunk, len(prompts))))
            for loss in opd_losses(student, teacher, prompts[c:c + args.chunk], part, block, tok.mask_token_id,
                                   tok.pad_token_id, args.reverse, args.clean_prefix, args.rows, args.pack):
                (loss / len(prompts)).backward()  # gradient accumulation: one chunk of replayed canvases at a time
                kl_sum += loss.item() / len(prompts)
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rows = metrics.score_responses([tok.decode(t) for t in roll.tokens], examples, sid)
        rec = {"step": step + 1, "kl": kl_sum, "rollout_valid_rate": metrics.summarize(rows)["valid_rate"],
               "rollout_tokens_per_forward": sum(map(len, roll.tokens)) / sum(roll.nfe)}
        bar.set_postfix(kl=f"{kl_sum:.4f}", valid=f"{rec['rollout_valid_rate']:.2f}",
                        tpf=f"{rec['rollout_tokens_per_forward']:.2f}")
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val, _ = validate(student, tok, valid, sid, "diffusion", block, max_new, args.eval_batch, **dec)
            rec.update(minutes=(time.time() - t0) / 60, **val)
            tqdm.write(f"step {step + 1:4d} | {rec['minutes']:5.1f} min | rollout KL {kl_sum:.4f} | tau=1.0 valid "
                       f"{val['val_valid_rate']:.3f} R@1 {val['val_recall1']:.3f} | tau=0.9 valid "
                       f"{val['val_valid_rate_0.9']:.3f} R@1 {val['val_recall1_0.9']:.3f}")
            score = val["val_valid_rate"] + val["val_valid_rate_0.9"] + val["val_recall1"] + val["val_recall1_0.9"]
            best = keep_best(out, student, tok, stage, opt, step + 1, val, score, best, t0, kl_init=state["kl_init"])
        log(**rec)

    student, tok, stage = load_best(out, args, "OPD", t0, tok)
    # metrics.json is written once, below, with the KL and agreement figures: run.sh takes it as "OPD finished"
    result = metrics.run_test(out, student, tok, test, sid, "diffusion", block, max_new, args.eval_batch, metrics.SPEED_TAUS,
                              args.tau_n, write_metrics=False, **dec)
    result["kl_to_teacher"] = {"init": state["kl_init"],
                               "final": test_kl(student, teacher, tok, kl_examples, block, max_new, 16, **dec)}
    print("test KL to the teacher: {init:.4f} (CFT) -> {final:.4f} (OPD)".format(**result["kl_to_teacher"]))
    answers = {"teacher": args.teacher, "init": args.init, "final": out}  # each run's test answers (the stage convention)
    missing = [str(run) for run in answers.values() if not (Path(run) / "predictions.jsonl").exists()]
    if missing:  # a parent stopped before its test (interrupted): no rankings to compare, the rest stands
        print(f"note: no predictions.jsonl in {', '.join(missing)}: agreement with the teacher not computed")
    else:
        preds = {k: metrics.read_jsonl(Path(run) / "predictions.jsonl") for k, run in answers.items()}
        result["teacher_agreement"] = {k: metrics.agreement(preds[k], preds["teacher"]) for k in ("init", "final")}
        for k, a in result["teacher_agreement"].items():  # init: the parent's answers, decoded with its own decoder
            print(f"agreement with the teacher's rankings ({k}): top-1 {a['top1_agreement']:.3f}, "
                  f"Kendall tau {a['kendall_tau']:.3f}")
    metrics.write_atomic(out / "metrics.json", json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
