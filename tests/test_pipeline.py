"""The whole recipe for a few steps on a micro random-init Qwen3: every script, every output file.

Run once with the small word-level tokenizer and once with the real Qwen3 tokenizer (when the shared
copy is present), so the hub-model path cannot rot.
"""
import json
import os
import re
import shutil
import subprocess

import pytest
import torch
from transformers import AutoConfig

import cft
import data
import decode
import eval as metrics
import model as model_lib
import opd
import report
import rl
import sft
from conftest import ROOT, SHARED
from model import load_checkpoint

QWEN = SHARED / "qwen3-tokenizer"
METRIC_FILE_KEYS = {"recall@1", "recall@3", "ndcg@3", "recall@5", "ndcg@5", "valid_rate", "invalid", "n", "floor"}


def run_pipeline(root, tokenizer, max_new=32, with_report=True):
    d, out = root / "data", root / "out"
    assert data.main(["--out", str(d), "--users", "150", "--max-eval", "4", "--tokenizer", tokenizer]) == 0
    common = ["--data", str(d), "--val-n", "2", "--eval-batch", "4"]
    sft.main(common + ["--out", str(out / "sft"), "--model", "micro", "--steps", "2", "--eval-every", "2",
                       "--batch-size", "2", "--max-new", str(max_new)])
    cft.main(common + ["--init", str(out / "sft"), "--out", str(out / "naive"), "--epochs", "0", "--block", "8"])
    cft.main(common + ["--init", str(out / "sft"), "--out", str(out / "cft"), "--steps", "1", "--block", "8",
                       "--batch-size", "1", "--eval-every", "1", "--sub-block", "4"])  # opd and rl inherit the sub-block
    opd.main(common + ["--init", str(out / "cft"), "--teacher", str(out / "sft"), "--out", str(out / "opd"),
                       "--steps", "1", "--prompts-per-step", "1", "--group", "2", "--kl-n", "2",
                       "--commit", "prefix"])  # rl inherits the commit rule
    rl.main(common + ["--init", str(out / "opd"), "--out", str(out / "rl"), "--steps", "1", "--prompts-per-step", "1",
                      "--group", "2"])
    if with_report:
        report.report(out, d, bench_n=2, batch_sizes=(1,), taus=(1.0, 0.9))
    return d, out


@pytest.fixture(scope="module")
def word_run(tmp_path_factory):
    return run_pipeline(tmp_path_factory.mktemp("word"), "word")


def check_outputs(d, out, with_report=True):
    for stage in ("sft", "naive", "cft", "opd", "rl"):
        m = json.loads((out / stage / "metrics.json").read_text())
        assert METRIC_FILE_KEYS <= set(m), stage
        if stage != "sft":
            assert set(m["by_tau"]) == {"0.9", "0.6", "0.4"} and "tokens_per_forward" in m["by_tau"]["0.9"]
        preds = metrics.read_jsonl(out / stage / "predictions.jsonl")
        assert len(preds) == m["n"] and {"id", "candidates", "target", "response", "parsed", "validity"} <= set(preds[0])
        stage_info = json.loads((out / stage / "stage.json").read_text())
        assert stage_info["stage"] == stage and (stage == "sft") == (stage_info["block_size"] is None)
        assert stage_info.get("sub_block") == {"sft": None, "naive": 0}.get(stage, 4), stage
        own_commit = {"sft": None, "naive": "prefix-joint", "cft": "prefix-joint"}.get(stage, "prefix")
        assert stage_info.get("commit") == own_commit, stage
        config = json.loads((out / stage / "config.json").read_text())
        assert config.get("diffusion_context") == {"sft": None}.get(stage, "causal"), stage  # the default, inherited
        assert model_lib.context_of(AutoConfig.from_pretrained(out / stage)) == {"sft": "block"}.get(stage, "causal")
        assert stage_info["args"]["dtype"] == model_lib.resolve_dtype("auto", "cpu"), stage  # resolved, never "auto"
    if not with_report:
        return
    res = json.loads((out / "results.json").read_text())
    assert [r["name"] for r in res["table1"]][:2] == ["retriever floor", "AR re-ranker (GR2)"] and len(res["table1"]) == 6
    assert res["dtype"] == model_lib.resolve_dtype("auto", "cpu")  # the report decodes in the stages' default dtype
    assert {"decoder", "tau", "batch", "recall@1", "valid_rate", "tokens_per_s", "tokens_per_forward", "speedup"} <= set(res["table2"][0])
    assert [(r["sub_block"], r["commit"]) for r in res["table2"] if r["decoder"] == "diffusion"] == [(4, "prefix")] * 2
    ladder = res["table1b_tau0.9"]  # floor, AR, CFT, OPD, RL, paired on the same examples at tau = 0.9
    assert [r["stage"] for r in ladder] == ["floor", "sft", "cft", "opd", "rl"] and "delta_recall@1_vs_prev" in ladder[-1]
    assert all(r["tokens_per_forward"] > 0 for r in ladder[2:])
    for f in ("results.md", "frontier.png", "curves.png", "masks.png"):
        assert (out / f).stat().st_size > 0


