"""eval.py: parsing, validity classes, metrics on hand-computed cases, reward, bootstrap."""
import math

import pytest

import eval as metrics

C = [metrics.sid_str(i, i + 1, i + 2, 0) for i in range(10)]  # ten candidate SIDs


def answer(sids, think=True):
    return ("<think> some reasoning </think>" if think else "") + "\n\n[" + "".join(sids) + "]"


def test_parse_tolerates_spaces_between_sid_tokens():
    text = "<think> x </think> [ <a_1> <b_2> <c_3> <d_0> <a_4><b_5><c_6><d_1> ]"
    assert metrics.parse_answer(text) == ["<a_1><b_2><c_3><d_0>", "<a_4><b_5><c_6><d_1>"]


@pytest.mark.parametrize("text, kind", [
    (answer(C), "valid"),
    (answer(C[::-1]), "valid"),
    (answer(C, think=False), "parse_error"),                       # no </think>
    ("<think> x </think> " + "".join(C), "parse_error"),           # no list
    ("<think> x </think> [" + "".join(C[:5]) + " junk " + "".join(C[5:]) + "]", "parse_error"),
    ("<think> x </think> [<a_1><b_2>]", "parse_error"),           # a broken SID
    (answer(C[:9] + [metrics.sid_str(99, 0, 0, 0)]), "out_of_set"),
    (answer(C[:9] + [C[0]]), "duplicate"),
    (answer(C[:9]), "omission"),
])
def test_validity_classes(text, kind):
    assert metrics.judge(text, C)[1] == kind


def test_invalid_answers_fall_back_to_the_retriever_order():
    ranking, kind, _ = metrics.judge(answer(C[:9] + [C[0]]), C)
    assert kind == "duplicate" and ranking == C


def test_rank_metrics_by_hand():
    m = metrics.rank_metrics(["x", "t", "y"], "t")  # target at rank 2
    assert m["recall@1"] == 0 and m["recall@3"] == 1 and m["recall@5"] == 1
    assert m["ndcg@3"] == pytest.approx(1 / math.log2(3)) and m["ndcg@5"] == pytest.approx(0.6309297535714575)
    m = metrics.rank_metrics(["a", "b", "c", "t"], "t")  # rank 4: outside the top 3
    assert m["recall@3"] == 0 and m["ndcg@3"] == 0 and m["ndcg@5"] == pytest.approx(1 / math.log2(5))


def test_summary_counts_the_invalid_kinds():
    rows = [{"validity": "valid", "copies_retriever": False, **metrics.rank_metrics(["t"], "t")},
            {"validity": "duplicate", "copies_retriever": False, **metrics.rank_metrics(["x", "t"], "t")}]
    s = metrics.summarize(rows)
    assert s["valid_rate"] == 0.5 and s["invalid"]["duplicate"] == 1 and s["recall@1"] == 0.5 and s["n"] == 2


def test_identity_rate_counts_only_valid_copies_of_the_retriever_order():
    examples = [{"candidates": list(range(10)), "target": 4}] * 4
    sid_of = {i: C[i] for i in range(10)}
    texts = [answer(C), answer(C[::-1]), answer(C[:9] + [C[0]]), answer(C, think=False)]  # copy, re-order, 2 invalid
    rows = metrics.score_responses(texts, examples, sid_of)
    assert [r["copies_retriever"] for r in rows] == [True, False, False, False]
    assert metrics.summarize(rows)["identity_rate"] == 0.25  # the invalid ones fall back to that order, uncounted
    assert metrics.summarize(metrics.floor_rows(examples))["identity_rate"] == 1.0


def test_floor_of_an_all_invalid_model_is_the_retriever():
    examples = [{"candidates": list(range(10)), "target": t} for t in (0, 3, 9)]
    sid_of = {i: C[i] for i in range(10)}
    rows = metrics.score_responses(["garbage"] * 3, examples, sid_of)
    got, floor = metrics.summarize(rows), metrics.summarize(metrics.floor_rows(examples))
    assert all(got[k] == floor[k] for k in metrics.METRIC_KEYS) and got["recall@3"] == 1 / 3 and got["valid_rate"] == 0


def test_reward_cases():
    target = C[4]  # the retriever put it fifth
    promoted = [C[4]] + C[:4] + C[5:]
    assert metrics.rerank_reward(answer(promoted), C, target) == pytest.approx(4 / 10 + 0.2)
    demoted = C[:4] + C[5:] + [C[4]]
    assert metrics.rerank_reward(answer(demoted), C, target) == pytest.approx(-5 / 10)
    assert metrics.rerank_reward(answer(C), C, target) == 0.0  # copying the retriever order earns nothing
    assert metrics.rerank_reward(answer(C), C, C[0]) == pytest.approx(0.2)  # already first and kept first
    assert metrics.rerank_reward(answer(C[1:] + [C[0]]), C, C[0]) == pytest.approx(-0.9)
    for bad in (answer(C, think=False), answer(C[:9] + [C[0]]), answer(C[:9]), answer(C[:9] + [metrics.sid_str(99, 0, 0, 0)])):
        assert metrics.rerank_reward(bad, C, target) == -1.0


def test_bootstrap_intervals():
    lo, hi = metrics.bootstrap_ci([0, 1] * 50)
    assert lo < 0.5 < hi and hi - lo < 0.3
    mean, lo, hi = metrics.paired_bootstrap([0] * 50 + [1] * 50, [1] * 100)
    assert mean == 0.5 and lo > 0


def trace(lines, answer_sids, scores=(5, 5, 2)):
    """A response in teacher.teacher_trace's format for the first three candidates of C."""
    evidence = " ".join(f"c{k + 1} brand item brand0 cat0 next0 top0 = {s} ;" for k, s in enumerate(scores))
    ranking = " ".join(f"{s} c{k} " + (" ".join(sid.replace("><", "> <").split()) + " " if sid else "") + ";"
                       for s, k, sid in lines)  # sid None: a ranking line whose SID the model left out
    return f"<think> {evidence} ranking : {ranking} </think> [" + "".join(answer_sids) + "]"


@pytest.mark.parametrize("lines, answer_sids, cause", [
    ([(5, 1, C[0]), (5, 1, C[0]), (2, 3, C[2])], [C[0], C[0], C[2]], "tie repeated"),       # c1 twice in the 5-tie
    ([(5, 1, C[0]), (5, 2, C[0]), (2, 3, C[2])], [C[0], C[0], C[2]], "sid mixed"),          # c2 written with c1's SID
    ([(5, 1, C[0]), (5, 2, C[1]), (2, 3, C[2])], [C[0], C[0], C[2]], "answer mis-copied"),  # ranking right, answer not
    ([(5, 1, C[0]), (2, 3, C[2]), (2, 3, C[2])], [C[0], C[2], C[2]], "order"),              # c3 (alone at 2) twice
    ([(5, 1, None), (5, 2, None), (2, 3, None)], [C[0], C[2], C[2]], "answer mis-copied"),   # lines without SIDs
    ([(5, 2, None), (5, 2, None), (2, 3, None)], [C[1], C[1], C[2]], "tie repeated"),
])
def test_invalid_cause_by_hand(lines, answer_sids, cause):
    cands = C[:3]
    text = trace(lines, answer_sids)
    assert metrics.judge(text, cands)[1] != "valid"
    assert metrics.invalid_cause(text, cands) == cause
    assert metrics.invalid_cause("<think> no ranking here </think> []", cands) == "no ranking"
