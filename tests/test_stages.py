"""The training stages' own mechanics: CFT learns, OPD's normalisation and fixed point, RL's advantages, clipped
ratio and updates, and the settings each stage refuses."""
import importlib
from types import SimpleNamespace

import pytest
import torch

import rl
from conftest import EOS, MASK, PAD, random_prompts, tiny
from decode import diffusion_generate
from model import ar_logits, diffusion_loss, token_kl, without_mask
from opd import opd_losses
from rl import clipped_loss, group_advantages, policy_update, rollout_logprobs

TOK = SimpleNamespace(mask_token_id=MASK, pad_token_id=PAD, eos_token_id=EOS)


def rollouts(model, prompts, block=4, tau=0.5, max_new=16, temperature=1.0, seed=1, seen=None):
    """Sampled rollouts; `seen` collects the decoder's logit for every committed token by (row, position)."""
    def record(b, s, canvas, committed, pred):
        for i, j in committed.nonzero().tolist():
            seen[(i, b * block + j)] = pred[i, j].clone()
    return diffusion_generate(model, prompts, block, tau, max_new, MASK, EOS, PAD, temperature=temperature,
                              generator=torch.Generator().manual_seed(seed), on_step=record if seen is not None else None)


# ----------------------------------------------------------------------------- CFT
def test_cft_loss_goes_down_on_a_micro_model():
    model = tiny()
    model.train()
    batch = {"prompt_ids": random_prompts(4), "response_ids": random_prompts(4, 9, 14, seed=5), "n_reasoning": [4] * 4}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(30):
        loss, n = diffusion_loss(model, batch, 4, MASK, generator=torch.Generator().manual_seed(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert n > 0 and sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5


# ----------------------------------------------------------------------------- OPD
def test_opd_losses_sum_to_the_mean_kl_per_token_of_each_trajectory():
    """By hand: the teacher's logits from a plain HF forward over prompt + completion, the student's from the
    decoder itself at the moment each token was committed; each trajectory weighs the same, whatever its length."""
    student, teacher = tiny(sharpen=4.0), tiny(seed=1, sharpen=4.0)
    prompts, seen = random_prompts(4), {}
    roll = rollouts(student, prompts, seen=seen)
    assert len({len(t) for t in roll.tokens}) > 1  # lengths differ: a per-token mean over the batch would differ
    parts = list(opd_losses(student, teacher, prompts, roll, 4, MASK, PAD, max_rows=3))
    by_hand = 0.0
    for i, (p, tokens) in enumerate(zip(prompts, roll.tokens)):
        with torch.no_grad():
            t_logits = teacher(input_ids=torch.tensor([p + tokens])).logits[0, len(p) - 1:-1]
        s_logits = torch.stack([seen[(i, r)] for r in range(len(tokens))])
        by_hand += token_kl(t_logits, s_logits, MASK).mean()
    assert len(parts) > 1 and abs(sum(parts).item() - by_hand.item()) <= 1e-4


def test_opd_with_itself_as_teacher_at_block_one_is_zero_with_no_gradient():
    """With B = 1 every replayed canvas is the causal prefix: the student is its own AR teacher exactly."""
    model = tiny(sharpen=4.0)
    prompts = random_prompts(3)
    roll = rollouts(model, prompts, block=1, tau=0.9, max_new=12)
    loss = sum(opd_losses(model, model, prompts, roll, 1, MASK, PAD))
    loss.backward()
    assert abs(loss.item()) < 1e-5
    assert max(p.grad.abs().max().item() for p in model.parameters() if p.grad is not None) < 1e-5


def test_latency_opd_teacher_reads_each_token_from_its_clean_prefix():
    """A block-diffusion teacher (latency OPD) scores the student's tokens with every earlier token of the block
    clean: the student itself as teacher has KL 0 against its own clean-prefix scores, and a positive KL against
    the parallel canvases it really decoded from (several tokens committed per step at tau = 0.3)."""
    model, prompts = tiny(sharpen=2.0), random_prompts(3)
    roll = rollouts(model, prompts, block=4, tau=0.3, max_new=12)
    assert any(st.count(0) > 1 for st in roll.steps)  # some step committed several tokens of a block
    with torch.no_grad():
        same = sum(opd_losses(model, model, prompts, roll, 4, MASK, PAD, clean=True, max_rows=3, teacher_block=4))
        parallel = sum(opd_losses(model, model, prompts, roll, 4, MASK, PAD, teacher_block=4))
    assert abs(same.item()) < 1e-5 and parallel.item() > 1e-3


def test_opd_gradient_does_not_depend_on_how_many_canvases_go_through_at_once():
    """--rows bounds memory, not maths: one canvas per backward gives the gradient of all at once."""
    student, teacher = tiny(sharpen=4.0), tiny(seed=1, sharpen=4.0)
    prompts = random_prompts(3)
    roll = rollouts(student, prompts, seed=3)
    grads, totals = [], []
    for max_rows in (64, 3, 1):
        student.zero_grad()
        parts = list(opd_losses(student, teacher, prompts, roll, 4, MASK, PAD, max_rows=max_rows))
        for part in parts:
            part.backward()
        totals.append(sum(p.item() for p in parts))
        grads.append(torch.cat([p.grad.flatten() for p in student.parameters() if p.grad is not None]))
    assert len(parts) > 1 and max(abs(t - totals[0]) for t in totals) < 1e-5
    assert all(torch.allclose(g, grads[0], atol=1e-6) for g in grads[1:])


# ----------------------------------------------------------------------------- RL
def test_group_advantages_are_z_scores_inside_each_group():
    rewards = [1.0, 1.0, 1.0, 0.5, -1.0, 0.2, -1.0, 0.6, 0.6]
    adv = group_advantages(rewards, group=3)
    assert adv[:3] == [None, None, None]  # every reward equal: nothing to learn from this group
    for lo in (3, 6):
        r = torch.tensor(rewards[lo:lo + 3], dtype=torch.float64)
        by_hand = (r - r.mean()) / ((r - r.mean()) ** 2).sum().div(2).sqrt()  # unbiased: n - 1 = 2
        assert adv[lo:lo + 3] == pytest.approx(by_hand.tolist(), abs=1e-6)
        assert torch.tensor(adv[lo:lo + 3]).std().item() == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_clipped_loss_by_hand(sign):
    """ratio 0.6, 1.0, 1.6 against eps 0.2. A > 0: the ratio 1.6 is clipped at 1 + eps (no gradient) and 0.6 is
    not (pessimistic); A < 0: the ratio 0.6 is clipped at 1 - eps and 1.6 is not."""
    logp_old = torch.log(torch.tensor([0.5, 0.5, 0.5]))
    logp = torch.log(torch.tensor([0.3, 0.5, 0.8])).requires_grad_()
    loss, clipped = clipped_loss(logp, logp_old, torch.full((3,), sign), 0.2)
    loss.backward()
    if sign > 0:  # -min(r, clip(r)): -0.6, -1.0, -1.2
        assert loss.item() == pytest.approx(-2.8) and logp.grad.tolist() == pytest.approx([-0.6, -1.0, 0.0])
    else:         # max(r, clip(r)): 0.8, 1.0, 1.6
        assert loss.item() == pytest.approx(3.4) and logp.grad.tolist() == pytest.approx([0.0, 1.0, 1.6])
    assert clipped == 2  # both ratios outside [0.8, 1.2], whichever of them the minimum clipped


def test_rollout_log_probs_are_the_sampling_distribution_at_each_commit():
    """log pi(y_i) read from the replayed canvas is the log-probability the decoder sampled y_i with: the
    rollout's temperature, the mask token excluded. Every kept token exactly once, however the rows are chunked."""
    model, prompts, seen = tiny(sharpen=4.0), random_prompts(3), {}
    roll = rollouts(model, prompts, temperature=0.7, seen=seen)
    parts = {rows: list(rollout_logprobs(model, prompts, roll, 4, MASK, PAD, 0.7, rows)) for rows in (64, 1)}
    logp, owner = (torch.cat(x) for x in zip(*parts[64]))
    assert owner.bincount().tolist() == [len(t) for t in roll.tokens]
    for i, tokens in enumerate(roll.tokens):  # the parts come canvas by canvas: compare each rollout's values sorted
        by_hand = torch.stack([torch.log_softmax(without_mask(seen[(i, r)], MASK) / 0.7, -1)[t] for r, t in enumerate(tokens)])
        assert torch.allclose(logp[owner == i].sort().values, by_hand.sort().values, atol=1e-4)
    assert torch.allclose(torch.cat([lp for lp, _ in parts[1]]), logp, atol=1e-5)


def test_an_ar_policy_replays_to_its_causal_log_probs():
    """GR2's RL stage is the block-size-1 case: the rollouts are AR decoding (every token committed at step 0 of
    its one-token block) and the replayed log-probabilities are the AR model's causal ones, token for token."""
    model, prompts = tiny(sharpen=2.0), random_prompts(3)
    roll = rollouts(model, prompts, block=1, max_new=12, temperature=1.0)
    assert all(s in (0, -1) for steps in roll.steps for s in steps)
    logp, owner = (torch.cat(x) for x in zip(*rollout_logprobs(model, prompts, roll, 1, MASK, PAD, 1.0)))
    causal = torch.log_softmax(without_mask(ar_logits(model, prompts, roll.tokens, PAD), MASK), -1)
    chosen = torch.tensor([t for tokens in roll.tokens for t in tokens])
    assert owner.tolist() == [i for i, tokens in enumerate(roll.tokens) for _ in tokens]  # (row, position) order
    assert torch.allclose(logp, causal.gather(1, chosen[:, None])[:, 0], atol=1e-5)


def update_args(updates):
    return SimpleNamespace(updates=updates, group=2, temperature=1.0, rows=64, clip=0.2)


def test_one_update_moves_probability_from_the_worse_rollout_to_the_better():
    """The sign of the whole RL update: log pi(better) - log pi(worse) rises."""
    model = tiny(sharpen=2.0)
    prompts = random_prompts(1) * 2  # one prompt, two rollouts of it
    roll = rollouts(model, prompts, tau=0.8, max_new=12, seed=3)
    assert roll.tokens[0] != roll.tokens[1]

    def summed_logp():
        with torch.no_grad():
            logp, owner = (torch.cat(x) for x in zip(*rollout_logprobs(model, prompts, roll, 4, MASK, PAD, 1.0)))
        return [logp[owner == i].sum().item() for i in (0, 1)]

    before = summed_logp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    policy_update(model, opt, prompts, roll, [1.0, -1.0], [0, 1], 4, TOK, update_args(1))
    after = summed_logp()
    assert (after[0] - before[0]) - (after[1] - before[1]) > 1e-3


def test_a_second_update_on_the_same_rollouts_sees_the_moved_policy(monkeypatch):
    """--updates 2: pi_old stays the policy that made the rollouts, so the second pass has ratios away from 1,
    and the clipped fraction counts exactly the ratios outside [1 - eps, 1 + eps]."""
    model = tiny(sharpen=2.0)
    prompts = random_prompts(2) * 2
    roll = rollouts(model, prompts, seed=2)
    ratios = []

    def spy(logp, logp_old, adv, eps):
        ratios.append(torch.exp(logp - logp_old).detach())
        return clipped_loss(logp, logp_old, adv, eps)

    monkeypatch.setattr(rl, "clipped_loss", spy)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.0)
    adv = [1.0, -1.0, -1.0, 1.0]  # rollout i answers prompt i % 2: kept groups of two, in order
    frac = policy_update(model, opt, prompts, roll, adv, [0, 1, 2, 3], 4, TOK, update_args(2))
    first, second = torch.cat(ratios[:len(ratios) // 2]), torch.cat(ratios[len(ratios) // 2:])
    assert len(first) == len(second) == sum(len(t) for t in roll.tokens)
    assert (second - 1).abs().max() > 1e-2
    assert frac == pytest.approx(((second - 1).abs() > 0.2).sum().item() / (2 * len(first)))


# ----------------------------------------------------------------------------- refused settings
@pytest.mark.parametrize("script,args,message", [
    ("sft", ["--eval-every", "0"], "must be at least 1: --eval-every 0"),
    ("cft", ["--block", "0"], "must be at least 1: --block 0"),
    ("cft", ["--t-min", "0"], "need 0 < --t-min <= --t-max <= 1, got 0.0, 0.98"),
    ("cft", ["--t-min", "0.5", "--t-max", "0.4"], "need 0 < --t-min <= --t-max <= 1, got 0.5, 0.4"),
    ("opd", ["--group", "0"], "must be at least 1: --group 0"),
    ("opd", ["--rows", "0"], "must be at least 1: --rows 0"),
    ("rl", ["--group", "1"], "--group must be at least 2, got 1"),  # one rollout: no group to compare it with
    ("rl", ["--updates", "0"], "must be at least 1: --updates 0"),
    ("rl", ["--prompts-per-step", "0"], "must be at least 1: --prompts-per-step 0"),
    ("opd", ["--lambda-r", "0.1"], "unrecognized arguments: --lambda-r"),  # OPD's and RL's losses weight no tokens
    ("rl", ["--lambda-o", "2"], "unrecognized arguments: --lambda-o"),
    ("warmup", ["--random-sids", "1.5"], "--random-sids must be in [0, 1], got 1.5"),
    ("warmup", ["--random-pool", "3"], "--random-pool must be 0, or at least 2 with --random-sids, got 3"),
    ("warmup", ["--random-sids", "0.5", "--random-pool", "1"], "--random-pool must be 0, or at least 2"),
])
def test_settings_that_cannot_train_are_refused_with_a_clear_error(script, args, message, capsys):
    with pytest.raises(SystemExit):
        importlib.import_module(script).parse_args(args)
    assert message in capsys.readouterr().err