def test_word_tokenizer_pipeline_writes_every_output(word_run):
    check_outputs(*word_run)


def test_report_can_decode_every_diffusion_stage_with_another_sub_block(word_run):
    d, out = word_run
    before = (out / "results.json").read_text()
    report.report(out, d, bench_n=2, batch_sizes=(1,), taus=(0.9,), sub_block=0)
    res = json.loads((out / "results_sub0.json").read_text())
    assert [r["sub_block"] for r in res["table2"] if r["decoder"] == "diffusion"] == [0]
    for stage, tag in (("cft", "sub0_prefix-joint"), ("opd", "sub0_prefix"), ("rl", "sub0_prefix")):  # sub-block 4:
        fresh = metrics.read_jsonl(out / "report" / f"{stage}_{tag}_predictions.jsonl")  # decoded afresh with 0 (own rule)
        assert [p["id"] for p in fresh] == [p["id"] for p in metrics.read_jsonl(out / stage / "predictions.jsonl")]
    assert not (out / "report" / "naive_sub0_predictions.jsonl").exists()  # naive already decodes with 0: its own file
    assert (out / "results.json").read_text() == before and (out / "results_sub0.md").exists()
    report.report(out, d, bench_n=2, batch_sizes=(1,), taus=(0.9,), commit="prefix-joint")  # opd and rl: prefix
    res = json.loads((out / "results_prefix-joint.json").read_text())
    assert [(r["sub_block"], r["commit"]) for r in res["table2"] if r["decoder"] == "diffusion"] == [(4, "prefix-joint")]
    assert all((out / "report" / f"{stage}_sub4_prefix-joint_predictions.jsonl").exists() for stage in ("opd", "rl"))
    assert not (out / "report" / "cft_sub4_prefix-joint_predictions.jsonl").exists()  # cft's own decoder: its own file


def test_paired_comparison_of_two_prediction_files(word_run, tmp_path, capsys):
    d, _ = word_run
    test, sid_of = data.load_split(d, "test")

    def write(name, first_the_target):
        path, recs = tmp_path / name, []
        for ex in test:
            cands = [sid_of[c] for c in ex["candidates"]]
            order = sorted(cands, key=lambda s: s != sid_of[ex["target"]]) if first_the_target else cands  # stable
            recs.append({"id": ex["id"], "candidates": cands, "target": sid_of[ex["target"]], "parsed": order,
                         "validity": "valid", "response": "<think> because </think> [" + "".join(order) + "]"})
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
        return path

    copy, best = write("copy.jsonl", False), write("best.jsonl", True)  # the retriever order; the target moved first
    floor = metrics.summarize(metrics.floor_rows(test))
    assert floor["recall@1"] < 1  # else moving the target first would change nothing
    rows = report.paired(copy, best, d)
    assert rows[0]["recall@1"] == floor["recall@1"] and rows[0]["identity_rate"] == 1.0 and rows[1]["recall@1"] == 1.0
    assert rows[1]["delta_recall@1_vs_prev"][0] == pytest.approx(1 - floor["recall@1"])
    assert rows[1]["delta_ndcg@3_vs_prev"][0] == pytest.approx(1 - floor["ndcg@3"])
    assert "B - A, paired: Recall@1 +" in capsys.readouterr().out
    assert report.paired(best, best, d)[1]["delta_recall@1_vs_prev"] == (0.0, 0.0, 0.0)
    shuffled = tmp_path / "shuffled.jsonl"
    shuffled.write_text("".join(reversed(best.read_text().splitlines(keepends=True))))
    with pytest.raises(SystemExit, match="same examples in the same order"):
        report.paired(copy, shuffled, d)
    stray = tmp_path / "stray.jsonl"  # the same file, but one id that is not a test example of this data
    stray.write_text(copy.read_text().replace(json.dumps(test[0]["id"]), '"no-such-example"', 1))
    with pytest.raises(SystemExit, match="not test examples of"):
        report.paired(stray, stray, d)
    with pytest.raises(SystemExit, match="no predictions file at .*missing.jsonl"):
        report.paired(copy, tmp_path / "missing.jsonl", d)

