"""plumbing.py: atomic files and checkpoints, the checkpoint kind check, resuming, the log, dtypes, batches."""
import argparse
import json
from pathlib import Path

import pytest
import torch

from conftest import PAD, random_prompts, tiny
from plumbing import (Log, batch_indices, load_checkpoint, lr_at, resolve_dtype, resume, save_checkpoint,
                      save_progress, setup, with_dtype, write_atomic)


def word_tok():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")))


def test_write_atomic_makes_the_folder_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "run" / "report" / "rows.jsonl"  # neither folder exists yet
    write_atomic(path, "one\n")
    write_atomic(path, "two\n")  # a rewrite replaces the file whole
    assert path.read_text() == "two\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["rows.jsonl"]


def test_save_load_round_trips_logits_and_leaves_no_temporary(tmp_path):
    model = tiny()
    save_checkpoint(tmp_path / "ck", model, word_tok(), {"stage": "test", "block_size": 4})
    again, _, stage = load_checkpoint(tmp_path / "ck", attn="sdpa", diffusion=True)
    assert stage["stage"] == "test" and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert not list((tmp_path / "ck").glob("*.bin")) and list((tmp_path / "ck").glob("*.safetensors"))
    ids = torch.tensor([random_prompts(1)[0]])
    assert torch.equal(model(input_ids=ids).logits, again(input_ids=ids).logits)


def test_a_save_cut_short_is_not_a_checkpoint(tmp_path, monkeypatch):
    """stage.json moves in last: a save interrupted while the weights move in leaves no stage.json, and
    loading says so instead of reading half a checkpoint."""
    model, tok = tiny(), word_tok()
    save_checkpoint(tmp_path / "ck", model, tok, {"stage": "sft", "block_size": None})
    import plumbing
    real_replace, moved = plumbing.os.replace, []

    def cut(src, dst):
        if Path(dst).parent.name == "ck":  # a file moving into the checkpoint (not a temporary file of the save)
            if moved:  # the power goes out after the first file moved in
                raise KeyboardInterrupt
            moved.append(dst)
        real_replace(src, dst)

    monkeypatch.setattr(plumbing.os, "replace", cut)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path / "ck", model, tok, {"stage": "sft", "block_size": None})
    monkeypatch.undo()
    with pytest.raises(SystemExit, match="not a finished checkpoint"):
        load_checkpoint(tmp_path / "ck")
    save_checkpoint(tmp_path / "ck", model, tok, {"stage": "sft", "block_size": None})  # the next save cleans up
    assert load_checkpoint(tmp_path / "ck")[2]["stage"] == "sft" and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


@pytest.mark.parametrize("stage,diffusion,message", [
    ({"stage": "sft", "block_size": None}, True, "is a 'sft' checkpoint; this needs a block-diffusion checkpoint"),
    ({"stage": "cft", "block_size": 4}, False, "is a 'cft' checkpoint; this needs an AR checkpoint"),
])
def test_the_wrong_kind_of_checkpoint_is_refused_with_a_clear_error(tmp_path, stage, diffusion, message):
    save_checkpoint(tmp_path / "ck", tiny(), word_tok(), stage)
    with pytest.raises(SystemExit, match=message):
        load_checkpoint(tmp_path / "ck", diffusion=diffusion)
    assert load_checkpoint(tmp_path / "ck", diffusion=not diffusion)[2]["stage"] == stage["stage"]
    with pytest.raises(SystemExit, match="no stage.json"):
        load_checkpoint(tmp_path / "missing", diffusion=diffusion)


def test_resume_restores_weights_optimizer_and_step(tmp_path):
    model, tok = tiny(), word_tok()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    save_progress(tmp_path, model, tok, {"stage": "sft", "block_size": None}, opt, 7, 12.5)
    fresh = tiny(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert resume(tmp_path, fresh, fresh_opt) == (7, 12.5)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"] == 1
    assert resume(tmp_path / "elsewhere", fresh, fresh_opt) == (0, 0.0)  # nothing saved there: from the start
    other = tiny(vocab=64)  # another model in the same OUT (a different --model without --fresh)
    with pytest.raises(SystemExit, match="pass --fresh"):
        resume(tmp_path, other, torch.optim.AdamW(other.parameters()))


def test_a_resumed_log_drops_the_records_logged_after_its_checkpoint(tmp_path):
    log = Log(tmp_path, 0)
    for step in range(6):  # an OPD/RL-style log: a record every step, the last checkpoint at step 3
        log(step=step, loss=float(step))
    with open(tmp_path / "log.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # the interruption cut the last record short
    Log(tmp_path, 3)(step=4, loss=-4.0)  # resumed at step 3: 4 and 5 are logged again by the resumed run
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in records] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, -4.0)]
    Log(tmp_path, 0)
    assert not (tmp_path / "log.jsonl").exists()  # a run from step 0 starts a new log


