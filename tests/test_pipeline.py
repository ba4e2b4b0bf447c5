"""The whole recipe for a step or two on a micro random-init Qwen3: every script, every output file, resuming,
the checkpoint kinds each stage accepts, the hub-tokenizer path and run.sh's commands."""
import json
import math
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file

import cft
import data
import eval as metrics
import harness
import opd
import report
import rl
import sft
import warmup
from conftest import QWEN, ROOT, build_data
from plumbing import load_checkpoint, read_jsonl, resolve_dtype

STAGES = ("sft", "ar-rl", "naive", "cft", "opd", "rl")
METRIC_FILE_KEYS = {"recall@1", "recall@3", "ndcg@3", "recall@5", "ndcg@5", "valid_rate", "invalid", "n", "floor"}
F32 = ["--dtype", "float32"]  # every stage but SFT: exact and quick for a micro model on a CPU


def weights(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def run(tiny_data, tmp_path_factory):
    """sft -> naive -> cft -> opd -> rl, the AR re-ranker's RL (ar-rl), then the report on the tiny dataset;
    returns (data folder, run folder)."""
    d, out = tiny_data, tmp_path_factory.mktemp("run")
    common = ["--data", str(d), "--val-n", "2", "--eval-batch", "4"]
    sft.main(common + ["--out", str(out / "sft"), "--model", "micro", "--steps", "2", "--eval-every", "2",
                       "--batch-size", "2", "--max-new", "32"])  # --dtype auto: resolved before it is saved
    cft.main(common + F32 + ["--init", str(out / "sft"), "--out", str(out / "naive"), "--steps", "0", "--block", "8"])
    cft.main(common + F32 + ["--init", str(out / "sft"), "--out", str(out / "cft"), "--steps", "1", "--block", "8",
                             "--batch-size", "1"])
    opd.main(common + F32 + ["--init", str(out / "cft"), "--teacher", str(out / "sft"), "--out", str(out / "opd"),
                             "--steps", "1", "--prompts-per-step", "1", "--group", "2"])
    rl.main(common + F32 + ["--init", str(out / "opd"), "--out", str(out / "rl"), "--steps", "1", "--prompts-per-step",
                            "1", "--group", "2"])
    rl.main(common + F32 + ["--init", str(out / "sft"), "--out", str(out / "ar-rl"), "--steps", "1", "--prompts-per-step",
                            "1", "--group", "2", "--lr", "1e-2"])  # GR2's RL stage on the AR re-ranker
    report.report(out, d, bench_n=2, batch_sizes=(1,), taus=(0.9,), also=("opd",))
    return d, out


def test_every_stage_writes_its_checkpoint_metrics_and_predictions(run):
    d, out = run
    n_test = len(data.load_split(d, "test")[0])
    for stage in STAGES:
        m = json.loads((out / stage / "metrics.json").read_text())
        assert METRIC_FILE_KEYS <= set(m) and m["n"] == n_test, stage
        preds = read_jsonl(out / stage / "predictions.jsonl")
        assert len(preds) == n_test and {"id", "candidates", "target", "response", "parsed", "validity", "nfe"} <= set(preds[0])
        info = json.loads((out / stage / "stage.json").read_text())
        assert info["stage"] == stage and info["block_size"] == (None if stage in ("sft", "ar-rl") else 8), stage
        assert info["max_new"] == 32 and info["args"]["dtype"] != "auto", stage  # inherited; resolved, never "auto"
        if stage not in ("sft", "ar-rl"):  # the default --taus: the report's tau = 0.9 table reads it
            assert set(m["by_tau"]) == {"0.9"}, stage
            assert all(len(read_jsonl(out / stage / f"predictions_tau{t}.jsonl")) == n_test for t in m["by_tau"])
        # the stage's minutes: validation is what log.jsonl recorded, training the rest of the time before the test
        val = sum(r["val_seconds"] for r in read_jsonl(out / stage / "log.jsonl")) / 60 if stage != "naive" else 0.0
        assert set(m["minutes"]) == {"train", "validation", "test"} and m["minutes"]["validation"] == pytest.approx(val)
        assert m["minutes"]["test"] > 0 and (stage == "naive" or val > 0), stage
    assert json.loads((out / "sft" / "stage.json").read_text())["args"]["dtype"] == resolve_dtype("auto", "cpu")
    # the curves: each stage logs its start (the diffusion stages) and its last step
    assert {s: [r["step"] for r in read_jsonl(out / s / "log.jsonl")] for s in ("sft", "cft", "opd", "rl")} == \
        {"sft": [2], "cft": [0, 1], "opd": [0, 1], "rl": [0, 1]}


def test_every_stage_keeps_its_last_step(run):
    _, out = run
    for stage, steps in (("sft", 2), ("cft", 1), ("opd", 1), ("rl", 1)):
        assert json.loads((out / stage / "stage.json").read_text())["step"] == steps
        final, last = weights(out / stage), weights(out / stage / "last")
        assert final.keys() == last.keys() and all(torch.equal(final[k], last[k]) for k in final), stage
    assert not (out / "naive" / "last").exists()  # --steps 0: nothing trained, nothing to resume


def test_the_report_writes_both_tables_and_the_figures(run):
    _, out = run
    res = json.loads((out / "results.json").read_text())
    assert [r["stage"] for r in res["table1"]] == ["floor", *STAGES]
    assert [r["stage"] for r in res["table1b_tau0.9"]] == ["floor", "sft", "ar-rl", "cft", "opd", "rl", "rl-ltr"]
    assert "delta_recall@1_vs_prev" in res["table1b_tau0.9"][-1]  # left to right, paired with the paper's rule
    speed = [(r["decoder"], r["commit"], r["tau"]) for r in res["table2"]]
    assert speed[0] == ("ar", None, None) and res["table2"][0]["speedup"] == 1.0  # the reference, first
    assert {("diffusion", "threshold", 0.9), ("diffusion", "left-to-right", 0.9)} <= set(speed)  # both rules
    also = [(r["decoder"], r["commit"]) for r in res["table2"] if r["model"] == "opd"]  # --also: the paper's rule
    assert also == [("diffusion", "threshold"), ("draft-verify", "threshold")]
    assert res["dtype"] == "float32" and res["final_diffusion"] == "rl" and res["ar_reference"] == "ar-rl"
    assert len(read_jsonl(out / "report" / "rl_left-to-right_predictions_tau0.9.jsonl")) == res["table1b_tau0.9"][0]["n"]
    for f in ("results.md", "frontier.png", "curves.png", "masks.png"):
        assert (out / f).stat().st_size > 0


def test_at_parity_picks_the_lowest_tau_no_more_than_two_points_below_ar_on_both_metrics():
    row = lambda decoder, tau, valid, r1, model="rl", commit="threshold": {
        "model": model, "decoder": decoder, "commit": commit, "tau": tau, "batch": 1, "valid_rate": valid, "recall@1": r1}
    t2 = [row("ar", None, 0.90, 0.50, "sft", None),
          row("diffusion", 0.9, 0.89, 0.49), row("diffusion", 0.6, 0.885, 0.60), row("diffusion", 0.4, 0.87, 0.60),
          row("diffusion", 0.9, 0.70, 0.50, commit="left-to-right"),
          row("draft-verify", 0.9, 0.90, 0.50), row("draft-verify", 0.4, 0.90, 0.50)]
    found = {fam: (r["tau"] if r else None) for _, fam, r in report.at_parity(t2)}
    # 0.6: 0.005 and -0.10 (better) below AR; 0.4 is 0.03 below on validity; left to right never within 0.02
    assert found == {("rl", "diffusion", "threshold"): 0.6, ("rl", "diffusion", "left-to-right"): None,
                     ("rl", "draft-verify", "threshold"): 0.4}


def test_naive_conversion_keeps_every_ar_weight(run):
    _, out = run
    ar, tok, _ = load_checkpoint(out / "sft")
    naive, _, stage = load_checkpoint(out / "naive")
    a, b = ar.state_dict(), naive.state_dict()
    emb = "model.embed_tokens.weight"
    for k in a:
        if k not in (emb, "lm_head.weight"):  # the head is tied to the embedding
            assert torch.equal(a[k], b[k]), k
    others = torch.ones(a[emb].shape[0], dtype=torch.bool)
    others[tok.mask_token_id] = False
    assert torch.equal(a[emb][others], b[emb][others])  # every row but the mask token's, which is the real rows' mean
    assert torch.allclose(b[emb][tok.mask_token_id], a[emb][:len(tok)][others[:len(tok)]].mean(0), atol=1e-6)
    assert stage["step"] == 0 and stage["mask_token_id"] == tok.mask_token_id


def test_paired_comparison_of_two_prediction_files(run, tmp_path, capsys):
    d, _ = run
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
    report.main(["--paired", str(copy), str(best), "--data", str(d)])  # the command line reaches the same function
    assert capsys.readouterr().out.count("B - A, paired: Recall@1 +") == 2
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


def test_report_never_reuses_a_decode_older_than_the_checkpoint(run):
    from transformers import AutoTokenizer
    d, out = run
    test, sid_of = data.load_split(d, "test")
    tok = AutoTokenizer.from_pretrained(d / "tokenizer")
    decode_cft = lambda: report.stage_predictions(out, "cft", test, sid_of, tok, 1.0, commit="left-to-right")
    decode_cft()
    cache = out / "report" / "cft_left-to-right_predictions.jsonl"  # a rule the stage did not test with: decoded here
    recs = read_jsonl(cache)
    recs[0]["response"] = "stale"
    cache.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert decode_cft()[0]["response"] == "stale"  # newer than the checkpoint: reused
    t = cache.stat().st_mtime + 10
    os.utime(out / "cft" / "stage.json", (t, t))  # the checkpoint was saved again after that decode
    assert decode_cft()[0]["response"] != "stale"


# ----------------------------------------------------------------------------- resuming
def crash_after_step_two(monkeypatch, module):
    """Make `module`'s save_progress raise right after it saved step 2, as a power cut would."""
    save = module.save_progress

    def crashing(out, model, tok, stage, opt, step, elapsed):
        save(out, model, tok, stage, opt, step, elapsed)
        if step == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(module, "save_progress", crashing)


@pytest.mark.parametrize("stage", ["sft", "cft", "opd", "rl", "ar-rl"])
def test_interrupted_training_resumes_to_the_same_weights(run, tmp_path, monkeypatch, stage):
    """The batches, the noise (cft) and the rollouts' sampling (opd, rl) depend on the step alone, and the
    optimizer state is saved: the same command again ends exactly where an uninterrupted run ends."""
    d, out = run
    module = {"sft": sft, "cft": cft, "opd": opd, "rl": rl, "ar-rl": rl}[stage]
    args = ["--data", str(d), "--val-n", "2", "--eval-batch", "4", "--steps", "3", "--test-n", "2", "--eval-every", "2",
            *F32]
    args += {"sft": ["--model", "micro", "--max-new", "8", "--batch-size", "2"],
             "cft": ["--init", str(out / "sft"), "--block", "8", "--tau-n", "1", "--batch-size", "2"],
             "opd": ["--init", str(out / "cft"), "--teacher", str(out / "sft"), "--tau-n", "1", "--prompts-per-step", "1",
                     "--group", "2"],
             "rl": ["--init", str(out / "opd"), "--tau-n", "1", "--prompts-per-step", "1", "--group", "2"],
             "ar-rl": ["--init", str(out / "sft"), "--prompts-per-step", "1", "--group", "2"]}[stage]
    if stage.endswith("rl"):  # a micro model two SFT steps old answers nothing valid: every reward -1, no group to learn from
        monkeypatch.setattr(metrics, "rerank_reward", lambda text, candidates, target: float(len(text) % 3))
    module.main(args + ["--out", str(tmp_path / "straight")])
    with monkeypatch.context() as m:
        crash_after_step_two(m, module)
        with pytest.raises(KeyboardInterrupt):
            module.main(args + ["--out", str(tmp_path / "resumed")])
    assert json.loads((tmp_path / "resumed" / "last" / "stage.json").read_text())["stage"] == stage
    module.main(args + ["--out", str(tmp_path / "resumed")])  # the same command again
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    logged = [r["step"] for r in read_jsonl(tmp_path / "resumed" / "log.jsonl")]
    assert logged == {"sft": [2, 3], "cft": [0, 2, 3]}.get(stage, [0, 1, 2, 3])  # OPD and RL log every step
    assert logged == [r["step"] for r in read_jsonl(tmp_path / "straight" / "log.jsonl")]
    if stage.endswith("rl"):  # the policy really moved: runs that never update would agree trivially
        start = weights(out / ("opd" if stage == "rl" else "sft"))
        assert any(not torch.equal(start[k], a[k]) for k in a)
    if stage == "ar-rl":  # GR2's RL keeps an AR re-ranker: OPD's teacher and the AR rows load it as one
        assert load_checkpoint(tmp_path / "straight", diffusion=False)[2]["block_size"] is None


# ----------------------------------------------------------------------------- checkpoint kinds and command lines
@pytest.mark.parametrize("script,flags,message", [
    ("opd", {"--init": "sft"}, "is a 'sft' checkpoint; this needs a block-diffusion checkpoint"),
    ("cft", {"--init": "opd"}, "is a 'opd' checkpoint; this needs an AR checkpoint"),
    ("cft", {"--init": "missing"}, "is not a finished checkpoint of this project"),
])
def test_a_stage_given_the_wrong_kind_of_checkpoint_exits_with_a_clear_message(run, tmp_path, script, flags, message):
    d, out = run
    given = {"opd": {"--init": "cft", "--teacher": "sft"}, "rl": {"--init": "opd"}, "cft": {"--init": "sft"}}[script]
    argv = ["--data", str(d), "--out", str(tmp_path / script), *F32]
    for flag, stage in {**given, **flags}.items():
        argv += [flag, str(out / stage)]
    with pytest.raises(SystemExit, match=message):
        {"opd": opd, "rl": rl, "cft": cft}[script].main(argv)
    assert not (tmp_path / script).exists()  # a start that fails on its inputs leaves nothing behind


def test_latency_opd_distils_the_student_from_its_own_slow_decoding(run, tmp_path):
    """opd.py with a block-diffusion --teacher (the student's own checkpoint) and low-tau rollouts runs end to end."""
    d, out = run
    opd.main(["--data", str(d), "--out", str(tmp_path / "lat"), "--init", str(out / "cft"), "--teacher", str(out / "cft"),
              "--tau", "0.4", "--steps", "1", "--prompts-per-step", "1", "--group", "2", "--val-n", "2", "--eval-batch", "4",
              "--kl-n", "2", *F32])
    m = json.loads((tmp_path / "lat" / "metrics.json").read_text())
    assert m["kl_to_teacher"]["init"] >= 0 and json.loads((tmp_path / "lat" / "stage.json").read_text())["teacher"] == str(out / "cft")


@pytest.fixture(scope="module")
def other_data(tmp_path_factory):
    """A dataset whose tokenizer is not the run's: a smaller codebook, so other SID tokens (and fewer of them)."""
    out = tmp_path_factory.mktemp("other") / "small-codebook"
    assert data.main(["--out", str(out), "--users", "150", "--max-eval", "4", "--codebook", "64"]) == 0
    return out


@pytest.mark.parametrize("script", ["sft", "cft", "opd", "rl", "ar-rl", "report", "harness"])
def test_a_checkpoint_read_with_another_datasets_tokenizer_is_refused_by_name(run, other_data, tmp_path, script):
    """Another dataset's token ids would mean other tokens to the model, or run past its embedding: every stage
    names both folders instead, and leaves no output folder behind."""
    _, out = run
    dest = tmp_path / "out"
    argv = ["--data", str(other_data), "--out", str(dest), *F32, "--steps", "1"]
    call = {"sft": lambda: sft.main(argv + ["--model", str(out / "sft")]),
            "cft": lambda: cft.main(argv + ["--init", str(out / "sft")]),
            "opd": lambda: opd.main(argv + ["--init", str(out / "cft"), "--teacher", str(out / "sft")]),
            "rl": lambda: rl.main(argv + ["--init", str(out / "opd")]),
            "ar-rl": lambda: rl.main(argv + ["--init", str(out / "sft")]),
            "report": lambda: report.report(out, other_data),
            "harness": lambda: harness.main(["--show", "--ckpt", str(out / "rl"), "--data", str(other_data)])}[script]
    with pytest.raises(SystemExit, match=rf"the tokenizer of .* is not the tokenizer of {other_data}"):
        call()
    assert not dest.exists()


@pytest.mark.parametrize("script", [warmup, sft, cft, opd, rl, harness, data, report])
def test_every_script_answers_help(script, capsys):
    """--help renders every flag's help (a stray % in a help string would crash argparse only here)."""
    with pytest.raises(SystemExit) as exit_:
        (script.parse_args if hasattr(script, "parse_args") else script.main)(["--help"])
    assert exit_.value.code == 0 and "--" in capsys.readouterr().out


def test_help_shows_a_default_of_zero_but_not_an_unset_flag(capsys):
    with pytest.raises(SystemExit):
        sft.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(0 = 1.25x the longest trace) (default: 0)" in text and "start over (default" not in text


def test_harness_command_line_benchmarks_and_shows(run, tmp_path, capsys):
    d, out = run
    path = tmp_path / "bench.json"
    harness.main(["--bench", "--ar", str(out / "sft"), "--diffusion", str(out / "rl"), "--data", str(d), "--n", "2",
                  "--taus", "0.9", "--batch-sizes", "1", "--commit", "left-to-right", "--dtype", "bf16-mixed",
                  "--json", str(path)])
    res = json.loads(path.read_text())
    assert res["device"] == "cpu" and res["dtype"] == "bf16-mixed"  # the requested dtype reached both decoders
    rows = [(r["decoder"], r["commit"], r["n"]) for r in res["rows"]]
    assert rows[0] == ("ar", None, 2) and ("diffusion", "left-to-right", 2) in rows  # --commit: that rule only
    assert ("diffusion", "threshold", 2) not in rows
    assert res["rows"][0]["speedup"] == 1.0
    harness.main(["--show", "--ckpt", str(out / "rl"), "--data", str(d), "--tau", "0.5", "--dtype", "float32"])
    assert "tokens per forward" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="is a 'sft' checkpoint"):
        harness.main(["--show", "--ckpt", str(out / "sft"), "--data", str(d)])


def test_run_sh_runs_every_stage_in_order_and_skips_a_finished_one(tmp_path):
    """run.sh with a stand-in `python` that only logs its arguments: the commands it would run, in order."""
    stub = tmp_path / "bin" / "python"
    stub.parent.mkdir()
    stub.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\n')
    stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{stub.parent}:{os.environ['PATH']}"}
    out = tmp_path / "out"
    (out / "sft").mkdir(parents=True)
    (out / "sft" / "metrics.json").write_text("{}")  # a finished stage
    subprocess.run(["bash", str(ROOT / "run.sh"), "--data", "beauty", "--raw", "RAW", "--out", str(out),
                    "--device", "cuda"], check=True, env=env, capture_output=True)
    calls = (tmp_path / "calls").read_text().splitlines()
    if not (ROOT / "data" / "beauty" / "stats.json").exists():  # run.sh skips data.py for a folder already built
        assert calls.pop(0).split()[:5] == ["data.py", "--out", "data/beauty", "--raw", "RAW"]
    assert [c.split()[0] for c in calls] == ["cft.py", "cft.py", "opd.py", "rl.py", "report.py", "report.py"]
    assert "--steps 0" in calls[0] and f"--out {out}/naive" in calls[0] and f"--init {out}/opd" in calls[3]
    assert all("--device cuda" in c and "--data " in c for c in calls[:-1])
    # the closing lines: each stage's wall seconds (sft was done before this invocation, so it has none)
    assert calls[-1].startswith(f"report.py --run {out} --times ") and " naive:" in calls[-1] and "sft:" not in calls[-1]
    (tmp_path / "calls").unlink()
    subprocess.run(["bash", str(ROOT / "run.sh"), "--warmup", "--out", str(tmp_path / "w")], check=True, env=env,
                   capture_output=True)  # the synthetic data may or may not be built here: look from the warm-up on
    calls = (tmp_path / "calls").read_text().splitlines()
    calls = calls[[c.split()[0] for c in calls].index("warmup.py"):]
    assert [c.split()[0] for c in calls][:3] == ["warmup.py", "sft.py", "cft.py"]
    assert f"--out {tmp_path}/w/warmup" in calls[0] and f"--model {tmp_path}/w/warmup" in calls[1]
    assert "--data data/workshop" in calls[1]  # the default: the workshop task; --full: the paper-sized one
    (tmp_path / "calls").unlink()
    subprocess.run(["bash", str(ROOT / "run.sh"), "--full", "--out", str(tmp_path / "f")], check=True, env=env,
                   capture_output=True)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert all("--candidates" not in c for c in calls) and "--data data/synthetic" in calls[-3]
    calls = calls[[c.split()[0] for c in calls].index("sft.py"):]
    f = f"{tmp_path}/f"  # --full runs GR2's RL on the AR re-ranker: the AR model that CFT converts and OPD distils
    assert [c.split()[0] for c in calls][:6] == ["sft.py", "rl.py", "cft.py", "cft.py", "opd.py", "rl.py"]
    assert f"--init {f}/sft --out {f}/ar-rl" in calls[1] and f"--init {f}/ar-rl" in calls[2] and f"--init {f}/ar-rl" in calls[3]
    assert f"--teacher {f}/ar-rl" in calls[4]
    bad = subprocess.run(["bash", str(ROOT / "run.sh"), "--epochs", "3"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown argument '--epochs'" in bad.stderr


# ----------------------------------------------------------------------------- the hub path
@pytest.mark.skipif(not QWEN.exists(), reason="shared Qwen3 tokenizer not present")
def test_a_hub_tokenizer_resizes_a_smaller_models_embeddings(tmp_path):
    """A local model folder whose vocabulary is smaller than the tokenizer (Qwen3 plus the SID and mask tokens):
    create_model grows the embedding to whole 64-row multiples and keeps every row the model had."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    from model import PRESETS, ar_loss, create_model
    from plumbing import collate
    d = build_data(tmp_path / "data", tokenizer=QWEN)
    tok = AutoTokenizer.from_pretrained(d / "tokenizer")
    torch.manual_seed(0)
    small = AutoModelForCausalLM.from_config(Qwen3Config(vocab_size=1024, tie_word_embeddings=True, **PRESETS["micro"]))
    small.save_pretrained(tmp_path / "hub")
    model = create_model(str(tmp_path / "hub"), tok)
    rows = model.get_input_embeddings().weight.shape[0]
    assert rows == 64 * math.ceil(len(tok) / 64) >= len(tok) > 1024
    assert model.config.vocab_size == rows and model.get_output_embeddings().weight.shape[0] == rows
    assert torch.equal(model.get_input_embeddings().weight[:1024], small.get_input_embeddings().weight)
    sid = json.loads((d / "items.jsonl").read_text().splitlines()[0])["sid"]  # e.g. <a_3><b_17><c_0><d_0>
    for token in [tok.mask_token, *sid.replace("><", ">\n<").split("\n")]:
        ids = tok.encode(token, add_special_tokens=False)
        assert len(ids) == 1 and tok.decode(ids) == token, token
    assert tok.mask_token_id == 151669  # Qwen3's first spare row, as METHOD.md says
    train, _ = data.load_split(d, "train", 2)
    think = tok.convert_tokens_to_ids("<think>")
    for ex in train:  # the chat template opens no think block of its own: the trace's is the only one
        assert (ex["prompt_ids"] + ex["response_ids"]).count(think) == 1 and ex["response_ids"][0] == think
    assert torch.isfinite(ar_loss(model, collate(train)))  # every id has a row


def test_the_closing_lines_split_each_stages_minutes(tmp_path, capsys):
    """report.py --times: wall minutes from run.sh, training / validation / test from each stage's metrics.json;
    data.py has no split and the report's own decoding counts as test."""
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "metrics.json").write_text(json.dumps({"minutes": {"train": 6.0, "validation": 0.5, "test": 0.25}}))
    (tmp_path / "warmup").mkdir()
    (tmp_path / "warmup" / "metrics.json").write_text(json.dumps({"minutes": 3.0}))  # the warm-up's total only
    report.main(["--run", str(tmp_path), "--times", "data:30", "warmup:180", "sft:420", "report:90"])
    rows = {line.split()[0]: line.split()[1:5] for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert rows["data"] == ["0.5", "-", "-", "-"] and rows["sft"] == ["7.0", "6.0", "0.5", "0.2"]
    assert rows["warmup"] == ["3.0", "-", "-", "-"] and rows["report"] == ["1.5", "-", "-", "1.5"]
    assert rows["total"] == ["12.0", "6.0", "0.5", "1.8"]
    with pytest.raises(SystemExit):
        report.main(["--run", str(tmp_path), "--times", "sft"])