def test_report_never_reuses_a_decode_older_than_the_checkpoint(word_run):
    import os
    from transformers import AutoTokenizer
    d, out = word_run
    test, sid_of = data.load_split(d, "test")
    tok = AutoTokenizer.from_pretrained(d / "tokenizer")
    decode = lambda: report.stage_predictions(out, "cft", test, sid_of, tok, 1.0, sub_block=2)
    decode()
    cache = out / "report" / "cft_sub2_prefix-joint_predictions.jsonl"  # cft decodes with its own rule, prefix-joint
    recs = metrics.read_jsonl(cache)
    recs[0]["response"] = "stale"
    cache.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert decode()[0]["response"] == "stale"  # newer than the checkpoint: reused
    t = cache.stat().st_mtime + 10
    os.utime(out / "cft" / "stage.json", (t, t))  # the checkpoint was saved again after that decode
    assert decode()[0]["response"] != "stale"


def test_naive_conversion_keeps_every_ar_weight(word_run):
    _, out = word_run
    ar, tok, _ = load_checkpoint(out / "sft")
    naive, _, stage = load_checkpoint(out / "naive")
    a, b = ar.state_dict(), naive.state_dict()
    emb = "model.embed_tokens.weight"
    for k in a:
        if k not in (emb, "lm_head.weight"):  # the head is tied to the embedding
            assert torch.equal(a[k], b[k]), k
    rows = torch.ones(a[emb].shape[0], dtype=torch.bool)
    rows[tok.mask_token_id] = False
    assert torch.equal(a[emb][rows], b[emb][rows])            # every row but the mask token's
    assert not torch.equal(a[emb][~rows], b[emb][~rows])       # which is set to the mean
    assert stage["block_size"] == 8 and stage["mask_token_id"] == tok.mask_token_id


def test_cft_from_a_diffusion_checkpoint_keeps_its_context(word_run):
    _, out = word_run  # out/cft was trained with the default context, causal
    with pytest.raises(ValueError, match="trained with --context causal, not block"):
        cft.convert(out / "cft", "sdpa", "float32", "block")
    assert model_lib.context_of(cft.convert(out / "cft", "sdpa", "float32", "causal")[0]) == "causal"


def test_interrupted_training_resumes_to_the_same_weights(word_run, tmp_path, monkeypatch):
    d, _ = word_run
    args = ["--data", str(d), "--val-n", "2", "--eval-batch", "4", "--model", "micro", "--batch-size", "4",
            "--max-new", "8", "--eval-every", "1", "--steps", "3", "--test-n", "2"]
    sft.main(args + ["--out", str(tmp_path / "straight")])
    save = model_lib.save_progress  # what keep_best calls after every evaluation

    def crash_after_step_two(out, model, tok, stage, opt, step, state):
        save(out, model, tok, stage, opt, step, state)
        if step == 2:
            raise KeyboardInterrupt  # the power goes out right after the step-2 checkpoint

    monkeypatch.setattr(model_lib, "save_progress", crash_after_step_two)
    with pytest.raises(KeyboardInterrupt):
        sft.main(args + ["--out", str(tmp_path / "resumed")])
    monkeypatch.setattr(model_lib, "save_progress", save)
    sft.main(args + ["--out", str(tmp_path / "resumed")])  # the same command again
    a, _, _ = load_checkpoint(tmp_path / "straight" / "last")
    b, _, _ = load_checkpoint(tmp_path / "resumed" / "last")
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert [r["step"] for r in metrics.read_jsonl(tmp_path / "resumed" / "log.jsonl")] == [1, 2, 3]


