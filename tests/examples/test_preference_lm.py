"""examples/preference_lm.py: DPO (with RPO's NLL term) and GRPO move a fine-tuned LM to
the preferred progression step, and it stays well-formed; pure DPO moves the mass off the
rejected steps but not onto the chosen one."""

import pytest

SHORT = ["--sft-steps", "80", "--steps", "25"]


@pytest.mark.parametrize("method, extra", [
    ("dpo", []), ("grpo", []), ("grpo", ["--baseline", "leave-one-out", "--ratio", "sequence"])])
def test_preference_tuning_moves_the_model_to_the_wanted_step(example, method, extra):
    """DPO; GRPO; and RLOO's baseline with GSPO's sequence-level ratio."""
    result = example("preference_lm").main(["--method", method, *extra, *SHORT])
    assert result["before"]["well_formed"] > 0.9
    assert result["wanted_before"] < 0.4  # about 1/4: SFT used every step alike
    assert result["wanted_after"] > 0.9
    assert result["after"]["well_formed"] > 0.9
    if method == "dpo":
        assert result["reward_accuracy"] > 0.95
    else:
        assert result["train_reward_last"] > result["train_reward_first"] + 0.5


def test_pure_dpo_displaces_the_chosen_completions_likelihood(example):
    """Without the NLL term, DPO still ranks every held-out pair right, and sampling
    never picks steps 2-4 anymore, but much of their mass goes to first tokens no
    completion had: fewer well-formed samples than the SFT model's."""
    result = example("preference_lm").main(["--method", "dpo", "--nll-weight", "0", *SHORT])
    assert result["reward_accuracy"] > 0.95
    assert sum(result["after"]["shares"][1:]) < 0.05
    assert result["after"]["well_formed"] < result["before"]["well_formed"] - 0.3
