"""examples/ppo_catch.py: the environment keeps Catch's rules, a rollout replays from its
keys, and PPO (``losses.ppo`` on ``transforms.gae`` advantages) learns to catch."""

import torch

from torchfn import random


def test_catch_rules(example):
    ppo = example("ppo_catch")
    state = ppo.reset(random.key(0), 64)
    assert (state[:, 0] == 0).all() and (state[:, 2] == 2).all()
    assert set(state[:, 1].tolist()) == set(range(5))  # every start column drawn
    rewards, ends = [], []
    for _ in range(9):  # move right every step: the paddle stops at the wall
        state, reward, done = ppo.step(state, torch.full((64,), 2))
        rewards.append(reward)
        ends.append(done)
    rewards, ends = torch.stack(rewards), torch.stack(ends)
    assert ends[:8].sum() == 0 and ends[8].all()  # 9 steps a game
    assert (rewards[:8] == 0).all()
    assert torch.equal(rewards[8], torch.where(state[:, 1] == 4, 1.0, -1.0))
    assert (state[:, 2] == 4).all()


def test_a_rollout_replays_from_its_keys(example):
    import torchfn

    ppo = example("ppo_catch")
    model = torchfn.Model(ppo.ActorCritic())
    params = model.init(random.key(1))
    state = ppo.reset(random.key(2), 8)
    a, end_a = ppo.rollout(model, params, state, random.key(3), 12)
    b, end_b = ppo.rollout(model, params, state, random.key(3), 12)
    assert all(torch.equal(a[k], b[k]) for k in a) and torch.equal(end_a, end_b)
    c, _ = ppo.rollout(model, params, state, random.key(4), 12)
    assert not torch.equal(a["action"], c["action"])


def test_ppo_learns_to_catch(example):
    result = example("ppo_catch").main(["--iterations", "30"])
    assert result["return_first"] < -0.3  # the untrained policy misses most balls
    assert result["return_last"] > 0.8
