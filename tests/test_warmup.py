"""warmup.py: its responses copy the candidates in a fresh random order, and sft.py starts from its weights."""
import json
import re

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

import data
import eval as metrics
import warmup
from model import create_model


def test_a_copy_response_lists_every_candidate_once_in_a_random_order(tiny_data):
    train, _, _, sid = data.load_splits(tiny_data, 1, 1)
    tok = AutoTokenizer.from_pretrained(tiny_data / "tokenizer")
    ex = train[0]
    orders = []
    for seed in range(4):
        copy = warmup.copy_example(ex, sid, tok, np.random.default_rng(seed))
        assert copy["prompt_ids"] == ex["prompt_ids"]
        text = tok.decode(copy["response_ids"])
        reasoning = tok.decode(copy["response_ids"][:copy["n_reasoning"]])
        assert reasoning.endswith("</think>") and copy["response_ids"][-1] == tok.eos_token_id
        # each line names a candidate by its number and copies that candidate's SID (word tokenizer: spaced tokens)
        lines = re.findall(r"c(\d+) ((?:<[a-d]_\d+> ?){4});", reasoning)
        order = [int(n) - 1 for n, _ in lines]
        assert sorted(order) == list(range(len(ex["candidates"])))
        assert [s.replace(" ", "") for _, s in lines] == [sid[ex["candidates"][p]] for p in order]
        row = metrics.score_responses([text], [ex], sid)[0]  # the answer follows the lines and is a valid ranking
        assert row["validity"] == "valid" and row["parsed"] == [sid[ex["candidates"][p]] for p in order]
        orders.append(order)
    assert len({tuple(o) for o in orders}) > 1  # the order comes from the generator, not from the example


def test_warmup_writes_a_checkpoint_that_sft_starts_from(tiny_data, tmp_path):
    out = tmp_path / "warmup"
    result = warmup.main(["--data", str(tiny_data), "--out", str(out), "--model", "micro", "--steps", "2",
                          "--eval-every", "2", "--batch-size", "2", "--val-n", "2", "--eval-batch", "2"])
    assert json.loads((out / "metrics.json").read_text()) == result and 0 <= result["val_copy_exact"] <= 1
    assert json.loads((out / "stage.json").read_text())["stage"] == "warmup"
    micro = create_model("micro", AutoTokenizer.from_pretrained(tiny_data / "tokenizer"))
    loaded = create_model(str(out), AutoTokenizer.from_pretrained(out))
    moved = [not torch.equal(a, b) for a, b in zip(micro.state_dict().values(), loaded.state_dict().values())]
    assert any(moved)  # two steps of training changed the micro init, and sft.py --model OUT loads the changed weights
    rates = warmup.main(["--data", str(tiny_data), "--out", str(tmp_path / "rates"), "--model", str(out), "--steps", "0",
                         "--val-n", "2", "--eval-batch", "2"])  # --steps 0 validates the saved model: the same rates
    assert {k: v for k, v in rates.items() if k != "minutes"} == {k: v for k, v in result.items() if k != "minutes"}
    assert set(rates) == {"minutes", "val_copy_exact", "val_copy_random_exact"} | {f"val_copy_{x}" for x in "abcd"}