def test_cft_resumes_between_sparse_validations(word_run, tmp_path, monkeypatch):
    d, out = word_run  # validation only at the end (--eval-every 3): OUT/last comes from --save-every alone
    args = ["--data", str(d), "--init", str(out / "sft"), "--val-n", "2", "--eval-batch", "4", "--block", "8",
            "--batch-size", "2", "--steps", "3", "--eval-every", "3", "--save-every", "1", "--test-n", "2"]
    cft.main(args + ["--out", str(tmp_path / "straight")])
    save = cft.save_progress

    def crash_after_step_two(out, model, tok, stage, opt, step, state):
        save(out, model, tok, stage, opt, step, state)
        if step == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(cft, "save_progress", crash_after_step_two)
    with pytest.raises(KeyboardInterrupt):
        cft.main(args + ["--out", str(tmp_path / "resumed")])
    assert model_lib.load_trainer_state(tmp_path / "resumed" / "last")["step"] == 2
    monkeypatch.setattr(cft, "save_progress", save)
    cft.main(args + ["--out", str(tmp_path / "resumed")])
    a, _, _ = load_checkpoint(tmp_path / "straight")
    b, _, _ = load_checkpoint(tmp_path / "resumed")
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert [r["step"] for r in metrics.read_jsonl(tmp_path / "resumed" / "log.jsonl")] == [0, 3]


@pytest.mark.skipif(not QWEN.exists(), reason="shared Qwen3 tokenizer not present")
def test_qwen3_tokenizer_pipeline(tmp_path):
    # max_new 16: every logit row spans Qwen3's 151,936 tokens; the report (tokenizer-independent beyond what
    # every stage's test decode already does) runs on the word tokenizer's pipeline only, to keep the suite short
    d, out = run_pipeline(tmp_path, str(QWEN), max_new=16, with_report=False)
    check_outputs(d, out, with_report=False)
    _, tok, _ = load_checkpoint(out / "rl")
    assert tok.mask_token_id == 151669 and len(tok) > 151669


@pytest.mark.parametrize("stage,given", [("opd", True), ("rl", True), ("opd", False), ("rl", False)])
def test_rollouts_use_the_rollout_rule_and_the_checkpoint_keeps_its_own(word_run, tmp_path, monkeypatch, stage, given):
    d, out = word_run
    script = {"opd": opd, "rl": rl}[stage]
    seen = []  # (tau, commit) of every decode the stage makes

    def recording(model, tok, prompts, mode, block=32, tau=1.0, *args, **kwargs):
        seen.append((tau, kwargs.get("commit")))
        return generate(model, tok, prompts, mode, block, tau, *args, **kwargs)

    generate = script.generate
    monkeypatch.setattr(script, "generate", recording)
    args = ["--data", str(d), "--val-n", "2", "--eval-batch", "4", "--steps", "1", "--prompts-per-step", "1",
            "--group", "2", "--test-n", "2", "--tau", "0.7", "--out", str(tmp_path / stage)] + ["--rollout-commit", "joint"] * given
    parent = out / ("cft" if stage == "opd" else "opd")
    script.main(args + ["--init", str(parent)] + (["--teacher", str(out / "sft"), "--kl-n", "2"] if stage == "opd" else []))
    own = json.loads((parent / "stage.json").read_text())["commit"]
    # the training rollouts: the rule given, else OPD's the paper's `any` and RL's the checkpoint's own (on-policy)
    rollout_rule = "joint" if given else {"opd": "any", "rl": own}[stage]
    assert {(str(t), c) for t, c in seen if t != 1.0} == {("0.7", rollout_rule)}
    assert json.loads((tmp_path / stage / "stage.json").read_text())["commit"] == own not in ("joint", "any")


