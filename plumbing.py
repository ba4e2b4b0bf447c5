"""
Plumbing shared by the stage scripts: command-line flags, dtypes, checkpoints, resuming, the log.

None of this is the method (that is model.py); it is what makes a training script restartable and
its output trustworthy:

- every file is written to a temporary name and renamed, so a reader never sees half a file and an
  interrupted save never looks like a finished one;
- OUT/last holds the model, optimizer and step of the latest evaluation: running the same command
  again resumes there (`--fresh` starts over);
- OUT/log.jsonl has one record per evaluation (the report plots it); a resumed run drops the
  records the interrupted run wrote after its last save and writes them again.

Under `torchrun --nproc_per_node N` a stage runs as N data-parallel processes (section "several
processes"): each takes its share of every step's examples, gradients are averaged, and rank 0 alone
validates, tests and writes files. A plain `python stage.py` is one process and none of that applies.
"""
import argparse
import atexit
import datetime
import json
import math
import os
import shutil
import time
from pathlib import Path

import torch

# Weight dtypes by name. "bf16-mixed" keeps float32 weights (and AdamW state) and runs every forward under
# bfloat16 autocast: pure bfloat16 weights would round away any update smaller than ~1/256 of a weight.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "bf16-mixed": torch.float32}
DTYPE_HELP = ("auto (bf16-mixed on a CUDA GPU with bfloat16 or a CPU with AVX512-BF16/AMX, else float32); float32; "
              "bf16-mixed (float32 weights, bfloat16 compute); bfloat16 (pure)")


