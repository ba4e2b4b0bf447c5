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
import teacher
from conftest import SHARED

ROOT = Path(__file__).resolve().parent.parent


def build(tmp_path, raw=None, seed=0, users=300, candidates=10, history=0, evidence=None, prompt_evidence=None):
    args = Namespace(raw=raw, seed=seed, users=users, candidates=candidates, codebook=0, history=history, title_words=0,
                     max_eval=None, evidence=evidence, prompt_evidence=prompt_evidence, tokenizer="word",
                     tmp=str(tmp_path / f"tmp{seed}{users}{bool(raw)}{prompt_evidence}"))
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


def test_candidates_keep_the_retriever_order(tmp_path):
    items, users = catalogue.make_synthetic(0, 300)
    index = {it["item"]: i for i, it in enumerate(items)}
    seqs = [[index[a] for a in u] for u in users]
    retr = catalogue.CoocRetriever(len(items)).fit([s[:-2] for s in seqs])
    splits = build(tmp_path)[0]
    for ex in splits["test"][:20]:
        hist = seqs[ex["user"]][:-1]
        assert retr.top_k([hist], 10)[0] == ex["candidates"]


def test_the_workshop_task_shows_the_retrievers_top_five_and_ranks_them_all(tmp_path):
    """--candidates 5 --history 3 (run.sh's workshop task): the retriever's top 5 in its order, the last 3 history
    items, one trace line and one ranking line per candidate, and an answer that is a permutation of the five."""
    items, users = catalogue.make_synthetic(0, 300)
    index = {it["item"]: i for i, it in enumerate(items)}
    seqs = [[index[a] for a in u] for u in users]
    retr = catalogue.CoocRetriever(len(items)).fit([s[:-2] for s in seqs])
    splits, _, sid, *_ = build(tmp_path, candidates=5, history=3)
    for ex in splits["test"][:20]:
        assert retr.top_k([seqs[ex["user"]][:-1]], 5)[0] == ex["candidates"]
        assert ex["history"] == seqs[ex["user"]][:-1][-3:]
    for ex in splits["train"][:20]:
        lines = ex["reasoning"].splitlines()
        assert [ln.split()[0] for ln in lines[2:7]] == ["c1", "c2", "c3", "c4", "c5"] and lines[7] == "ranking :"
        assert metrics.classify(metrics.parse_answer(ex["reasoning"] + ex["answer"]), [sid[c] for c in ex["candidates"]]) == "valid"


@pytest.mark.parametrize("k", [1, 11])
def test_a_candidate_count_the_teacher_cannot_weigh_is_refused(k, capsys):
    with pytest.raises(SystemExit) as exit:
        data.main(["--candidates", str(k), "--out", "unused"])
    assert exit.value.code == 2 and f"--candidates must be from 2 to 10, got {k}" in capsys.readouterr().err


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
    assert outs[0][-1]["source"] == "toy"  # a real catalogue is named after its files
    assert list(outs[0][-1]["teacher_weights"]) == list(teacher.EVIDENCE)  # and its teacher weighs every piece
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


def test_each_stated_score_adds_the_teachers_weights(small):
    """A score in the trace is the sum of the fitted weights of the evidence the line states (and its position)."""
    splits, _, _, _, _, stats = small
    weights = stats["teacher_weights"]
    named = [k for k in weights if k != "pos"]  # the pieces a line states, in order; the c-number gives the position
    for ex in splits["train"][:50]:
        for line in ex["reasoning"].split("\n"):
            if line.startswith("c") and " = " in line:
                stated, score = line.split(" = ")
                tag, _brand, _leaf, *pieces = stated.split()
                assert [p.rstrip("0123456789") for p in pieces] == named, line
                total = sum(weights[k][int(p[len(k):])] for k, p in zip(named, pieces))
                assert total + weights["pos"][int(tag[1:]) - 1] == int(score.split()[0]), line


def test_the_fitted_teacher_finds_a_planted_rule():
    """Targets chosen by a known rule (the candidate whose brand matches the last item, else the first category that
    follows): the fitted weights rank the planted evidence highest and put the target first."""
    rng = __import__("numpy").random.default_rng(0)
    evidences, targets = [], []
    for _ in range(400):
        ev = [(0, int(rng.integers(3)), int(rng.integers(2)), int(rng.integers(6)), int(rng.integers(5)),
               int(rng.integers(4)), p) for p in range(10)]
        j = int(rng.integers(10))
        ev[j] = (1,) + ev[j][1:]
        evidences.append(ev)
        targets.append(j)
    weights = teacher.fit_teacher(evidences, targets)
    assert weights["last"] == [0, 9] and max(max(t) for t in weights.values()) == 9
    assert all(teacher.rank_by(ev, weights)[0][0] == t for ev, t in zip(evidences, targets))