def test_opd_from_a_parent_without_test_answers_skips_only_the_teacher_agreement(word_run, tmp_path):
    d, out = word_run
    assert {"kl_to_teacher", "teacher_agreement"} <= set(json.loads((out / "opd" / "metrics.json").read_text()))
    parent = tmp_path / "cft"  # a CFT run stopped before its test: a checkpoint, no predictions.jsonl
    shutil.copytree(out / "cft", parent, ignore=shutil.ignore_patterns("predictions*.jsonl", "metrics.json"))
    opd.main(["--data", str(d), "--val-n", "2", "--eval-batch", "4", "--init", str(parent), "--teacher", str(out / "sft"),
              "--out", str(tmp_path / "opd"), "--steps", "1", "--prompts-per-step", "1", "--group", "2", "--kl-n", "2",
              "--test-n", "2"])
    m = json.loads((tmp_path / "opd" / "metrics.json").read_text())
    assert "kl_to_teacher" in m and "teacher_agreement" not in m and m["n"] == 2


def test_rl_keeps_the_starting_weights_unless_a_checkpoint_beats_them(word_run, tmp_path):
    d, out = word_run
    args = ["--data", str(d), "--init", str(out / "opd"), "--val-n", "2", "--eval-batch", "4", "--steps", "2",
            "--eval-every", "1", "--prompts-per-step", "1", "--group", "2", "--test-n", "2"]
    start = load_checkpoint(out / "opd")[0].state_dict()
    for flag, where in (([], "all"), (["--trained-only"], "trained")):
        rl.main(args + flag + ["--out", str(tmp_path / where)])
        rewards = {r["step"]: r["val_reward"] for r in metrics.read_jsonl(tmp_path / where / "log.jsonl") if "val_reward" in r}
        kept = json.loads((tmp_path / where / "stage.json").read_text())["step"]
        candidates = sorted(rewards) if where == "all" else [s for s in sorted(rewards) if s > 0]
        assert kept == max(candidates, key=lambda s: (rewards[s], -s))  # the best held-out reward, the earliest of ties
        if kept == 0:  # shipped unchanged
            weights = load_checkpoint(tmp_path / where)[0].state_dict()
            assert all(torch.equal(start[k], weights[k]) for k in start)