# ----------------------------------------------------------------------------- dtypes
def resolve_dtype(dtype, device="cpu"):
    """A DTYPES name for --dtype: "auto" becomes bf16-mixed where bfloat16 matmuls run natively, else float32."""
    if dtype != "auto":
        return dtype
    device = torch.device(device)
    if device.type == "cuda":
        native = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    elif device.type == "cpu":  # private but stable helpers (torch >= 2.3); an absent one counts as "no"
        native = any(getattr(torch.cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    else:
        native = False
    return "bf16-mixed" if native else "float32"


def with_dtype(model, dtype):
    model.bf16_mixed = dtype == "bf16-mixed"  # read by compute()
    return model


def compute(model):
    """The context every forward runs in: bfloat16 autocast for a model loaded as "bf16-mixed", else nothing."""
    return torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=getattr(model, "bf16_mixed", False))


# ----------------------------------------------------------------------------- files
def write_atomic(path, text):
    """Write text to a temporary file beside `path`, then rename it into place."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{path}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def save_checkpoint(path, model, tok, stage, extra=None):
    """Save the HF way (safetensors + tokenizer) plus stage.json into `path` (which may hold other files).

    Files go to a temporary folder and move in one by one; stage.json moves last and marks the checkpoint
    complete. `extra`: training state for resuming (tensors and numbers only, loaded with weights_only)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if extra is not None:
        torch.save(extra, tmp / "trainer.pt")
    (tmp / "stage.json").write_text(json.dumps({**stage, "saved": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2))
    path.mkdir(parents=True, exist_ok=True)
    (path / "stage.json").unlink(missing_ok=True)
    for f in sorted(tmp.iterdir(), key=lambda f: f.name == "stage.json"):
        os.replace(f, path / f.name)
    tmp.rmdir()


def load_checkpoint(path, attn="sdpa", dtype="float32", tok=None, diffusion=None, data=None):
    """(model, tokenizer, stage dict) from a folder written by save_checkpoint; never unpickles code.

    diffusion=True / False: the checkpoint must be a block-diffusion / an AR one (a clear error otherwise).
    `tok`: the run's tokenizer, already in memory, instead of parsing it again. `data`: the data folder the
    run reads, whose tokenizer the checkpoint's must be (check_tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = Path(path)
    if not (path / "stage.json").exists():
        raise SystemExit(f"error: {path} is not a finished checkpoint of this project (no stage.json)")
    stage = json.loads((path / "stage.json").read_text())
    if diffusion is not None and bool(stage.get("block_size")) != diffusion:
        want = "a block-diffusion checkpoint (cft.py, opd.py or rl.py)" if diffusion else "an AR checkpoint (sft.py or rl.py)"
        raise SystemExit(f"error: {path} is a '{stage.get('stage')}' checkpoint; this needs {want}")
    own = AutoTokenizer.from_pretrained(path) if tok is None or data is not None else tok
    if data is not None:
        check_tokenizer(path, own, data)
    tok = own if tok is None else tok
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=DTYPES[dtype], use_safetensors=True)
    return with_dtype(model, dtype), tok, stage


def check_tokenizer(path, tok, data_dir):
    """A clear error where the model in `path` (its tokenizer: `tok`) was trained with another tokenizer than the
    data in `data_dir`: the data's token ids would mean other tokens to it, or run past its embedding."""
    from transformers import AutoTokenizer
    theirs = AutoTokenizer.from_pretrained(Path(data_dir) / "tokenizer")
    if tok.get_vocab() != theirs.get_vocab():
        stage = Path(path) / "stage.json"
        trained = json.loads(stage.read_text()).get("data") if stage.exists() else None
        raise SystemExit(f"error: the tokenizer of {path} ({len(tok)} tokens" + (f", trained on {trained}" if trained else "")
                         + f") is not the tokenizer of {data_dir} ({len(theirs)} tokens): give the --data it was trained "
                         "on, or train it on this data")


# ----------------------------------------------------------------------------- resuming and logging
def save_progress(out, model, tok, stage, optimizer, step, elapsed):
    """OUT/last: the model so far and what a resumed run needs (optimizer state, step, minutes so far)."""
    save_checkpoint(Path(out) / "last", model, tok, stage,
                    {"optimizer": optimizer.state_dict(), "step": step, "elapsed": elapsed})


def resume(out, model, optimizer):
    """(next step, seconds already spent) from OUT/last, loading its weights and optimizer; (0, 0.0) if none."""
    from safetensors.torch import load_file
    last = Path(out) / "last"
    if not (last / "trainer.pt").exists():
        return 0, 0.0
    state = torch.load(last / "trainer.pt", weights_only=True)
    weights = {}
    for f in sorted(last.glob("*.safetensors")):
        weights.update(load_file(f))
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError:  # the same names with other shapes (another --model in the same OUT)
        missing, unexpected = [], ["(size mismatch)"]
    if unexpected or set(missing) - {"lm_head.weight"}:  # a tied head is stored once, as the embedding
        raise SystemExit(f"error: {last} does not hold this model's weights: pass --fresh to start over, or another --out")
    optimizer.load_state_dict(state["optimizer"])
    print(f"resuming from {last} at step {state['step']}")
    return state["step"], state["elapsed"]


class Log:
    """One JSON record per line in OUT/log.jsonl. A run from step 0 starts a new file; a resumed one keeps
    the records up to its step (the interrupted run logged later ones that the resumed run logs again)."""

    def __init__(self, out, start):
        self.path = Path(out) / "log.jsonl"
        if start == 0:
            self.path.unlink(missing_ok=True)
        elif self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if Log.step_of(line) <= start]
            write_atomic(self.path, "".join(line + "\n" for line in kept))

    @staticmethod
    def step_of(line):
        """A record's step; infinity for a line cut short by the interruption, so it is dropped too."""
        try:
            return json.loads(line).get("step", 0)
        except json.JSONDecodeError:
            return float("inf")

    def __call__(self, **rec):
        self.path.parent.mkdir(parents=True, exist_ok=True)  # OUT is made by its first record or checkpoint
        if torch.cuda.is_available():  # what a GPU user sizes the batch by
            rec["peak_gpu_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        return rec


# ----------------------------------------------------------------------------- the training loop's helpers
def lr_at(step, total, peak, warmup):
    """Linear warm-up, then cosine decay to 10% of the peak (assumption: one schedule for every stage;
    the paper gives OPD and RL a constant lr at 8B scale and does not say for the others)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def batch_indices(step, n, batch_size, seed):
    """The example indices of training step `step`: seeded epochs, so a resumed run sees the same batches."""
    per_epoch = max(1, n // batch_size)
    epoch, k = divmod(step, per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
    return perm[k * batch_size:(k + 1) * batch_size].tolist()


def collate(examples):
    """The batch dict the losses take: the columns they need, as lists."""
    return {k: [ex[k] for ex in examples] for k in ("prompt_ids", "response_ids", "n_reasoning")}


# ----------------------------------------------------------------------------- command line
class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help keeps the module docstring's layout and ends each flag's help with its default."""

    def _get_help_string(self, action):
        text = action.help or ""
        # `is`, not `in`: a default of 0 equals False and would be hidden
        if any(action.default is v for v in (None, False, argparse.SUPPRESS)) or "%(default)" in text:
            return text
        return text + " (default: %(default)s)"


def add_runtime_args(ap):
    """Where and how a model runs (every stage, harness.py and report.py)."""
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="attention implementation")
    ap.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help=DTYPE_HELP)
    ap.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1, ...)")


