"""torchrun data parallelism on the CPU (gloo): 2 processes of batch b train exactly as 1 process of batch 2b,
and only rank 0 writes the output folder.

One torchrun launch runs all four stages in a row (starting Python and transformers twice per stage would
cost more than the stages); the one-process references run in this process."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, build_data

COMMON = ["--dtype", "float32", "--val-n", "2", "--test-n", "2", "--eval-every", "100", "--eval-batch", "4", "--fresh"]
B, STEPS = 2, 3  # per-process batch and steps

DRIVER = """
import json, sys
import torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import cft, opd, rl, sft
for name, argv in json.loads(sys.argv[2]):
    {"sft": sft, "cft": cft, "opd": opd, "rl": rl}[name].main(argv)
    dist.barrier()  # the next stage reads what rank 0 wrote
"""


def sft_args(d, out, batch):
    return ["--data", str(d), "--out", str(out), "--model", "micro", "--steps", str(STEPS), "--batch-size", str(batch),
            "--max-new", "32", *COMMON]


def cft_args(d, init, out, batch):
    return ["--data", str(d), "--init", str(init), "--out", str(out), "--steps", str(STEPS), "--batch-size", str(batch),
            "--block", "32", "--tau-n", "2", *COMMON]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    d = build_data(tmp / "data", users=300, max_eval=8)
    stages = [("sft", sft_args(d, tmp / "sft2", B)),
              ("cft", cft_args(d, tmp / "sft2", tmp / "cft2", B))]
    for name in ("opd", "rl"):  # one step, 2 prompts: one per process
        stages.append((name, ["--data", str(d), "--init", str(tmp / "cft2"), "--out", str(tmp / name), "--steps", "1",
                              "--prompts-per-step", "2", "--group", "2", "--tau-n", "2", *COMMON]
                       + (["--teacher", str(tmp / "sft2")] if name == "opd" else [])))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"  # two processes on a small CPU
    (tmp / "driver.py").write_text(DRIVER)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(tmp / "driver.py"), str(ROOT), json.dumps(stages)],
                         cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    import cft
    import sft
    sft.main(sft_args(d, tmp / "sft1", 2 * B))  # one process, the same global batch
    cft.main(cft_args(d, tmp / "sft2", tmp / "cft1", 2 * B))
    return tmp


def last_loss(out):
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()][-1]["loss"]


@pytest.mark.parametrize("stage", ["sft", "cft"])
def test_two_processes_of_b_train_as_one_process_of_2b(runs, stage):
    one, two = runs / f"{stage}1", runs / f"{stage}2"
    assert abs(last_loss(one) - last_loss(two)) < 1e-5
    w1, w2 = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    assert w1.keys() == w2.keys()
    for k in w1:
        assert torch.allclose(w1[k], w2[k], atol=1e-5), k


@pytest.mark.parametrize("stage", ["sft", "cft", "opd", "rl"])
def test_only_rank_zero_writes(runs, stage):
    out = runs / (f"{stage}2" if stage in ("sft", "cft") else stage)
    assert len(list(out.glob("metrics.json"))) == 1 and not list(out.glob("*.tmp"))
    lines = (out / "log.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]
    first = 0 if stage != "sft" else STEPS  # the diffusion stages log their starting point as step 0
    assert steps == ([0, 1] if stage in ("opd", "rl") else sorted({first, STEPS})), steps
    assert len(set(lines)) == len(lines)
    assert len((out / "predictions.jsonl").read_text().splitlines()) == 2
