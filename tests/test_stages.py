"""The training stages' own mechanics: CFT learns, OPD's divergence and fixed point, RL's reward plumbing."""
import pytest
import torch

from conftest import EOS, MASK, PAD, random_prompts, tiny
from decode import diffusion_generate
from model import diffusion_loss, token_kl
from opd import opd_loss, opd_losses
from rl import clipped_loss, group_advantages, policy_update, rollout_logprobs


@pytest.mark.parametrize("noise_shape", ["random", "suffix", "mixed"])
def test_cft_loss_goes_down_on_a_tiny_model(noise_shape):
    model = tiny()
    model.train()
    batch = {"prompt_ids": random_prompts(4), "response_ids": random_prompts(4, 9, 14, seed=5), "n_reasoning": [4] * 4}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(40):
        g = torch.Generator().manual_seed(step)
        loss, n = diffusion_loss(model, batch, 4, MASK, EOS, t_range=(0.02, 0.98), generator=g, noise_shape=noise_shape)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert n > 0 and sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5


def test_kl_matches_its_closed_form():
    p = torch.tensor([[0.5, 0.25, 0.25], [0.9, 0.05, 0.05]])
    q = torch.tensor([[0.25, 0.25, 0.5], [1 / 3, 1 / 3, 1 / 3]])
    forward = (p * (p / q).log()).sum(-1)   # KL(p || q), p = teacher
    reverse = (q * (q / p).log()).sum(-1)   # KL(q || p), q = student
    logits_q = q.log() + 7.0                # any constant shift: the student gives raw logits
    assert torch.allclose(token_kl(p.log(), logits_q), forward, atol=1e-6)
    assert torch.allclose(token_kl(p.log(), logits_q, reverse=True), reverse, atol=1e-6)
    assert token_kl(p.log(), p.log()).abs().max() < 1e-6


def test_opd_with_itself_as_teacher_at_block_one_is_zero_with_no_gradient():
    model = tiny(sharpen=4.0)
    prompts = random_prompts(3)
    roll = diffusion_generate(model, prompts, 1, 0.9, 12, MASK, EOS, PAD, temperature=1.0,
                              generator=torch.Generator().manual_seed(0))
    loss = opd_loss(model, model, prompts, roll, 1, MASK, PAD)
    loss.backward()
    assert abs(loss.item()) < 1e-5
    assert max(p.grad.abs().max().item() for p in model.parameters() if p.grad is not None) < 1e-5


def test_opd_loss_is_positive_against_another_teacher():
    student, teacher = tiny(sharpen=4.0), tiny(seed=1, sharpen=4.0)
    prompts = random_prompts(2)
    roll = diffusion_generate(student, prompts, 4, 0.9, 12, MASK, EOS, PAD)
    assert opd_loss(student, teacher, prompts, roll, 4, MASK, PAD).item() > 0.01


def test_opd_gradient_does_not_depend_on_how_many_canvases_go_through_at_once_or_share_a_row():
    """--rows bounds memory and --pack saves time, not maths: one canvas per backward, or three canvases
    in one row, give the gradient of all at once."""
    student, teacher = tiny(sharpen=4.0), tiny(seed=1, sharpen=4.0)
    prompts = random_prompts(3)
    roll = diffusion_generate(student, prompts, 4, 0.9, 12, MASK, EOS, PAD, temperature=1.0,
                              generator=torch.Generator().manual_seed(3))
    grads, totals = [], []
    for max_rows, pack in ((64, 1), (64, 3), (1, 1)):  # the last: one part per canvas
        student.zero_grad()
        parts = list(opd_losses(student, teacher, prompts, roll, 4, MASK, PAD, max_rows=max_rows, pack=pack))
        for part in parts:
            part.backward()
        totals.append(sum(p.item() for p in parts))
        grads.append(torch.cat([p.grad.flatten() for p in student.parameters() if p.grad is not None]))
    assert len(parts) > 1 and max(abs(t - totals[0]) for t in totals) < 1e-5
    assert all(torch.allclose(g, grads[0], atol=1e-6) for g in grads[1:])


def all_logprobs(model, policy, prompts, roll, block, max_rows=64):
    parts = list(rollout_logprobs(model, policy, prompts, roll, block, MASK, PAD, 1.0, max_rows))
    return torch.cat([lp for lp, _ in parts]), torch.cat([o for _, o in parts])


def test_zero_variance_groups_are_dropped():
    adv = group_advantages([1.0, 1.0, 1.0, 0.5, -1.0, 0.2], group=3)
    assert adv[:3] == [None, None, None]
    assert all(a is not None for a in adv[3:]) and abs(sum(adv[3:])) < 1e-6