def test_placeholder_titles_are_not_evidence():
    items = [{"title": "title_495", "categories": [["Beauty", "Hair"]]}, {"title": "title_12", "categories": [["Beauty", "Skin"]]},
             {"title": "Belle silk shampoo", "categories": [["Beauty", "Hair"]]}]
    assert teacher.brand_of(items[0]) is None and teacher.title_terms(items[0]) == set()
    assert teacher.brand_of(items[2]) == "belle" and teacher.title_terms(items[2]) == {"silk", "shampoo"}
    last, brand, cat, follow, after_last, words, pos = teacher.evidence(items, [0], [1, 2], {})[0]
    assert (last, brand, words) == (0, 0, 0)  # two placeholders share no brand


def test_next_counts_purchases_right_after_the_last_item_without_the_users_own():
    items = [{"title": f"brand{i} thing", "categories": [["Beauty", "Hair"]]} for i in range(4)]
    train_seqs = [[0, 1, 2], [0, 1], [3, 0, 2], [0, 1, 0, 1]]  # 0 -> 1 four times, 0 -> 2 once, 1 -> 0 once
    follows = teacher.next_counts(train_seqs)
    assert follows == {(0, 1): 4, (1, 2): 1, (3, 0): 1, (0, 2): 1, (1, 0): 1}
    nxt = list(teacher.EVIDENCE).index("next")
    column = lambda own: [e[nxt] for e in teacher.evidence(items, [3, 0], [1, 2, 3], {}, follows, own)]
    assert column(()) == [3, 1, 0]  # buckets 0 / 1 / 2-3 / 4-7 / 8+: four times -> 3, once -> 1
    assert column(train_seqs[3]) == [2, 1, 0]  # a training example's own two 0 -> 1 leave two: bucket 2-3
    assert column(train_seqs[2]) == [3, 0, 0]
    assert [teacher.next_bucket(n) for n in (0, 1, 2, 3, 4, 7, 8, 50)] == [0, 1, 2, 2, 3, 3, 4, 4]


def test_the_teacher_weighs_the_pieces_asked_for(small, capsys):
    assert "next" not in small[-1]["teacher_weights"]  # the synthetic default (data.SOURCE_DEFAULTS)
    assert list(small[-1]["teacher_weights"]) == [k for k in teacher.EVIDENCE if k != "next"]
    with pytest.raises(SystemExit) as exit:
        data.main(["--evidence", "last,colour", "--out", "unused"])
    assert exit.value.code == 2 and "--evidence: no piece 'colour'" in capsys.readouterr().err


def test_the_prompt_states_the_evidence_asked_for_as_the_trace_does(tmp_path, small):
    """--prompt-evidence: each candidate's prompt line ends with the values its trace line states; nothing else moves."""
    splits, *_, stats = build(tmp_path, evidence="last,brand,cat,follow,next,words,pos", prompt_evidence="next,follow")
    assert stats["prompt_evidence"] == ["next", "follow"] and small[-1]["prompt_evidence"] == []
    for ex in splits["train"][:50]:
        _, cand_lines = data.prompt_lines(ex["prompt"])
        stated = {ln.split()[0]: ln.split() for ln in ex["reasoning"].split("\n") if ln.startswith("c") and " = " in ln}
        for p, line in enumerate(cand_lines):
            trace = stated[f"c{p + 1}"]
            want = [next(w for w in trace if w.rstrip("0123456789") == k) for k in ("next", "follow")]
            assert line.split(" | ")[-1].split() == want, (line, trace)
    for ex, plain in zip(splits["valid"], small[0]["valid"]):  # the same examples, each line only longer
        assert ex["id"] == plain["id"]
        assert [ln.rsplit(" | ", 1)[0] for ln in data.prompt_lines(ex["prompt"])[1]] == data.prompt_lines(plain["prompt"])[1]
    with pytest.raises(SystemExit):
        data.main(["--prompt-evidence", "colour", "--out", "unused"])