@pytest.mark.parametrize("fresh", [False, True])
def test_a_stage_starts_without_the_results_of_an_earlier_run(tmp_path, fresh):
    out = tmp_path / "stage"
    (out / "last").mkdir(parents=True)
    for name in ("metrics.json", "predictions.jsonl", "predictions_tau0.9.jsonl", "log.jsonl", "model.safetensors"):
        (out / name).write_text("{}")
    setup(argparse.Namespace(out=str(out), fresh=fresh, dtype="float32", device="cpu"))
    # metrics and answers describe a finished checkpoint: gone, so run.sh and the report cannot take them for this
    # run's; the log, the weights and (unless --fresh) OUT/last stay for resuming
    assert sorted(p.name for p in out.iterdir()) == sorted(["log.jsonl", "model.safetensors"] + ([] if fresh else ["last"]))
    setup(argparse.Namespace(out=str(tmp_path / "new"), fresh=fresh, dtype="float32", device="cpu"))
    assert not (tmp_path / "new").exists()  # made by the first record or checkpoint: a failed start leaves nothing


def test_dtype_auto_is_bf16_mixed_only_where_the_cpu_computes_bfloat16_natively(monkeypatch, tmp_path):
    assert resolve_dtype("float32") == "float32" and resolve_dtype("bfloat16", "cuda") == "bfloat16"  # explicit wins
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert resolve_dtype("auto", "cpu") == "float32"  # no native bfloat16: float32
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert resolve_dtype("auto", "cpu") == "bf16-mixed"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_dtype("auto", "cuda") == "float32"
    args = argparse.Namespace(dtype="auto", device="cpu", out=str(tmp_path / "o"), fresh=False)
    setup(args)  # every stage resolves before it prints its config and saves vars(args) in stage.json
    assert args.dtype == "bf16-mixed"


def test_bf16_mixed_keeps_float32_weights_and_computes_in_bfloat16():
    from model import ar_logits
    model = tiny()
    prompts, responses = random_prompts(2), random_prompts(2, 6, 9, seed=3)
    exact = ar_logits(model, prompts, responses, PAD)
    mixed = with_dtype(model, "bf16-mixed")
    seen = []
    hook = mixed.model.layers[0].mlp.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    approx = ar_logits(mixed, prompts, responses, PAD)
    hook.remove()
    assert seen == [torch.bfloat16] and all(p.dtype == torch.float32 for p in mixed.parameters())
    assert approx.dtype == torch.float32 and 0 < (approx - exact).abs().max() < 0.1  # bf16 rounding, nothing worse


def test_batches_cover_each_example_once_per_epoch_and_repeat_after_a_restart():
    n, size = 10, 3  # 3 batches an epoch; the 10th example waits for a later epoch
    epoch0 = [batch_indices(step, n, size, seed=1) for step in range(3)]
    seen = [i for b in epoch0 for i in b]
    assert all(len(b) == size for b in epoch0) and len(set(seen)) == 9
    assert [batch_indices(step, n, size, seed=1) for step in range(3)] == epoch0  # a resumed run sees the same
    assert batch_indices(3, n, size, seed=1) != epoch0[0]  # a new epoch, a new order
    assert batch_indices(0, n, size, seed=2) != epoch0[0]


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    peak, total, warmup = 1.0, 20, 4
    lrs = [lr_at(s, total, peak, warmup) for s in range(total + 1)]
    assert lrs[:warmup] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[warmup] == pytest.approx(peak) and lrs[total] == pytest.approx(0.1 * peak)
    assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1:]))  # never rises after the warm-up
    assert lrs[(warmup + total) // 2] == pytest.approx(0.55 * peak)  # the cosine's midpoint
