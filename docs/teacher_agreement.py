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
"""
import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import catalogue  # noqa: E402
import data  # noqa: E402


def routine_rankings(data_dir):
    """{example id: the SIDs in the order the routine strategy ranks them}, rebuilt as data.py built them."""
    stats = json.load(open(Path(data_dir) / "stats.json"))
    if stats["source"] != "synthetic":
        raise SystemExit(f"error: {data_dir} is {stats['source']} data; the routine rule exists only in the synthetic world")
    items, users = catalogue.make_synthetic(stats["seed"], stats["users"])  # the same world, the same seed
    index = {it["item"]: i for i, it in enumerate(items)}
    train_seqs = [[index[a] for a in u][:-2] for u in users]  # data.build: training positions only
    next_leaf = data.next_leaf_table(items, train_seqs)
    test, sid = data.load_split(data_dir, "test")
    if [json.loads(line)["item"] for line in open(Path(data_dir) / "items.jsonl")] != [it["item"] for it in items]:
        raise SystemExit(f"error: {data_dir} was not built from make_synthetic({stats['seed']}, {stats['users']})")
    out = {}
    for ex in test:
        order, _ = data.rank_by(data.evidence(items, ex["history"], ex["candidates"], next_leaf), data.STRATEGIES["routine"])
        out[ex["id"]] = [sid[ex["candidates"][p]] for p in order]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("predictions", nargs="+", help="predictions*.jsonl files of test runs")
    ap.add_argument("--data", default="data/synthetic", help="the synthetic data folder the runs were tested on")
    args = ap.parse_args(argv)
    for path in args.predictions:
        if not Path(path).is_file():
            raise SystemExit(f"error: {path}: no such predictions file")
    routine = routine_rankings(args.data)
    for path in args.predictions:
        rows = [json.loads(line) for line in open(path)]
        strategies = Counter(p["response"].split("strategy ", 1)[1].split()[0] if "strategy " in p["response"] else "none"
                             for p in rows)
        valid = [p for p in rows if p["validity"] == "valid"]
        same = [p for p in valid if p["parsed"][0] == routine[p["id"]][0]]
        other = [p for p in valid if p["parsed"][0] != routine[p["id"]][0]]
        hits = lambda ps: sum(p["parsed"][0] == p["target"] for p in ps)  # noqa: E731
        ceiling = sum(routine[p["id"]][0] == p["target"] for p in rows) / len(rows)
        print(f"{path}: n {len(rows)}, strategies {dict(strategies)}, valid {len(valid)}; "
              f"routine's first item first {len(same)} (Recall@1 {hits(same)}/{len(same)}), "
              f"another first {len(other)} ({hits(other)}/{len(other)}), whole routine ranking {sum(p['parsed'] == routine[p['id']] for p in valid)}; "
              f"the rule itself: Recall@1 {ceiling:.3f}")


if __name__ == "__main__":
    main()
