"""data.py and catalogue.py: the protocol (no leakage), SIDs, traces, determinism, readers and bad input."""
import gzip
import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

import catalogue
import data
import eval as metrics
from conftest import SHARED

ROOT = Path(__file__).resolve().parent.parent


def build(tmp_path, raw=None, seed=0, users=300, ranking="sid"):
    args = Namespace(source="beauty" if raw else "synthetic", raw=raw, seed=seed, users=users, codebook=0, history=0,
                     title_words=0, max_eval=None, tokenizer="word", ranking=ranking,
                     tmp=str(tmp_path / f"tmp{seed}{users}{bool(raw)}{ranking}"))
    return data.build(args, log=lambda *a: None)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return build(tmp_path_factory.mktemp("syn"))


def test_examples_follow_the_protocol(small):
    splits, items, sid, codes, tok, stats = small
    for split, rows in splits.items():
        assert rows, split
        for ex in rows:
            cands = ex["candidates"]
            assert len(cands) == 10 == len(set(cands)) and cands.count(ex["target"]) == 1
            assert ex["target"] not in ex["history"] and not set(cands) & set(ex["history"])
            assert [f"c{p + 1} {sid[c]}" in ex["prompt"] for p, c in enumerate(cands)] == [True] * 10


def test_index_ranking_drops_the_sids_from_the_reasoning_only(small, tmp_path):
    splits, *_ = small
    index = build(tmp_path, ranking="index")[0]
    for ex, ix in zip(splits["train"][:50], index["train"][:50]):
        assert ix["answer"] == ex["answer"] and ix["prompt"] == ex["prompt"]
        ranking = ix["reasoning"].split("ranking :")[1]
        assert not metrics.SID_RE.search(ranking) and ranking.count(" ;") == 10
        assert ex["reasoning"].split("ranking :")[0] == ix["reasoning"].split("ranking :")[0]


def test_candidates_keep_the_retriever_order(tmp_path):
    items, users = catalogue.make_synthetic(0, 300)
    index = {it["item"]: i for i, it in enumerate(items)}
    seqs = [[index[a] for a in u] for u in users]
    retr = data.CoocRetriever(len(items)).fit([s[:-2] for s in seqs])
    splits = build(tmp_path)[0]
    for ex in splits["test"][:20]:
        hist = seqs[ex["user"]][:-1]
        assert retr.top_k([hist], 10)[0] == ex["candidates"]


def test_validation_and_test_items_never_reach_training(tmp_path):
    """Change every user's last two items: the training split, counts and traces must not move."""
    items, users = catalogue.make_synthetic(0, 300)
    changed = []
    for k, u in enumerate(users):
        pool = [it["item"] for it in items if it["item"] not in u]
        changed.append(u[:-2] + [pool[(7 * k) % len(pool)], pool[(7 * k + 3) % len(pool)]])
    outs = []
    for name, us in (("a", users), ("b", changed)):
        raw = tmp_path / name
        catalogue.write_jsonl_layout(items, us, raw, "toy")
        outs.append(build(tmp_path, raw=str(raw)))
    assert outs[0][0]["train"] == outs[1][0]["train"]
    assert outs[0][0]["test"] != outs[1][0]["test"]  # (the test split does change)


def test_semantic_ids_are_unique(small):
    _, items, sid, codes, _, stats = small
    assert len(set(sid)) == len(items) and stats["sid_unique_rate"] == 1.0
    assert codes.shape == (len(items), 4)


def test_every_training_answer_is_a_valid_permutation_led_by_the_target(small):
    splits, items, sid, *_ = small
    for ex in splits["train"]:
        text = ex["reasoning"] + ex["answer"]
        ranking, kind, _ = metrics.judge(text, [sid[c] for c in ex["candidates"]])
        assert kind == "valid" and ranking[0] == sid[ex["target"]]


def test_the_answer_follows_the_stated_scores(small):
    splits, _, sid, *_ = small
    for ex in splits["train"][:50]:
        lines = ex["reasoning"].split("\n")
        scores = {ln.split()[0]: int(ln.split("= ")[1].split()[0]) for ln in lines if ln.startswith("c") and "=" in ln}
        ranked = [ln.split()[1] for ln in lines[lines.index("ranking :") + 1:-1]]
        key = lambda tag: (-scores[tag], int(tag[1:]))
        assert ranked == sorted(scores, key=key)


def test_tokenized_lengths_and_reasoning_split(small):
    splits, _, _, _, tok, _ = small
    ex = splits["train"][0]
    assert tok.decode(ex["response_ids"][:ex["n_reasoning"]]).startswith("<think>")
    assert tok.convert_ids_to_tokens(ex["response_ids"][ex["n_reasoning"] - 1]) == "</think>"
    assert ex["response_ids"][-1] == tok.eos_token_id
    assert max(max(e["prompt_ids"] + e["response_ids"]) for e in splits["train"]) < len(tok)


def test_same_seed_same_data(tmp_path):
    a, b = build(tmp_path, seed=3, users=150), build(tmp_path, seed=3, users=150)
    assert a[0] == b[0] and a[2] == b[2]
    assert build(tmp_path, seed=4, users=150)[0]["train"] != a[0]["train"]