@pytest.mark.parametrize("script", [sft, cft, opd, rl, decode, data, report])
def test_help_ends_every_flag_with_its_default(script, capsys):
    with pytest.raises(SystemExit):
        (script.parse_args if hasattr(script, "parse_args") else script.main)(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # unwrapped: the terminal width does not matter
    assert "(default: None)" not in text and "(default: False)" not in text  # unset flags and switches say nothing
    assert re.search(r"--seed SEED|--index INDEX|--report", text)  # the flags are there at all
    if script is rl:
        assert "--steps STEPS optimizer steps (default: 40)" in text
        assert re.search(r"--rollout-commit \{[a-z,-]+\} commit rule of the training rollouts [^(]*; default: the --commit rule", text)
    if script is opd:  # OPD keeps the paper's rule for its rollouts; only RL's default differs
        assert re.search(r"--rollout-commit \{[a-z,-]+\} commit rule of the training rollouts .*?\(default: any\)", text)
        assert re.search(r"--fresh ignore OUT/last and start over(?! \(default)", text)
    if script is data:
        assert re.search(r"--users USERS [^-]*\(default: 8000\)", text)


def test_decode_bench_writes_its_rows_on_the_requested_device_and_dtype(word_run, tmp_path):
    d, out = word_run
    path = tmp_path / "bench.json"
    decode.main(["--bench", "--ar", str(out / "sft"), "--diffusion", str(out / "rl"), "--data", str(d), "--n", "2",
                 "--taus", "0.9", "--batch-sizes", "1", "--dtype", "bf16-mixed", "--json", str(path)])
    res = json.loads(path.read_text())
    assert res["device"] == "cpu" and res["dtype"] == "bf16-mixed" and res["forward_cost_ratio"]["8"] > 0
    row = res["diffusion"][0]
    assert row["tau"] == 0.9 and row["n"] == 2 and row["tokens_per_forward"] > 0 and res["ar"]["1"]["speedup"] == 1.0


def test_forward_seconds_times_every_size_against_the_same_cache(word_run):
    d, out = word_run
    model = load_checkpoint(out / "rl")[0].eval()
    prompts = [ex["prompt_ids"] for ex in data.load_split(d, "test", 2)[0]]
    times = decode.forward_seconds(model, prompts, (1, 8), repeats=2)
    assert set(times) == {1, 8} and all(t > 0 for t in times.values())


def test_gpu_preset_probe_measures_every_part_on_the_cpu(word_run, tmp_path):
    """docs/gpu_preset.py made the README's GPU numbers; here it runs its mechanics with a micro model."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_preset", ROOT / "docs" / "gpu_preset.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    d, _ = word_run
    res = probe.main(["--data", str(d), "--model", "micro", "--dtype", "float32", "--device", "cpu", "--batch-size", "2",
                      "--prompts-per-step", "1", "--group", "2", "--chunk", "2", "--rows", "2", "4", "--block", "8",
                      "--max-new", "16", "--repeats", "1", "--json", str(tmp_path / "p.json")])
    assert json.loads((tmp_path / "p.json").read_text()) == res
    for part in ("sft_step", "cft_step", "opd_rollout", "opd_chunk_rows2", "opd_chunk_rows4"):
        assert res[part]["seconds"] > 0 and res[part]["peak_gib"] is None, part  # no GPU memory on the CPU
    assert res["opd_rollout"]["trajectories"] == 2 and res["opd_replay_rows"] > 0
    assert res["decoder_forward_batch16"]["ratio"] > 0


def test_pack_bench_times_every_layout(word_run):
    """docs/pack_bench.py made the README's shared-row speed-ups; here it runs once on the tiny run."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("pack_bench", ROOT / "docs" / "pack_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    d, out = word_run
    med = bench.main(["--ckpt", str(out / "cft"), "--data", str(d), "--batch-size", "2", "--rounds", "1"])
    assert {"packed: one row, two noisy copies", "a row per copy", "pack 1", "pack 4"} <= set(med)
    assert all(t > 0 for t in med.values())


def test_first_error_departures_are_committed_beside_the_leftmost_mask(word_run):
    """docs/first_error.py: under a prefix rule a step's leftmost commit reads the logits tau = 1.0 read, so every
    departure from the tau = 1.0 answer is a token committed with masks to its left (tau 0.001: whole
    sub-blocks per step)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("first_error", ROOT / "docs" / "first_error.py")
    first_error = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(first_error)
    d, out = word_run
    res = first_error.main(["--ckpt", str(out / "cft"), "--data", str(d), "--tau", "0.001", "--n", "4", "--batch-size", "1",
                            "--commit", "prefix", "--dtype", "float32", "--quiet"])
    assert res["invalid"] > 0 and res["departures"] > 0
    assert 0 not in res["left_of_it"] and all(size >= 2 for size in res["step_size"])
    assert sum(res["kind"].values()) == sum(res["left_of_it"].values()) == res["departures"]
    assert res["departures"] + res["same_as_tau1"] == res["invalid"]
    assert first_error.token_kind("<b_17>") == "SID code 2" and first_error.token_kind("c10") == "candidate number"
    with pytest.raises(SystemExit):  # the reference decode is tau = 1.0 itself
        first_error.main(["--ckpt", str(out / "cft"), "--data", str(d), "--tau", "1.0"])


def test_run_sh_passes_each_flag_to_its_stage_and_cft_epochs_wins_over_a_preset(tmp_path):
    """run.sh with a stand-in `python` that only logs its arguments: the commands it would run, in order."""
    stub = tmp_path / "bin" / "python"
    stub.parent.mkdir()
    stub.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\n')
    stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{stub.parent}:{os.environ['PATH']}"}
    out = tmp_path / "out"
    subprocess.run(["bash", str(ROOT / "run.sh"), "--data", "beauty", "--raw", "RAW", "--out", str(out),
                    "--cft-epochs", "7", "--dtype", "float32"], check=True, env=env, capture_output=True)
    calls = (tmp_path / "calls").read_text().splitlines()
    built = (ROOT / "data" / "beauty" / "stats.json").exists()  # run.sh skips data.py for a folder already built
    if not built:
        assert calls[0].startswith("data.py") and "--raw RAW" in calls.pop(0)
    assert [c.split()[0] for c in calls] == ["sft.py", "cft.py", "cft.py", "opd.py", "rl.py", "eval.py"]
    cft_call = calls[2].split()
    assert cft_call[-4:] == ["--batch-size", "16", "--epochs", "7"] and "--steps" in cft_call  # after the Beauty preset's --steps 200
    assert all("--dtype float32" in c for c in calls)
