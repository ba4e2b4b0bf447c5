"""
Where a parallel decode goes wrong: the first token of each invalid answer that the one-token decoder
would not have written, and the step that committed it (the README's "Where the errors are").

With a left-to-right commit rule (`prefix`, `prefix-joint`) a block is always written from its leftmost
mask, so up to the first token where a tau < 1 answer departs from the same model's tau = 1.0 answer, the
two decodes saw the same canvases. A step's leftmost position therefore reads the logits tau = 1.0 read and
commits the same token: the departure is always a position committed *beside* the ones to its left,
predicted while they were still masks. For every answer that is invalid at `--tau`, this script finds that
token and prints the step that committed it (the confidences of its positions, the one that went wrong,
how many masks stood left of it), then counts the departures by the kind of token that went wrong.

    python docs/first_error.py --ckpt out/cft --data data/synthetic --tau 0.9 --n 200
"""
import argparse
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import data  # noqa: E402
import eval as metrics  # noqa: E402
from decode import COMMIT_RULES, diffusion_generate, inherited_decoder, pick  # noqa: E402
from model import DTYPES, load_checkpoint, resolve_dtype  # noqa: E402


def token_kind(text):
    """What a token of the trace is: a SID code (by level), a candidate number, a number, or a word."""
    if m := re.fullmatch(r"<([a-d])_\d+>", text):
        return f"SID code {'abcd'.index(m.group(1)) + 1}"
    if re.fullmatch(r"c\d+", text):
        return "candidate number"
    return "number" if text.isdigit() else "word"


def decode_with_steps(model, tok, prompts, block, tau, max_new, dec, batch_size):
    """Greedy block-diffusion answers of `prompts` with, per answer, {(block, step): (committed positions,
    their confidences)}: what each denoising step committed."""
    rolls, steps_of = [], []
    for lo in range(0, len(prompts), batch_size):
        part, log = prompts[lo:lo + batch_size], {}

        def on_step(b, s, canvas, chosen, logits):
            log[b, s] = (chosen.cpu(), pick(logits.float(), 0.0, None)[1].cpu())  # (B, block): what the rule compared with tau

        rolls.append(diffusion_generate(model, part, block, tau, max_new, tok.mask_token_id, tok.eos_token_id,
                                        tok.pad_token_id, on_step=on_step, **dec))
        steps_of += [{key: (c[i].nonzero()[:, 0].tolist(), p[i]) for key, (c, p) in log.items()} for i in range(len(part))]
    return [t for r in rolls for t in r.tokens], [s for r in rolls for s in r.steps], steps_of


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True, help="a block-diffusion checkpoint (cft, opd or rl)")
    ap.add_argument("--data", required=True, help="its data folder")
    ap.add_argument("--tau", type=float, default=0.9, help="the parallel threshold to look at (below 1.0)")
    ap.add_argument("--n", type=int, default=200, help="first n test examples")
    ap.add_argument("--commit", choices=COMMIT_RULES, default=None, help="commit rule (default: the checkpoint's)")
    ap.add_argument("--batch-size", type=int, default=64, help="prompts decoded together")
    ap.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="compute dtype, as the stages' --dtype")
    ap.add_argument("--quiet", action="store_true", help="print the summary only")
    args = ap.parse_args(argv)
    if not 0 < args.tau < 1:
        ap.error(f"--tau must be below 1.0 (1.0 is the reference decode), got {args.tau}")
    model, tok, stage = load_checkpoint(args.ckpt, dtype=resolve_dtype(args.dtype))
    if not stage.get("block_size"):
        raise SystemExit(f"error: {args.ckpt} is an AR checkpoint; this looks at block-diffusion decoding")
    model.eval()
    dec = inherited_decoder(stage, None, args.commit)
    if not dec["commit"].startswith("prefix"):
        print(f"note: with --commit {dec['commit']} a step's first commit need not be the leftmost mask, so the "
              "departure can also be a token tau = 1.0 would have written elsewhere")
    block, max_new = stage["block_size"], stage["max_new"]
    examples, sid = data.load_split(args.data, "test", args.n)
    prompts = [ex["prompt_ids"] for ex in examples]

    tokens, steps, logs = decode_with_steps(model, tok, prompts, block, args.tau, max_new, dec, args.batch_size)
    rows = metrics.score_responses([tok.decode(t) for t in tokens], examples, sid)
    bad = [i for i, r in enumerate(rows) if r["validity"] != "valid"]
    print(f"{args.ckpt}: {len(bad)} of {len(examples)} answers invalid at tau = {args.tau} ({dec['commit']} rule)")
    if not bad:
        return {"invalid": 0}
    ref = decode_with_steps(model, tok, [prompts[i] for i in bad], block, 1.0, max_new, dec, args.batch_size)[0]

    wrong_kind, after, beside, step_size, same_as_ref = Counter(), Counter(), Counter(), Counter(), 0
    for i, r in zip(bad, ref):
        a = tokens[i]
        d = next((j for j in range(min(len(a), len(r))) if a[j] != r[j]), None)
        if d is None:  # the tau = 1.0 answer is just as invalid
            same_as_ref += 1
            continue
        b, pos = divmod(d, block)
        committed, conf = logs[i][b, steps[i][d]]
        left = sum(p < pos for p in committed)  # positions committed with it, left of it: masks in its canvas
        kind = token_kind(tok.convert_ids_to_tokens(a[d]))
        wrong_kind[kind] += 1
        after[f"{token_kind(tok.convert_ids_to_tokens(a[d - 1])) if d else 'prompt'} -> {kind}"] += 1
        beside[left] += 1
        step_size[len(committed)] += 1
        if not args.quiet:
            confs = ", ".join(f"{'*' if p == pos else ''}{conf[p]:.3f}" for p in committed)
            print(f"test {i:4d}: token {d} (block {b}, step {steps[i][d]}), {len(committed)} committed [{confs}], "
                  f"{left} left of it | ...{tok.decode(a[max(0, d - 5):d])!r} wrote {tok.decode(a[d:d + 1])!r}, "
                  f"tau = 1.0 wrote {tok.decode(r[d:d + 1])!r}")
    n = sum(wrong_kind.values())
    print(f"{n} answers depart from the tau = 1.0 answer ({same_as_ref} are invalid at tau = 1.0 too).")
    print("the departing token is:", ", ".join(f"{k} {v}" for k, v in wrong_kind.most_common()))
    print("the token before it -> the departing token:", ", ".join(f"{k} {v}" for k, v in after.most_common()))
    print("positions committed left of it in its step:", ", ".join(f"{k}: {v}" for k, v in sorted(beside.items())))
    print("tokens its step committed:", ", ".join(f"{k}: {v}" for k, v in sorted(step_size.items())))
    return {"invalid": len(bad), "departures": n, "same_as_tau1": same_as_ref, "kind": dict(wrong_kind), "after": dict(after),
            "left_of_it": dict(beside), "step_size": dict(step_size)}


if __name__ == "__main__":
    main()
