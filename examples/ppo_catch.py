"""PPO on Catch (bsuite's), the environment written as pure functions of tensors.

A ball falls down a 10 x 5 grid from a random column; the agent moves a paddle along the
bottom row (left, stay, right) and gets +1 if it catches the ball, -1 if not, after 9
steps. The environment is two functions of a batch of states, ``reset(key, n)`` and
``step(state, action)``, with the randomness from keys: ``--envs`` games run as one
batch, and a rollout of the same keys replays exactly.

Each iteration collects ``--horizon`` steps of every game with the current policy
(``random.categorical`` on its logits), computes advantages with ``transforms.gae``
(episode ends cut the discount), and takes ``--epochs`` Adam steps of PPO's loss:
``losses.ppo`` (the clipped surrogate) plus ``losses.value_loss`` for the critic minus an
entropy bonus. The report gives the mean return of the episodes that ended, first
iteration against the last five (the untrained policy catches about a fifth: -0.6).

    python examples/ppo_catch.py
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from tqdm import tqdm

import torchfn
from torchfn import losses, optim, random
from torchfn.transforms import gae

ROWS, COLUMNS = 10, 5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=60)
    p.add_argument("--envs", type=int, default=32)
    p.add_argument("--horizon", type=int, default=18, help="steps per game per iteration")
    p.add_argument("--epochs", type=int, default=4, help="PPO updates per batch")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def reset(key: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` new games: ``(n, 3)`` int64 states (ball row, ball column, paddle column)."""
    ball = random.randint(key, (n,), 0, COLUMNS)
    return torch.stack((torch.zeros_like(ball), ball, torch.full_like(ball, COLUMNS // 2)), 1)


def observe(state: torch.Tensor) -> torch.Tensor:
    """The grid with the ball and the paddle set: ``(n, ROWS * COLUMNS)`` float."""
    grid = torch.zeros(state.shape[0], ROWS, COLUMNS)
    rows = torch.arange(state.shape[0])
    grid[rows, state[:, 0], state[:, 1]] = 1.0
    grid[rows, ROWS - 1, state[:, 2]] = 1.0
    return grid.flatten(1)


def step(state: torch.Tensor, action: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of every game: the paddle moves by ``action - 1``, the ball falls a row.
    Returns the new states, the rewards ``(n,)`` and whether each game ended ``(n,)``."""
    paddle = (state[:, 2] + action - 1).clamp(0, COLUMNS - 1)
    row = state[:, 0] + 1
    done = row == ROWS - 1
    reward = torch.where(done, torch.where(state[:, 1] == paddle, 1.0, -1.0), 0.0)
    return torch.stack((row, state[:, 1], paddle), 1), reward, done


class ActorCritic(nn.Module):
    """An MLP with two heads: action logits ``(n, 3)`` and the state's value ``(n,)``."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(ROWS * COLUMNS, hidden), nn.Tanh(),
                                  nn.Linear(hidden, hidden), nn.Tanh())
        self.policy, self.value = nn.Linear(hidden, 3), nn.Linear(hidden, 1)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(obs)
        return self.policy(h), self.value(h)[..., 0]


def rollout(model, params, state, key, horizon: int) -> tuple[dict, torch.Tensor]:
    """``horizon`` steps of every game (a finished game restarts): the batch ``(n, T)``
    of observations, actions, log-probabilities, values, rewards and ends, and the state
    after it."""
    batch = {k: [] for k in ("obs", "action", "logp", "value", "reward", "done")}
    for t in range(horizon):
        k_act, k_reset = random.split(random.fold_in(key, t))
        obs = observe(state)
        with torch.no_grad():
            logits, value = model.apply(params, obs)
        action = random.categorical(k_act, logits)  # (n,)
        logp = torch.log_softmax(logits, -1).gather(-1, action[:, None])[:, 0]
        state, reward, done = step(state, action)
        state = torch.where(done[:, None], reset(k_reset, state.shape[0]), state)
        for k, v in zip(batch, (obs, action, logp, value, reward, done)):
            batch[k].append(v)
    return {k: torch.stack(v, 1) for k, v in batch.items()}, state


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    init_key, env_key, run_key = random.split(random.key(args.seed), 3)
    model = torchfn.Model(ActorCritic())
    params = model.init(init_key)
    opt = optim.adam(args.lr)
    opt_state = opt.init(params)
    state = reset(env_key, args.envs)

    def loss_fn(p, batch, advantages, returns):
        logits, values = model.apply(p, batch["obs"])  # (n, T, 3), (n, T)
        logp_all = torch.log_softmax(logits, -1)
        logp = logp_all.gather(-1, batch["action"][..., None])[..., 0]
        entropy = -(logp_all.exp() * logp_all).sum(-1).mean()
        return (losses.ppo(logp, batch["logp"], advantages)
                + 0.5 * losses.value_loss(values, returns) - 0.01 * entropy)

    returns_per_iteration = []
    for i in tqdm(range(args.iterations), desc="ppo", mininterval=0.5):
        batch, next_state = rollout(model, params, state, random.fold_in(run_key, i),
                                    args.horizon)
        with torch.no_grad():
            _, bootstrap = model.apply(params, observe(next_state))
        discounts = 0.99 * (~batch["done"]).float()
        advantages = gae(batch["reward"], batch["value"], discounts, bootstrap, lam=0.95)
        returns = advantages + batch["value"]
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        for _ in range(args.epochs):
            grads = torch.func.grad(loss_fn)(params, batch, advantages, returns)
            updates, opt_state = opt.update(grads, opt_state, params)
            params = optim.apply_updates(params, updates)
        state = next_state
        ended = batch["done"]
        returns_per_iteration.append(float(batch["reward"][ended].mean()))
    first, last = returns_per_iteration[0], sum(returns_per_iteration[-5:]) / 5
    print(f"mean return of finished episodes: {first:+.2f} at the first iteration, "
          f"{last:+.2f} over the last five (a catch is +1, a miss -1)")
    return {"return_first": first, "return_last": last, "history": returns_per_iteration}


if __name__ == "__main__":
    main()
