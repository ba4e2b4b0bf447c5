"""
How much of a model's Recall@1 is lost to reasoning errors (synthetic data only).

Every model of this recipe writes `strategy routine` in its reasoning on every test prompt (the trace
teacher's usual habit). The routine strategy is a fixed rule over evidence the prompt shows, so for each
test example we can compute the ranking the model *should* have written (data.evidence + data.rank_by,
the teacher's own functions) and compare it with the answer the model did write:

    python docs/teacher_agreement.py out/sft/predictions.jsonl out/cft/predictions.jsonl ...

For each predictions file (written by every stage, see eval.run_test) it prints: how many answers are
valid, how many of those put the routine ranking's first item first (and their Recall@1), how many put
another item first (and theirs), how many copy the whole routine ranking, and the Recall@1 the routine
rule itself reaches on the same examples: the ceiling of a model that reasons this way without error.

`--choice` asks whether a policy could do better by choosing the strategy per prompt (what RL could
learn beyond the teacher's habit): it prints each strategy's test Recall@1, that of a linear chooser
fitted on the validation examples' evidence, and that of an oracle that knows which strategy is right.
"""
import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import catalogue  # noqa: E402
import data  # noqa: E402


def synthetic_world(data_dir):
    """The catalogue and the routine table data.py built `data_dir` from (same seed, same user count)."""
    stats = json.load(open(Path(data_dir) / "stats.json"))
    if stats["source"] != "synthetic":
        raise SystemExit(f"error: {data_dir} is {stats['source']} data; the routine rule exists only in the synthetic world")
    items, users = catalogue.make_synthetic(stats["seed"], stats["users"])
    if [json.loads(line)["item"] for line in open(Path(data_dir) / "items.jsonl")] != [it["item"] for it in items]:
        raise SystemExit(f"error: {data_dir} was not built from make_synthetic({stats['seed']}, {stats['users']})")
    index = {it["item"]: i for i, it in enumerate(items)}
    train_seqs = [[index[a] for a in u][:-2] for u in users]  # data.build: training positions only
    return items, data.next_leaf_table(items, train_seqs)


def strategy_orders(world, examples):
    """Per example: {strategy: candidate positions in the order that strategy ranks them}, and the evidence."""
    items, next_leaf = world
    out = []
    for ex in examples:
        ev = data.evidence(items, ex["history"], ex["candidates"], next_leaf)
        out.append(({name: data.rank_by(ev, w)[0] for name, w in data.STRATEGIES.items()}, ev))
    return out


def routine_rankings(data_dir, world=None):
    """{test example id: the SIDs in the order the routine strategy ranks them}."""
    test, sid = data.load_split(data_dir, "test")
    orders = strategy_orders(world or synthetic_world(data_dir), test)
    return {ex["id"]: [sid[ex["candidates"][p]] for p in o["routine"]] for ex, (o, _) in zip(test, orders)}


def strategy_choice(data_dir, world, steps=500):
    """Test Recall@1 of: each strategy alone, a linear chooser of the strategy per prompt (logistic
    regressions on the prompt's evidence, fitted on the validation examples), and an oracle that knows
    which strategy puts the target first. How much better than the teacher's habit a policy could choose."""
    def hits_and_features(split):
        rows, _ = data.load_split(data_dir, split)
        X, Y = [], []
        for ex, (orders, ev) in zip(rows, strategy_orders(world, rows)):
            firsts = [orders[name][0] for name in data.STRATEGIES]
            X.append([v for e in ev for v in e] + [float(a == b) for i, a in enumerate(firsts) for b in firsts[i + 1:]])
            Y.append([float(ex["candidates"][f] == ex["target"]) for f in firsts])
        return torch.tensor(X), torch.tensor(Y)
    (X, Y), (X_test, Y_test) = hits_and_features("valid"), hits_and_features("test")
    torch.manual_seed(0)
    W, b = torch.zeros(X.shape[1], Y.shape[1], requires_grad=True), torch.zeros(Y.shape[1], requires_grad=True)
    opt = torch.optim.Adam([W, b], lr=0.05)
    for _ in range(steps):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(X @ W + b, Y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    pick = (X_test @ W + b).argmax(1)
    return {**dict(zip(data.STRATEGIES, Y_test.mean(0).tolist())),
            "learned chooser": Y_test[torch.arange(len(Y_test)), pick].mean().item(),
            "oracle": Y_test.max(1).values.mean().item()}


def target_first(predictions):
    """How many of these (valid) answers put the target first."""
    return sum(p["parsed"][0] == p["target"] for p in predictions)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("predictions", nargs="+", help="predictions*.jsonl files of test runs")
    ap.add_argument("--data", default="data/synthetic", help="the synthetic data folder the runs were tested on")
    ap.add_argument("--choice", action="store_true", help="also: could a policy choose the strategy per prompt better "
                    "than the teacher's habit? (each strategy, a linear chooser fitted on valid, the oracle)")
    args = ap.parse_args(argv)
    for path in args.predictions:
        if not Path(path).is_file():
            raise SystemExit(f"error: {path}: no such predictions file")
    world = synthetic_world(args.data)
    routine = routine_rankings(args.data, world)
    if args.choice:
        print("test Recall@1 of the strategy choice:",
              ", ".join(f"{k} {v:.3f}" for k, v in strategy_choice(args.data, world).items()))
    for path in args.predictions:
        rows = [json.loads(line) for line in open(path)]
        unknown = [p["id"] for p in rows if p["id"] not in routine]
        if unknown:
            raise SystemExit(f"error: {path}: {len(unknown)} examples (first {unknown[0]!r}) are not test examples of {args.data}")
        strategies = Counter(p["response"].split("strategy ", 1)[1].split()[0] if "strategy " in p["response"] else "none"
                             for p in rows)
        valid = [p for p in rows if p["validity"] == "valid"]
        same = [p for p in valid if p["parsed"][0] == routine[p["id"]][0]]
        other = [p for p in valid if p["parsed"][0] != routine[p["id"]][0]]
        ceiling = sum(routine[p["id"]][0] == p["target"] for p in rows) / len(rows)
        print(f"{path}: n {len(rows)}, strategies {dict(strategies)}, valid {len(valid)}; "
              f"routine's first item first {len(same)} (Recall@1 {target_first(same)}/{len(same)}), "
              f"another first {len(other)} ({target_first(other)}/{len(other)}), whole routine ranking {sum(p['parsed'] == routine[p['id']] for p in valid)}; "
              f"the rule itself: Recall@1 {ceiling:.3f}")


if __name__ == "__main__":
    main()
