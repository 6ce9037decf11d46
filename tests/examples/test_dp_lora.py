"""examples/dp_lora.py: DP-SGD on LoRA adapters (all of them, or B alone) learns the
private domain the public model fails on, with the adapters' parameter counts."""


def test_dp_lora_learns_the_private_domain(example):
    lora = example("dp_lora")
    both = lora.main(["--steps", "100", "--epsilon", "8", "--lr-lora", "0.2", "--lr-full", "0.2"])
    b_only = lora.main(["--steps", "100", "--epsilon", "8", "--lr-lora", "0.3", "--freeze-a"])
    assert abs(both["epsilon"] - 8.0) < 0.05
    # rank 16 adapters on 64-256-256-10: A (16 x in) and B (out x 16) per layer
    assert both["lora_params"] == 16 * (64 + 256 + 256) + 16 * (256 + 256 + 10)
    assert b_only["lora_params"] == 16 * (256 + 256 + 10)
    assert both["full_params"] == 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
    for result in (both, b_only):  # chance is 0.1; the public model is at about that
        assert result["public_accuracy"] < 0.2
        assert result["lora_accuracy"] > 0.3
        assert result["full_accuracy"] > 0.3
