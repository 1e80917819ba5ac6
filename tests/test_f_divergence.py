"""loss=f_dpo (objectives/f_divergence.py): f-DPO (Wang et al. 2024) against its formula by hand and against TRL 1.16's
DPOTrainer with ``f_divergence_type``, to 1e-6 in the loss and every gradient."""

from __future__ import annotations

import math

import pytest
import torch
from test_objectives_trl import BETA, TRL_PAIRS, trl_and_ours

import losses

CASES = [("reverse_kl", 0.5), ("forward_kl", 0.5), ("js_divergence", 0.5), ("alpha_divergence", 0.5)]
CASES += [("alpha_divergence", 0.3), ("alpha_divergence", 1.0), ("alpha_divergence", 2.0)]


@pytest.mark.parametrize("divergence, alpha", CASES, ids=[f"{d}-{a}" for d, a in CASES])
def test_equals_trl_dpo_trainer_f_divergence(divergence, alpha):
    pytest.importorskip("trl.trainer.dpo_trainer")
    cfg = {"name": "f_dpo", "beta": BETA, "f_divergence_type": divergence, "f_alpha_divergence_coef": alpha}
    options = {"f_divergence_type": divergence, "f_alpha_divergence_coef": alpha}
    dtype = torch.float32 if divergence == "alpha_divergence" else torch.float64  # TRL's alpha clamps float32 or less
    trl_loss, trl_grad, ours, our_grad = trl_and_ours(["sigmoid"], [1.0], 0.0, cfg, TRL_PAIRS, dtype, **options)
    assert ours.item() == pytest.approx(trl_loss.item(), rel=1e-6, abs=1e-6)
    torch.testing.assert_close(our_grad, trl_grad, rtol=1e-6, atol=1e-7)


def _f_prime(u: float, divergence: str, alpha: float) -> float:
    """Wang et al. 2024, Table 1: f'(u) of each divergence, u = pi / ref."""
    return {
        "reverse_kl": math.log(u),
        "forward_kl": 1 - 1 / u,
        "js_divergence": math.log(2 * u / (1 + u)),
        "alpha_divergence": (u ** (alpha - 1) - 1) / (alpha - 1),
    }[divergence]


@pytest.mark.parametrize("divergence, alpha", [c for c in CASES if c[1] != 1.0])
def test_each_divergence_is_its_formula_by_hand(divergence, alpha):
    # One pair: log-ratios h_w = 1.0, h_l = -0.5 (u_w = e, u_l = e^-0.5); loss -log sigmoid(beta (f'(u_w) - f'(u_l))).
    cfg = {"name": "f_dpo", "beta": 0.5, "f_divergence_type": divergence, "f_alpha_divergence_coef": alpha}
    decl = losses.validate_loss_config(cfg)
    inputs = losses.ObjectiveInputs(
        policy_chosen_logps=torch.tensor([-9.0], dtype=torch.float64),
        policy_rejected_logps=torch.tensor([-12.5], dtype=torch.float64),
        reference_chosen_logps=torch.tensor([-10.0], dtype=torch.float64),
        reference_rejected_logps=torch.tensor([-12.0], dtype=torch.float64),
    )
    out = decl.compute(inputs, cfg)
    z = 0.5 * (_f_prime(math.e, divergence, alpha) - _f_prime(math.exp(-0.5), divergence, alpha))
    assert out.losses.item() == pytest.approx(math.log1p(math.exp(-z)), rel=1e-12)
    assert out.chosen_rewards.item() == pytest.approx(0.5 * 1.0) and out.rejected_rewards.item() == pytest.approx(0.5 * -0.5)


def test_a_divergence_it_does_not_know_is_one_sentence_naming_the_four():
    with pytest.raises(losses.ObjectiveConfigError, match="f_divergence_type.*reverse_kl, forward_kl, js_divergence"):
        losses.validate_loss_config({"name": "f_dpo", "f_divergence_type": "kl"})