def test_copy_accuracy_counts_a_sid_right_only_when_all_four_codes_are(tiny_data, monkeypatch):
    """With a stand-in for the model's logits: the true next token everywhere, then one code of one SID wrong."""
    _, valid, _, sid = data.load_splits(tiny_data, 3, 1)
    tok = AutoTokenizer.from_pretrained(tiny_data / "tokenizer")
    model = create_model("micro", tok)
    wrong = {"n": 0}

    def perfect_logits(model, prompts, responses, pad_id):
        target = torch.tensor([t for r in responses for t in r])
        logits = torch.nn.functional.one_hot(target, len(tok)).float()
        codes = [k for k, t in enumerate(target.tolist()) if warmup.SID_CODE.fullmatch(tok.convert_ids_to_tokens(t))]
        for k in codes[2:2 + wrong["n"]]:  # the 3rd code of the first SID (and on) predicted as another token
            logits[k] = torch.roll(logits[k], 1)
        return logits

    monkeypatch.setattr(warmup, "ar_logits", perfect_logits)
    n_sids = 3 * 2 * len(valid[0]["candidates"])  # each copy response writes every candidate twice (lines, answer)
    assert warmup.copy_accuracy(model, tok, valid, sid, batch_size=5) == (1.0, [1.0] * 4)
    wrong["n"] = 1
    miss = (n_sids - 1) / n_sids
    assert warmup.copy_accuracy(model, tok, valid, sid, batch_size=5) == (miss, [1.0, 1.0, miss, 1.0])
    wrong["n"] = 4  # codes 3-6: the last two of the first SID and the first two of the second
    assert warmup.copy_accuracy(model, tok, valid, sid, batch_size=5) == ((n_sids - 2) / n_sids, [miss] * 4)
    seen = []
    monkeypatch.setattr(warmup, "ar_logits", lambda m, prompts, *a: seen.extend(prompts) or perfect_logits(m, prompts, *a))
    codes = warmup.sid_codes(tok)  # random SIDs: the prompts the model reads show none of the catalogue's
    assert warmup.copy_accuracy(model, tok, valid, sid, 5, codes=codes) == ((n_sids - 2) / n_sids, [miss] * 4)
    shown = {s for p in seen for s in re.findall(r"(?:<[a-d]_\d+>){4}", tok.decode(p).replace(" ", ""))}
    assert len(seen) == 3 and shown and not shown & {sid[i] for ex in valid for i in ex["history"] + ex["candidates"]}


def test_the_curriculum_grows_the_prompt_from_one_candidate_to_the_whole_prompt():
    sizes = [warmup.prompt_size(step, 100, 0.5, 10, 6) for step in range(100)]
    assert sizes[0] == (1, 0) and sizes[50] == sizes[99] == (10, 6)
    assert all(a <= b and h <= g for (a, h), (b, g) in zip(sizes, sizes[1:]))  # it never shrinks
    assert len(set(sizes[:50])) > 5  # it grows step by step, not in one jump
    assert {warmup.prompt_size(step, 100, 0.0, 10, 6) for step in range(100)} == {(10, 6)}  # off: the whole prompt


def test_a_curriculum_prompt_keeps_some_candidates_renumbered_and_the_last_history_items(tiny_data):
    train, _, _, sid = data.load_splits(tiny_data, 1, 1)
    tok = AutoTokenizer.from_pretrained(tiny_data / "tokenizer")
    ex = next(e for e in train if len(e["history"]) >= 2)
    hist_lines, cand_lines = data.prompt_lines(ex["prompt"])
    assert data.layout_prompt(hist_lines, cand_lines) == ex["prompt"]  # the layout and its inverse
    copy = warmup.copy_example(ex, sid, tok, np.random.default_rng(0), n_cands=2, n_hist=1)
    prompt = tok.decode(copy["prompt_ids"])
    shown = [c for c in ex["candidates"] if sid[c] in prompt.replace(" ", "")]
    assert len(shown) == 2 and "c2 " in prompt and "c3 " not in prompt  # two of them, numbered c1 and c2
    assert sid[ex["history"][-1]] in prompt.replace(" ", "") and sid[ex["history"][-2]] not in prompt.replace(" ", "")
    reasoning = tok.decode(copy["response_ids"][:copy["n_reasoning"]]).replace(" ", "")
    assert sorted(re.findall(r"c(\d+)((?:<[a-d]_\d+>){4})", reasoning)) == [("1", sid[shown[0]]), ("2", sid[shown[1]])]