def test_the_teacher_beats_the_floor_and_is_reported(small):
    stats = small[-1]
    assert stats["source"] == "synthetic"
    assert stats["teacher"]["recall@1"] > stats["floor"]["recall@1"] + 0.05
    assert 0 < stats["teacher_kept_rate"] < 1


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
    code = ("import catalogue; items, _ = catalogue.make_synthetic(n_users=10); "
            "print(catalogue.semantic_ids(items, 16).tolist())")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")]
    assert runs[0] and runs[0] == runs[1]


ITEM = json.dumps({"item": "A", "title": "t", "categories": [["Beauty"]]})


def user(*items):
    return json.dumps({"user": "u", "items": list(items)})


ONE_REVIEW = {"reviews_Beauty_5.json.gz": gzip.compress(b'{"reviewerID": "U", "asin": "I", "unixReviewTime": 1}\n'),
              "meta_Beauty.json.gz": gzip.compress(b"{'asin': 'I', 'title': 't'}\n")}  # one review: no 5-core user
BAD_INPUT = {  # case: (files of the --raw folder, None for no folder; the error after the folder's path)
    "empty items file": ({"toy_items.jsonl": "", "toy_users.jsonl": user("A")}, "/toy_items.jsonl: no items"),
    "blank items file": ({"toy_items.jsonl": "\n \n", "toy_users.jsonl": user("A")}, "/toy_items.jsonl: no items"),
    "empty users file": ({"toy_items.jsonl": ITEM, "toy_users.jsonl": ""}, "/toy_users.jsonl: no users"),
    "malformed": ({"toy_items.jsonl": ITEM, "toy_users.jsonl": user("A") + "\n{not json"},
                  "/toy_users.jsonl:2: malformed JSON"),
    "not utf-8": ({"toy_items.jsonl": ITEM, "toy_users.jsonl": user("A").encode() + b"\n\xff\n"},
                  "/toy_users.jsonl:2: not UTF-8"),
    "not an object": ({"toy_items.jsonl": ITEM + "\n[1]", "toy_users.jsonl": user("A")},
                      "/toy_items.jsonl:2: expected a JSON object"),
    "missing field": ({"toy_items.jsonl": '{"item": "A", "title": "t"}', "toy_users.jsonl": user("A")},
                      "/toy_items.jsonl:1: missing field(s) ['categories']"),
    "wrong type": ({"toy_items.jsonl": ITEM, "toy_users.jsonl": '{"user": "u", "items": "A"}'},
                   "/toy_users.jsonl:1: field 'items' should be a list of strings"),
    "duplicate item": ({"toy_items.jsonl": ITEM + "\n" + ITEM, "toy_users.jsonl": user("A")},
                       "/toy_items.jsonl:2: item 'A' already on line 1"),
    "no metadata": ({"toy_items.jsonl": ITEM, "toy_users.jsonl": user("A", "Z")},
                    "/toy_users.jsonl:1: item 'Z' has no metadata"),
    "no metadata after a blank line": ({"toy_items.jsonl": ITEM, "toy_users.jsonl": user("A") + "\n\n" + user("Z")},
                                       "/toy_users.jsonl:3: item 'Z' has no metadata"),  # the blank line still counts
    "too short": ({"toy_items.jsonl": ITEM, "toy_users.jsonl": user("A")}, ": user #1 has 1 items"),
    "missing items file": ({"toy_users.jsonl": user("A")}, ": expected exactly one *items.jsonl"),
    "unknown format": ({"notes.txt": "hello"}, ": unknown format"),
    "no folder": (None, ": directory not found"),
    "every user filtered away": (ONE_REVIEW, "/reviews_Beauty_5.json.gz: no users with 5 or more"),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_is_reported_and_nothing_is_written(tmp_path, case, capsys):
    files, expected = BAD_INPUT[case]
    raw = tmp_path / "raw"
    for name, text in (files or {}).items():
        raw.mkdir(exist_ok=True)
        (raw / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    assert data.main(["--raw", str(raw), "--out", str(tmp_path / "new" / "out")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {raw}{expected}")
    assert [p.name for p in tmp_path.iterdir()] == (["raw"] if files else [])  # no output, temporary or parent folder


def test_a_rebuild_replaces_the_folder_and_leaves_nothing_beside_it(tmp_path):
    out = tmp_path / "syn"
    for users in (150, 160):
        assert data.main(["--users", str(users), "--out", str(out)]) in (0, None)
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