def test_semantic_ids_do_not_depend_on_the_hash_seed():
    """Python randomises string hashing per process: set order must never reach the SIDs."""
    code = ("import catalogue, data; items, _ = catalogue.make_synthetic(n_users=10); "
            "print(data.semantic_ids(items, 16).tolist())")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")]
    assert runs[0] and runs[0] == runs[1]


def write_lines(path, lines):
    Path(path).write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("case, expected", [
    ("missing", "expected exactly one *items.jsonl"),
    ("malformed", "toy_users.jsonl:2: malformed JSON"),
    ("no_meta", "toy_users.jsonl:1: item 'Z' has no metadata"),
    ("no_meta_after_blank", "toy_users.jsonl:3: item 'Z' has no metadata"),  # a blank line is skipped, still counted
    ("unknown", "unknown format"),
])
def test_bad_input_is_reported_and_nothing_is_written(tmp_path, case, expected, capsys):
    raw = tmp_path / "raw"
    raw.mkdir()
    item = json.dumps({"item": "A", "title": "t", "categories": [["Beauty"]]})
    if case != "unknown":
        users = [json.dumps({"user": "u", "items": ["A", "Z" if case == "no_meta" else "A"]}),
                 "{not json" if case == "malformed" else json.dumps({"user": "v", "items": ["A"]})]
        if case == "no_meta_after_blank":
            users = [users[1], "", json.dumps({"user": "w", "items": ["Z"]})]
        write_lines(raw / "toy_users.jsonl", users)
    if case not in ("missing", "unknown"):
        write_lines(raw / "toy_items.jsonl", [item])
    if case == "unknown":
        write_lines(raw / "notes.txt", ["hello"])
    out = tmp_path / "out"
    assert data.main(["--source", "beauty", "--raw", str(raw), "--out", str(out)]) == 2
    assert expected in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".out.tmp*"))


def test_a_rebuild_replaces_the_folder_and_leaves_nothing_beside_it(tmp_path):
    out = tmp_path / "syn"
    for users in (150, 160):
        assert data.main(["--source", "synthetic", "--users", str(users), "--out", str(out)]) in (0, None)
    assert json.loads((out / "stats.json").read_text())["users"] == 160
    assert sorted(p.name for p in tmp_path.iterdir()) == ["syn"]  # no temporary or old folder left


def test_reads_mcauley_files_sorted_by_time(tmp_path):
    reviews = [{"reviewerID": f"U{u}", "asin": f"I{(u + k) % 7}", "unixReviewTime": 100 - k} for u in range(7) for k in range(5)]
    with gzip.open(tmp_path / "reviews_Beauty_5.json.gz", "wt") as f:
        f.write("\n".join(json.dumps(r) for r in reviews) + "\n")
    with gzip.open(tmp_path / "meta_Beauty.json.gz", "wt") as f:  # Python literals, as McAuley's 2014 files
        f.write("\n".join(repr({"asin": f"I{i}", "title": f"Brand{i} thing &amp; co", "categories": [["Beauty", "X"]]})
                          for i in range(7)) + "\n")
    items, users = catalogue.load_catalogue(tmp_path)
    assert len(users) == 7 and all(len(u) == 5 for u in users)
    assert users[0] == ["I4", "I3", "I2", "I1", "I0"]  # oldest review first
    assert items[0]["title"].endswith("& co")


@pytest.mark.skipif(not (SHARED / "amazon-beauty").exists(), reason="shared Beauty copy not present")
def test_amazon_beauty_counts():
    items, users = catalogue.read_jsonl_layout(SHARED / "amazon-beauty")
    assert (len(users), len(items), sum(map(len, users))) == (22363, 12101, 198502)


@pytest.mark.skipif(not (SHARED / "qwen3-tokenizer").exists(), reason="shared Qwen3 tokenizer not present")
def test_qwen3_tokenizer_gets_mask_and_sid_tokens():
    tok = data.load_hub_tokenizer(str(SHARED / "qwen3-tokenizer"), ["<a_0>", "<b_0>", "<c_0>", "<d_0>"])
    assert tok.mask_token_id == 151669
    assert tok("[<a_0><b_0><c_0><d_0>]", add_special_tokens=False).input_ids[1:5] == list(range(151670, 151674))


def test_teacher_agreement_rebuilds_the_routine_rule_of_the_data(tmp_path):
    """docs/teacher_agreement.py re-derives the teacher's routine ranking; it must match what data.py scored."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("teacher_agreement", ROOT / "docs" / "teacher_agreement.py")
    agreement = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agreement)
    out = tmp_path / "syn"
    assert data.main(["--users", "300", "--out", str(out)]) == 0
    routine = agreement.routine_rankings(out)
    test, sid = data.load_split(out, "test")
    recall1 = sum(routine[ex["id"]][0] == sid[ex["target"]] for ex in test) / len(test)
    stats = json.loads((out / "stats.json").read_text())
    assert sorted(routine) == sorted(ex["id"] for ex in test)
    assert recall1 == pytest.approx(stats["strategy_recall@1_test"]["routine"])
    choice = agreement.strategy_choice(out, agreement.synthetic_world(out), steps=20)
    for name, value in stats["strategy_recall@1_test"].items():  # every strategy re-derived, not only routine
        assert choice[name] == pytest.approx(value)
    assert max(stats["strategy_recall@1_test"].values()) <= choice["oracle"] and choice["learned chooser"] <= choice["oracle"]