def test_random_sids_rewrite_prompt_and_response_alike_and_leave_the_rest(tiny_data):
    train, _, _, sid = data.load_splits(tiny_data, 1, 1)
    tok = AutoTokenizer.from_pretrained(tiny_data / "tokenizer")
    codes = warmup.sid_codes(tok)
    assert set(codes) == set("abcd") and all(warmup.SID_CODE.fullmatch(c) for level in codes.values() for c in level)
    ex = next(e for e in train if e["history"])
    rng = np.random.default_rng(0)
    new_ex, new_sid = warmup.with_random_sids(ex, sid, codes, rng)
    items = ex["history"] + ex["candidates"]
    assert set(new_sid) == set(items) and len(set(new_sid.values())) == len(new_sid)  # distinct within the example
    assert all(new_sid[i] != sid[i] for i in items)  # (a chance repeat of the real SID is 1 in ~10^7 here)
    for item in items:  # each item's line now shows its new SID in place of the catalogue's
        assert new_sid[item] in new_ex["prompt"] and sid[item] not in new_ex["prompt"]
        assert re.findall(r"<([a-d])_\d+>", new_sid[item]) == list("abcd")
    strip = lambda p: re.sub(r"<[a-d]_\d+>", "", p)
    assert strip(new_ex["prompt"]) == strip(ex["prompt"]) and ex["prompt"] != new_ex["prompt"]  # titles untouched
    assert new_ex["candidates"] == ex["candidates"] and train[train.index(ex)]["prompt"] == ex["prompt"]  # no mutation
    copy = warmup.copy_example(new_ex, new_sid, tok, rng)  # the response copies the new SIDs
    reasoning = tok.decode(copy["response_ids"][:copy["n_reasoning"]]).replace(" ", "")
    lines = dict(re.findall(r"c(\d+)((?:<[a-d]_\d+>){4})", reasoning))
    assert {int(n): s for n, s in lines.items()} == {p + 1: new_sid[c] for p, c in enumerate(ex["candidates"])}
    again = warmup.with_random_sids(ex, sid, codes, np.random.default_rng(0))[1]
    assert again == new_sid  # the generator decides (a resumed run draws the same SIDs)


def test_a_random_pool_gives_distinct_sids_that_share_prefixes(tiny_data):
    train, _, _, sid = data.load_splits(tiny_data, 1, 1)
    codes = warmup.sid_codes(AutoTokenizer.from_pretrained(tiny_data / "tokenizer"))
    ex = max(train, key=lambda e: len(e["history"]) + len(e["candidates"]))
    items = list(dict.fromkeys(ex["history"] + ex["candidates"]))
    new_ex, new_sid = warmup.with_random_sids(ex, sid, codes, np.random.default_rng(0), pool=3)
    assert len(set(new_sid.values())) == len(items)  # still one SID per item
    per_level = list(zip(*(re.findall(r"<[a-d]_\d+>", new_sid[i]) for i in items)))  # (levels, items)
    assert all(len(set(level)) <= 3 for level in per_level)  # each level from three codes: prefixes are shared
    assert len(set(per_level[0])) <= 3 < len(items)  # (so several items share their first code)
    assert all(new_sid[i] in new_ex["prompt"] for i in items)
    with pytest.raises(ValueError, match="distinct SIDs"):  # too few codes for the example's items
        warmup.with_random_sids(ex, sid, {k: v[:1] for k, v in codes.items()}, np.random.default_rng(0), pool=2)


def test_a_pool_too_small_for_the_data_is_refused_before_training(tiny_data, tmp_path, capsys):
    # the tiny catalogue's d level has one code: a pool of 2 gives 2 * 2 * 2 * 1 SIDs, fewer than an example's items
    assert len(warmup.sid_codes(AutoTokenizer.from_pretrained(tiny_data / "tokenizer"))["d"]) == 1
    with pytest.raises(SystemExit, match="--random-pool 2 gives 8 distinct SIDs, fewer than the"):
        warmup.main(["--data", str(tiny_data), "--out", str(tmp_path / "w"), "--model", "micro", "--steps", "2",
                     "--random-sids", "0.5", "--random-pool", "2"])
    assert not (tmp_path / "w" / "metrics.json").exists()


def test_sids_are_rewritten_in_one_pass():
    old = ["<a_1><b_2><c_3><d_0>", "<a_4><b_5><c_6><d_0>"]
    # the first item's new SID is the second's old one: a pass per item would rewrite it twice
    text = f"c1 {old[0]} ; c2 {old[1]} ; [{old[0]}{old[1]}]"
    new = warmup.rewrite_sids(text, {old[0]: old[1], old[1]: "<a_7><b_8><c_9><d_1>"})
    assert new == f"c1 {old[1]} ; c2 <a_7><b_8><c_9><d_1> ; [{old[1]}<a_7><b_8><c_9><d_1>]"
