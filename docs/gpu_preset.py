"""
Cost of the Qwen3-0.6B GPU preset, measured on a random-init model of its exact shape.

The README's "A GPU preset" section reports what this printed on one GPU. It needs no download: the
'qwen3-0.6b' preset of model.py has Qwen/Qwen3-0.6B's shape with random weights, and the data is
tokenized with the real Qwen3 tokenizer. Random weights say nothing about quality, only about cost:

    python data.py --tokenizer ../shared/data/qwen3-tokenizer --users 1500 --out data/synthetic-qwen3-small
    python docs/gpu_preset.py --data data/synthetic-qwen3-small --device cuda --json gpu_preset.json

With the preset's settings (bf16-mixed: float32 weights, gradients and AdamW state, bfloat16 compute),
each with its seconds and its peak GPU memory:
- one SFT step (batch 16, model.ar_loss) and one CFT step (batch 16, model.diffusion_loss): loss,
  backward and AdamW, as the stages do them less the gradient clipping;
- one rollout batch of OPD (prompts per step x G' trajectories, decode.generate at tau 0.9); a random
  model commits one token per forward, so it also gives the seconds per decoder forward at that batch;
- one OPD chunk (opd.opd_losses): the teacher's forward over --chunk trajectories and the backward
  over the first --rows replayed canvases;
- the decoder's forwards against cached prompts (decode.forward_seconds): a 1-token AR step and a
  block forward, at batch 1 and 16. On a GPU their ratio is what turns tokens per forward into speed.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's modules
import data  # noqa: E402
from decode import forward_seconds, generate, synchronize  # noqa: E402
from model import DTYPES, HelpFormatter, ar_loss, batch_indices, collate, create_model, diffusion_loss, init_mask_embedding  # noqa: E402
from opd import opd_losses  # noqa: E402

PARTS = ["sft", "cft", "rollout", "opd", "forward"]


def measure(fn, device, repeats):
    """(mean seconds of fn() over `repeats` calls after one untimed call, peak GiB allocated during them)."""
    fn()
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    synchronize(device)
    peak = round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None
    return {"seconds": round((time.perf_counter() - t0) / repeats, 4), "peak_gib": peak}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--data", default="data/synthetic-qwen3-small", help="folder written by data.py with the Qwen3 tokenizer")
    ap.add_argument("--model", default="qwen3-0.6b", help="random-init preset of model.PRESETS (micro: a CPU smoke run)")
    ap.add_argument("--dtype", default="bf16-mixed", choices=list(DTYPES), help="as the stages' --dtype")
    ap.add_argument("--device", default="cuda", help="torch device")
    ap.add_argument("--batch-size", type=int, default=16, help="SFT / CFT examples per step (the preset's)")
    ap.add_argument("--prompts-per-step", type=int, default=32, help="OPD prompts per step (the preset's)")
    ap.add_argument("--group", type=int, default=4, help="OPD trajectories per prompt (G')")
    ap.add_argument("--chunk", type=int, default=8, help="trajectories per teacher forward (opd.py --chunk)")
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32], help="replayed canvases per backward (opd.py --rows)")
    ap.add_argument("--parts", nargs="+", default=PARTS, choices=PARTS, help="what to measure")
    ap.add_argument("--block", type=int, default=32, help="block size")
    ap.add_argument("--max-new", type=int, default=0, help="rollout length in tokens (0 = the stages' budget for this data)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats of each training step")
    ap.add_argument("--json", default=None, help="write the measurements here")
    args = ap.parse_args(argv)
    print("config:", json.dumps(vars(args)))
    dev = torch.device(args.device)
    train, _ = data.load_split(args.data, "train")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(Path(args.data) / "tokenizer")
    max_new = args.max_new or data.max_new_tokens(train, args.block)
    model = create_model(args.model, tok, dtype=args.dtype).to(dev)
    init_mask_embedding(model, tok.mask_token_id, len(tok))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    res = {"model": args.model, "parameters": sum(p.numel() for p in model.parameters()), "dtype": args.dtype,
           "max_new": max_new, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "tokens_per_example": sum(len(ex["prompt_ids"]) + len(ex["response_ids"]) for ex in train) / len(train)}
    step = iter(range(10**9))

    def train_step(loss_of):
        def run():
            i = next(step)
            loss = loss_of(collate([train[j] for j in batch_indices(i, len(train), args.batch_size, 0)]), i)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return run

    model.train()
    if "sft" in args.parts:
        res["sft_step"] = measure(train_step(lambda b, i: ar_loss(model, b, pad_id=tok.pad_token_id)), dev, args.repeats)
        print("sft step", res["sft_step"])
    if "cft" in args.parts:
        res["cft_step"] = measure(train_step(lambda b, i: diffusion_loss(
            model, b, args.block, tok.mask_token_id, tok.eos_token_id, t_range=(0.02, 0.98), pad_id=tok.pad_token_id,
            generator=torch.Generator().manual_seed(i))[0]), dev, args.repeats)
        print("cft step", res["cft_step"])

    # OPD: the student's rollouts, then one chunk of the loss against a frozen teacher of the same shape
    prompts = [train[i]["prompt_ids"] for i in range(args.prompts_per_step) for _ in range(args.group)]
    model.eval()
    rollout = {}

    def roll(n):
        rollout["r"], _ = generate(model, tok, prompts[:n], "diffusion", args.block, 0.9, max_new, n, 1.0,
                                   torch.Generator(device=dev).manual_seed(0))
    if "rollout" in args.parts:
        res["opd_rollout"] = measure(lambda: roll(len(prompts)), dev, 1)
        forwards = max(rollout["r"].nfe)
        res["opd_rollout"].update(trajectories=len(prompts), forwards=forwards,
                                  seconds_per_forward=round(res["opd_rollout"]["seconds"] / forwards, 5))
        print("opd rollout", res["opd_rollout"])
    if "opd" in args.parts:
        if "r" not in rollout:
            roll(args.chunk)
        teacher = create_model(args.model, tok, dtype=args.dtype, seed=1).to(dev).eval().requires_grad_(False)
        part = rollout["r"].select(range(args.chunk))
        res["opd_replay_rows"] = sum(len(set(s for s in st if s >= 0)) for st in part.steps)  # canvases of the chunk
        model.train()
        for rows in args.rows:
            def opd_chunk():
                loss = next(opd_losses(model, teacher, prompts[:args.chunk], part, args.block, tok.mask_token_id,
                                       tok.pad_token_id, max_rows=rows))
                loss.backward()
                opt.zero_grad(set_to_none=True)
            try:
                res[f"opd_chunk_rows{rows}"] = measure(opd_chunk, dev, args.repeats)
            except torch.OutOfMemoryError:  # the answer to "does --rows N fit?" is a result too
                opt.zero_grad(set_to_none=True)
                res[f"opd_chunk_rows{rows}"] = "out of memory"
                torch.cuda.empty_cache()
            print(f"opd chunk, {rows} rows", res[f"opd_chunk_rows{rows}"])
        del teacher

    model.eval()
    for bs in (1, 16) if "forward" in args.parts else ():
        with torch.no_grad():
            t = forward_seconds(model, [train[i]["prompt_ids"] for i in range(bs)], (1, args.block))
        res[f"decoder_forward_batch{bs}"] = {"ar_step_s": round(t[1], 5), "block_forward_s": round(t[args.block], 5),
                                             "ratio": round(t[args.block] / t[1], 3)}
        print(f"decoder forwards, batch {bs}", res[f"decoder_forward_batch{bs}"])
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