def test_unchanged_policy_has_ratio_exactly_one():
    model = tiny(sharpen=30.0)
    prompts = random_prompts(2)
    roll = diffusion_generate(model, prompts, 4, 0.8, 12, MASK, EOS, PAD, temperature=1.0,
                              generator=torch.Generator().manual_seed(1))
    logp, owner = all_logprobs(model, "diffusion", prompts, roll, 4)
    again, _ = all_logprobs(model, "diffusion", prompts, roll, 4)
    assert torch.equal(torch.exp(again - logp.detach()), torch.ones_like(logp))
    loss, clipped = clipped_loss(again, logp.detach(), torch.ones_like(logp), 0.2)
    assert clipped == 0 and torch.allclose(loss, -torch.ones_like(logp).sum())
    assert len(owner) == sum(len(t) for t in roll.tokens)
    one_row, _ = all_logprobs(model, "diffusion", prompts, roll, 4, max_rows=1)  # same tokens, same order
    assert torch.allclose(one_row, logp, atol=1e-5)


def test_ar_policy_log_probs_are_the_causal_ones():
    from decode import ar_generate
    model = tiny(sharpen=4.0)
    prompts = random_prompts(2)
    roll = ar_generate(model, prompts, 8, EOS, PAD, temperature=1.0, generator=torch.Generator().manual_seed(2))
    logp, _ = all_logprobs(model, "ar", prompts, roll, 1)
    p, r = prompts[0], roll.tokens[0]
    ref = torch.log_softmax(model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1:-1], -1)
    assert torch.allclose(logp[:len(r)], ref.gather(1, torch.tensor(r)[:, None])[:, 0], atol=1e-5)


@pytest.mark.parametrize("policy", ["ar", "diffusion"])
def test_one_update_moves_probability_from_the_worse_rollout_to_the_better(policy):
    """The sign of the whole RL update: log pi(better) - log pi(worse) rises (first order: by lr * |grad|)."""
    from types import SimpleNamespace

    from decode import ar_generate
    model = tiny(sharpen=2.0)
    prompts = random_prompts(1) * 2  # one prompt, two rollouts of it
    gen, block = torch.Generator().manual_seed(3), 1 if policy == "ar" else 4
    roll = (ar_generate(model, prompts, 8, EOS, PAD, temperature=1.0, generator=gen) if policy == "ar" else
            diffusion_generate(model, prompts, 4, 0.8, 12, MASK, EOS, PAD, temperature=1.0, generator=gen))
    assert roll.tokens[0] != roll.tokens[1]

    def summed_logp():
        with torch.no_grad():
            logp, owner = all_logprobs(model, policy, prompts, roll, block)
        return [logp[owner == i].sum().item() for i in (0, 1)]

    before = summed_logp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    args = SimpleNamespace(updates=1, chunk=8, temperature=1.0, rows=64, pack=2, clip=0.2)
    tok = SimpleNamespace(mask_token_id=MASK, pad_token_id=PAD)
    clip_frac = policy_update(model, opt, policy, prompts, roll, [1.0, -1.0], [0, 1], block, tok, args)
    after = summed_logp()
    assert clip_frac == 0.0  # one update: the ratio is exactly 1
    assert (after[0] - before[0]) - (after[1] - before[1]) > 1e-3


@pytest.mark.parametrize("script,args,message", [
    ("opd", ["--group", "0"], "--group and --prompts-per-step must be at least 1"),
    ("rl", ["--group", "1"], "--group must be at least 2"),  # one rollout: no group to compare it with
    ("rl", ["--prompts-per-step", "0"], "--prompts-per-step at least 1"),
    ("opd", ["--lambda-r", "0.1"], "unrecognized arguments: --lambda-r"),  # OPD's and RL's losses weight no tokens
    ("rl", ["--lambda-o", "2"], "unrecognized arguments: --lambda-o"),
])
def test_settings_that_cannot_train_are_refused_with_a_clear_error(script, args, message, capsys):
    import importlib
    with pytest.raises(SystemExit):
        importlib.import_module(script).parse_args(args)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("script,flag", [("opd", "--pack"), ("opd", "--rows"), ("rl", "--pack"), ("rl", "--chunk")])
def test_replay_sizes_below_one_are_refused_with_a_clear_error(script, flag, capsys):
    import importlib
    with pytest.raises(SystemExit):
        importlib.import_module(script).parse_args([flag, "0"])
    assert "--rows, --pack and --chunk must be at least 1" in capsys.readouterr().err


def test_cft_refuses_an_ar_loss_on_a_block_context(capsys):
    import cft
    with pytest.raises(SystemExit):
        cft.parse_args(["--context", "block", "--ar-weight", "0.5"])
    assert cft.parse_args(["--context", "block"]).ar_weight == 0.0 and cft.parse_args([]).ar_weight == 2.0
    assert "--ar-weight needs --context causal" in capsys.readouterr().err


def test_cft_refuses_a_suffix_share_outside_zero_to_one(capsys):
    import cft
    with pytest.raises(SystemExit):
        cft.parse_args(["--noise-shape", "mixed", "--suffix-frac", "1.5"])
    assert "--suffix-frac is a share of blocks, between 0 and 1, got 1.5" in capsys.readouterr().err
    assert cft.parse_args(["--noise-shape", "mixed", "--suffix-frac", "1"]).suffix_frac == 1.0