def add_training_args(ap, steps, lr, warmup, eval_every, batch_size=None, token_weights=True, tau_n=True, test=True):
    """The flags every training stage shares, with the stage's own defaults."""
    ap.add_argument("--data", default="data/synthetic", help="folder written by data.py")
    ap.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    if batch_size:  # OPD and RL count prompts per step instead
        ap.add_argument("--batch-size", type=int, default=batch_size, help="examples per step")
    ap.add_argument("--lr", type=float, default=lr, help="peak learning rate (warm-up, then cosine to 10%%)")
    ap.add_argument("--warmup", type=int, default=warmup, help="learning-rate warm-up steps")
    if token_weights:  # assumption: lambda_r = 0.5, lambda_o = 1.0 (the paper names the weights, not their values)
        ap.add_argument("--lambda-r", type=float, default=0.5, help="loss weight of reasoning tokens")
        ap.add_argument("--lambda-o", type=float, default=1.0, help="loss weight of answer tokens")
    ap.add_argument("--eval-every", type=int, default=eval_every, help="validate and save OUT/last every this many steps")
    ap.add_argument("--val-n", type=int, default=100, help="validation examples checked at each evaluation")
    if test:  # every stage but the warm-up ends with a test
        ap.add_argument("--test-n", type=int, default=0, help="test examples for the final metrics (0 = all)")
    if tau_n:
        ap.add_argument("--taus", type=float, nargs="*", default=[0.9],
                        help="faster thresholds the test adds to tau = 1.0 (the report's tau = 0.9 table reads 0.9; "
                             "its speed table decodes on its own)")
        ap.add_argument("--tau-n", type=int, default=200, help="test examples for --taus (0 = all)")
    ap.add_argument("--eval-batch", type=int, default=64, help="batch size of the validation and the test")
    add_runtime_args(ap)
    ap.add_argument("--seed", type=int, default=0, help="seed for the init, the batch order, the noise and the sampling")
    ap.add_argument("--fresh", action="store_true", help="ignore OUT/last and start over")


def check_positive(ap, args, *names):
    """argparse error for any of `names` (attribute names) below 1."""
    bad = [f"--{n.replace('_', '-')} {getattr(args, n)}" for n in names if getattr(args, n) < 1]
    if bad:
        ap.error("must be at least 1: " + ", ".join(bad))


def setup(args):
    """Resolve --dtype auto, print the config and return OUT as a Path.

    OUT is not made here: its first log record or checkpoint makes it, so a start that fails on its inputs
    (a missing checkpoint, another dataset's tokenizer) leaves nothing behind. metrics.json and the
    predictions describe a finished stage's checkpoint: a run that may change the checkpoint deletes them
    first, so an interrupted run is never taken for a finished one (run.sh skips a stage whose metrics.json
    exists). --fresh also drops OUT/last."""
    args.dtype = resolve_dtype(args.dtype, args.device)
    out = Path(args.out)
    if not is_main():  # rank 0 owns OUT
        return out
    print("config:", json.dumps(vars(args)))
    for stale in [out / "metrics.json", *out.glob("predictions*.jsonl")]:
        stale.unlink(missing_ok=True)
    if args.fresh:
        shutil.rmtree(out / "last", ignore_errors=True)
    return out


# ----------------------------------------------------------------------------- several processes (torchrun)
def ddp_setup(args):
    """(rank, world size). Under torchrun (RANK, WORLD_SIZE, LOCAL_RANK set) join the process group, NCCL on a GPU
    (and take cuda:LOCAL_RANK) or gloo on the CPU; a plain `python` run is rank 0 of 1 and changes nothing."""
    import torch.distributed as dist
    if "RANK" not in os.environ:
        return 0, 1
    if not dist.is_initialized():  # a second stage in the same process keeps the group
        cuda = torch.device(args.device).type == "cuda"
        if cuda:
            args.device = f"cuda:{os.environ['LOCAL_RANK']}"
            torch.cuda.set_device(args.device)
        # generous timeout: the other ranks wait while rank 0 validates alone
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(hours=2))
        atexit.register(dist.destroy_process_group)
    elif dist.get_backend() == "nccl":
        args.device = f"cuda:{os.environ['LOCAL_RANK']}"
    return dist.get_rank(), dist.get_world_size()


def distributed():
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def is_main():
    """Rank 0, the process that validates, tests and writes OUT (always true without torchrun)."""
    return not distributed() or torch.distributed.get_rank() == 0


def my_share(items):
    """This rank's contiguous slice of a list every rank computes the same; it must split evenly, so that every
    rank's loss averages over as many examples (then the mean of the ranks' gradients is the whole batch's)."""
    if not distributed():
        return items
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if len(items) % world:
        raise SystemExit(f"error: {len(items)} examples per step do not split over {world} processes")
    n = len(items) // world
    return items[rank * n:(rank + 1) * n]


def all_sum(values):
    """The sums of a list of numbers over all ranks (the numbers themselves in one process)."""
    if not distributed():
        return list(values)
    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"  # NCCL reduces GPU tensors only
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return t.tolist()


def all_mean(values):
    """The means of a list of numbers over all ranks."""
    world = torch.distributed.get_world_size() if distributed() else 1
    return [v / world for v in all_sum(values)]


def sync_grads(model):
    """Average the gradients over the ranks, after backward and before clipping (a no-op in one process).
    Done by hand rather than with DistributedDataParallel: the losses call model.model and model.lm_head
    directly, past DDP's forward hook. A rank that had nothing to train on this step contributes zeros."""
    if not distributed():
        return
    world = torch.distributed.get_world_size()
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])  # one collective, not one per tensor
    torch.distributed.all_reduce(flat)
    flat /= world
    for p, g, avg in zip(params, grads, flat.split([g.numel() for g in grads])):
        p.grad = g.copy_(avg.view_as(g))
