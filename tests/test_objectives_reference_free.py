"""SimPO, CPO, ORPO and KTO objectives (losses.py, "reference-free objectives and KTO").

Each is checked against values worked out by hand from its paper's formula (plain ``math``,
float64), against TRL 1.16's own loss code on the same log-probs, against its config file, and
through ``Objective.compute``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

import losses
from objectives import kto, reference_free

CONFIG_DIR = Path(__file__).resolve().parent.parent / "config"
NAMES = ("simpo", "cpo", "orpo", "kto")
pytestmark = pytest.mark.filterwarnings("ignore:You are importing from 'trl.experimental'")


def sig(u: float) -> float:
    return 1 / (1 + math.exp(-u))


def neg_log_sig(u: float) -> float:
    """-log sigmoid(u), by hand."""
    return math.log1p(math.exp(-u)) if u > -30 else -u + math.log1p(math.exp(u))


def t64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def grads(loss: torch.Tensor, *tensors: torch.Tensor) -> list[list[float]]:
    return [g.tolist() for g in torch.autograd.grad(loss.sum(), tensors)]


# ---------------------------------------------------------------------------- 1. hand-worked values and gradients

# (avg_w, avg_l): an ordinary pair, a reversed one, a tie, and extremes both ways
SIMPO_PAIRS = [(-0.8, -1.3), (-2.0, -0.5), (-1.0, -1.0), (-0.05, -40.0), (-45.0, -0.01)]


@pytest.mark.parametrize(("beta", "gamma", "eps"), [(2.0, 1.0, 0.0), (2.5, 0.3, 0.2)])
def test_simpo_by_hand(beta, gamma, eps):
    w, lo = t64([p[0] for p in SIMPO_PAIRS]), t64([p[1] for p in SIMPO_PAIRS])
    out, cr, rr = reference_free.simpo_objective(w, lo, beta, gamma, eps)
    gw, gl = grads(out, w, lo)
    for i, (aw, al) in enumerate(SIMPO_PAIRS):
        u = beta * aw - beta * al - gamma  # Eq. 6: beta/|y_w| log pi(y_w) - beta/|y_l| log pi(y_l) - gamma
        assert out[i].item() == pytest.approx((1 - eps) * neg_log_sig(u) + eps * neg_log_sig(-u), rel=1e-12, abs=1e-15)
        d = beta * (-(1 - eps) * sig(-u) + eps * sig(u))  # d loss / d avg_w
        assert gw[i] == pytest.approx(d, rel=1e-10, abs=1e-15) and gl[i] == pytest.approx(-d, rel=1e-10, abs=1e-15)
        assert cr[i].item() == pytest.approx(beta * aw) and rr[i].item() == pytest.approx(beta * al)
    assert not cr.requires_grad and not rr.requires_grad
    assert math.isfinite(out.sum().item()) and all(map(math.isfinite, gw + gl))


# summed log-probs (w, lo, nll per token)
CPO_ROWS = [(-20.0, -35.0, 1.2), (-50.0, -12.0, 2.5), (-7.0, -7.0, 0.3), (-250.0, -3.0, 4.0)]


@pytest.mark.parametrize(("beta", "eps", "alpha"), [(0.1, 0.0, 1.0), (0.5, 0.1, 0.0), (0.2, 0.0, 0.7)])
def test_cpo_by_hand(beta, eps, alpha):
    w, lo, nll = (t64([r[k] for r in CPO_ROWS]) for k in range(3))
    out, cr, rr, metrics = reference_free.cpo_objective(w, lo, nll, beta, eps, alpha)
    gw, gl, gn = grads(out, w, lo, nll)
    for i, (lw, ll, n) in enumerate(CPO_ROWS):
        u = beta * (lw - ll)
        expected = (1 - eps) * neg_log_sig(u) + eps * neg_log_sig(-u) + alpha * n
        assert out[i].item() == pytest.approx(expected, rel=1e-12)
        d = beta * (-(1 - eps) * sig(-u) + eps * sig(u))
        assert gw[i] == pytest.approx(d, rel=1e-10, abs=1e-15) and gl[i] == pytest.approx(-d, rel=1e-10, abs=1e-15)
        assert gn[i] == pytest.approx(alpha)
        assert cr[i].item() == pytest.approx(beta * lw) and rr[i].item() == pytest.approx(beta * ll)
    assert metrics["nll"].tolist() == [r[2] for r in CPO_ROWS]


def hand_log_odds(x: float) -> float:
    """log p - log(1 - p), p = e^x; 1 - p as -expm1(x) so that p near 1 keeps its digits."""
    return x - math.log(-math.expm1(x))


# mean log-probs per token (w, lo, nll); row 3: p_w = e^-1e-6, nearly 1; row 4: p_l nearly 0
ORPO_ROWS = [(-0.7, -1.4, 0.7), (-2.2, -0.3, 2.2), (-1e-6, -5.0, 1e-6), (-0.9, -60.0, 0.9)]


@pytest.mark.parametrize("lam", [0.1, 1.0])
def test_orpo_by_hand(lam):
    w, lo, nll = (t64([r[k] for r in ORPO_ROWS]) for k in range(3))
    out, cr, rr, metrics = reference_free.orpo_objective(w, lo, nll, lam)
    gw, gl, gn = grads(out, w, lo, nll)
    for i, (aw, al, n) in enumerate(ORPO_ROWS):
        z = hand_log_odds(aw) - hand_log_odds(al)  # Eq. 6: log(odds(y_w) / odds(y_l))
        assert out[i].item() == pytest.approx(n + lam * neg_log_sig(z), rel=1e-9)  # Eq. 7: L_SFT + lambda L_OR
        # d log odds(x) / dx = 1 / (1 - e^x); d(-log sigmoid(z)) / dz = -sigmoid(-z)
        assert gw[i] == pytest.approx(-lam * sig(-z) / -math.expm1(aw), rel=1e-6)
        assert gl[i] == pytest.approx(lam * sig(-z) / -math.expm1(al), rel=1e-6)
        assert gn[i] == 1.0
        assert metrics["log_odds_chosen"][i].item() == pytest.approx(z, rel=1e-9)
        assert metrics["log_odds_ratio"][i].item() == pytest.approx(-neg_log_sig(z), rel=1e-9, abs=1e-15)
        assert cr[i].item() == pytest.approx(lam * aw) and rr[i].item() == pytest.approx(lam * al)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_orpo_certain_or_empty_response_stays_finite(dtype):
    """p = 1 exactly (mean log-prob 0: a response the model is sure of, or one with no token)."""
    w = torch.tensor([0.0, -1e-9, -3e-8], dtype=dtype, requires_grad=True)
    lo = torch.tensor([-2.0, 0.0, -1.0], dtype=dtype, requires_grad=True)
    out, *_ = reference_free.orpo_objective(w, lo, torch.ones(3, dtype=dtype), 0.1)
    gw, gl = torch.autograd.grad(out.sum(), (w, lo))
    assert torch.isfinite(out).all() and torch.isfinite(gw).all() and torch.isfinite(gl).all()
    assert out[0].item() == pytest.approx(1.0, abs=1e-6)  # the odds-ratio term vanishes: p_w = 1 beats p_l < 1


KTO_W = [(-12.0, -13.0), (-30.0, -25.0), (-8.0, -8.0), (-5.0, -80.0)]  # (policy, reference) chosen
KTO_L = [(-15.0, -14.0), (-20.0, -26.0), (-9.0, -9.0), (-90.0, -4.0)]  # (policy, reference) rejected


def hand_kto(r: float, z0: float, beta: float, weight: float, desirable: bool) -> tuple[float, float]:
    """Eq. 8 per completion: (loss, d loss / d log pi) with v = lambda sigmoid(beta (r - z0)) or (z0 - r)."""
    a = beta * (r - z0) if desirable else beta * (z0 - r)
    loss = weight * (1 - sig(a))
    d = weight * sig(a) * (1 - sig(a)) * beta
    return loss, -d if desirable else d


@pytest.mark.parametrize(
    ("kl_diffs", "beta", "lam_d", "lam_u"),
    [([0.5, 1.5, -0.2, 2.2], 0.1, 1.0, 1.0), ([-3.0, 1.0, -0.5, 0.1], 0.5, 1.33, 0.8)],  # z0 = 1.0; z0 = max(0, -0.6)
)
def test_kto_paired_by_hand(kl_diffs, beta, lam_d, lam_u):
    pw, rw = t64([x[0] for x in KTO_W]), torch.tensor([x[1] for x in KTO_W], dtype=torch.float64)
    pl, rl = t64([x[0] for x in KTO_L]), torch.tensor([x[1] for x in KTO_L], dtype=torch.float64)
    pkl = t64([d - 10.0 for d in kl_diffs])
    rkl = torch.full((4,), -10.0, dtype=torch.float64)
    out, cr, rr, metrics = kto.kto_objective(pw, rw, pkl, rkl, beta, lam_d, lam_u, pl, rl)
    gw, gl, gkl = torch.autograd.grad(out.sum(), (pw, pl, pkl), allow_unused=True, materialize_grads=True)
    z0 = max(0.0, sum(kl_diffs) / len(kl_diffs))
    for i in range(4):
        loss_w, d_w = hand_kto(KTO_W[i][0] - KTO_W[i][1], z0, beta, lam_d, True)
        loss_l, d_l = hand_kto(KTO_L[i][0] - KTO_L[i][1], z0, beta, lam_u, False)
        assert out[i].item() == pytest.approx((loss_w + loss_l) / 2, rel=1e-12)  # mean over the pair's 2 completions
        assert gw[i].item() == pytest.approx(d_w / 2, rel=1e-9, abs=1e-18)
        assert gl[i].item() == pytest.approx(d_l / 2, rel=1e-9, abs=1e-18)
        assert cr[i].item() == pytest.approx(beta * (KTO_W[i][0] - KTO_W[i][1]))
        assert rr[i].item() == pytest.approx(beta * (KTO_L[i][0] - KTO_L[i][1]))
    assert metrics["kl"].tolist() == pytest.approx([z0] * 4)
    assert gkl.abs().sum().item() == 0.0  # z0 is detached


def test_kto_unpaired_by_hand():
    rows = KTO_W[:3] + KTO_L[:3]
    label = torch.tensor([True, True, True, False, False, False])
    p, r = t64([x[0] for x in rows]), torch.tensor([x[1] for x in rows], dtype=torch.float64)
    pkl, rkl = torch.tensor([-4.0, -6.0], dtype=torch.float64), torch.tensor([-5.0, -4.0], dtype=torch.float64)
    out, cr, rr, metrics = kto.kto_objective(p, r, pkl, rkl, 0.2, 1.5, 0.5, label=label)
    (g,) = torch.autograd.grad(out.sum(), (p,))
    z0 = 0.0  # mean of (1, -2) = -0.5, clamped
    for i, (lp, lr) in enumerate(rows):
        loss, d = hand_kto(lp - lr, z0, 0.2, 1.5 if i < 3 else 0.5, i < 3)
        assert out[i].item() == pytest.approx(loss, rel=1e-12) and g[i].item() == pytest.approx(d, rel=1e-9)
    assert cr is None and rr is None
    assert metrics["rewards_desirable"].tolist() == pytest.approx([0.2 * (a - b) for a, b in rows[:3]])
    assert metrics["rewards_undesirable"].tolist() == pytest.approx([0.2 * (a - b) for a, b in rows[3:]])
    assert metrics["kl"].tolist() == [0.0] * 6
    only_desirable = kto.kto_objective(p[:2], r[:2], pkl, rkl, 0.2, 1.0, 1.0, label=label[:2])[3]
    assert set(only_desirable) == {"kl", "rewards_desirable"}
    with pytest.raises(ValueError, match="not both or neither"):
        kto.kto_objective(p, r, pkl, rkl, 0.1, 1.0, 1.0)


# ---------------------------------------------------------------------------- 2. TRL 1.16's own loss code

LOGPS_W = [-0.8, -2.0, -1e-6, -0.05, -45.0]
LOGPS_L = [-1.3, -0.5, -5.0, -40.0, -0.01]


@pytest.fixture
def trl():
    """TRL, the reference these losses are checked against; absent without requirements-bench.txt."""
    return pytest.importorskip("trl", reason="TRL is the reference implementation here: pip install -r requirements-bench.txt")


def test_trl_is_1_16(trl):
    assert trl.__version__.startswith("1.16")


@pytest.mark.parametrize(
    ("loss_type", "beta", "gamma", "eps"),
    [("simpo", 2.0, 1.0, 0.0), ("simpo", 2.5, 0.7, 0.15), ("sigmoid", 0.1, 0, 0.0), ("sigmoid", 0.3, 0, 0.2)],
)
def test_simpo_and_cpo_match_trl_cpo_loss(trl, loss_type, beta, gamma, eps):
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    stub = SimpleNamespace(
        alpha=0.0, loss_type=loss_type, beta=beta, simpo_gamma=gamma, label_smoothing=eps,
        accelerator=SimpleNamespace(device=torch.device("cpu")),
    )  # fmt: skip
    w, lo = t64(LOGPS_W), t64(LOGPS_L)
    trl_losses, trl_cr, trl_rr = CPOTrainer.cpo_loss(stub, w, lo)
    trl_gw, trl_gl = grads(trl_losses, w, lo)
    if loss_type == "simpo":
        ours, cr, rr = reference_free.simpo_objective(w, lo, beta, gamma, eps)
    else:
        # TRL adds cpo_alpha * NLL in get_batch_loss_metrics; with alpha = 0 ours is the preference part alone
        ours, cr, rr, _ = reference_free.cpo_objective(w, lo, torch.zeros(5, dtype=torch.float64), beta, eps, 0.0)
    gw, gl = grads(ours, w, lo)
    torch.testing.assert_close(ours, trl_losses, rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.tensor(gw), torch.tensor(trl_gw), rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.tensor(gl), torch.tensor(trl_gl), rtol=0, atol=1e-6)
    torch.testing.assert_close(cr, trl_cr, rtol=0, atol=1e-6)
    torch.testing.assert_close(rr, trl_rr, rtol=0, atol=1e-6)
    if loss_type == "sigmoid":  # the NLL combination, TRL's `losses.mean() + cpo_alpha * nll`, by hand
        nll = torch.tensor([1.0, 2.0, 0.5, 3.0, 0.25], dtype=torch.float64)
        full = reference_free.cpo_objective(w, lo, nll, beta, eps, 0.6)[0]
        torch.testing.assert_close(full, trl_losses + 0.6 * nll, rtol=0, atol=1e-6)


@pytest.mark.parametrize("lam", [0.1, 0.5])
def test_orpo_matches_trl_odds_ratio_loss(trl, lam):
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    stub = SimpleNamespace(beta=lam, accelerator=SimpleNamespace(device=torch.device("cpu")))
    w, lo = t64(LOGPS_W), t64(LOGPS_L)
    trl_terms, trl_cr, trl_rr, trl_ratio_mean, trl_log_odds_mean = ORPOTrainer.odds_ratio_loss(stub, w, lo)
    trl_gw, trl_gl = grads(-trl_terms, w, lo)  # TRL's loss is `nll - losses.mean()`; it computes in float32
    nll = torch.tensor([0.8, 2.0, 1e-6, 0.05, 45.0], dtype=torch.float64)
    ours, cr, rr, metrics = reference_free.orpo_objective(w, lo, nll, lam)
    gw, gl = grads(ours, w, lo)
    torch.testing.assert_close(ours, nll - trl_terms, rtol=0, atol=1e-6)
    # gradients up to 1 / (1 - p) = 100 here: TRL's float32 rounding is relative
    torch.testing.assert_close(torch.tensor(gw), torch.tensor(trl_gw), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.tensor(gl), torch.tensor(trl_gl), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cr, trl_cr, rtol=0, atol=1e-6, check_dtype=False)  # TRL computes in float32
    torch.testing.assert_close(rr, trl_rr, rtol=0, atol=1e-6, check_dtype=False)
    assert metrics["log_odds_ratio"].mean().item() == pytest.approx(trl_ratio_mean.item(), abs=1e-6)
    assert metrics["log_odds_chosen"].mean().item() == pytest.approx(trl_log_odds_mean.item(), abs=1e-6)


def run_trl_kto(completion_logps, ref_logps, labels, kl_logps, ref_kl_logps, beta, lam_d, lam_u):
    """TRL 1.16 KTOTrainer._compute_loss (the loss is inlined there; there is no kto_loss) on given
    log-probs: a stand-in ``self`` and a stand-in model whose per-token log-probs sum to them."""
    from trl.trainer.kto_trainer import KTOTrainer

    n = len(labels)
    per_token = torch.stack([completion_logps, torch.zeros_like(completion_logps)], dim=1)  # (n, 2): sums to logps
    outputs = SimpleNamespace(log_probs=per_token, entropy=torch.zeros(n, 2), mean_logits=torch.zeros(n, 2))
    stub = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x),
        _compute_kl_logps=lambda model, batch: kl_logps,
        aux_loss_enabled=False, precompute_ref_logps=True, calculate_KL=True, loss_type="kto",
        beta=beta, desirable_weight=lam_d, undesirable_weight=lam_u,
        _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
    )  # fmt: skip
    batch = {
        "label": torch.tensor(labels),
        "input_ids": torch.zeros(n, 3, dtype=torch.long),
        "attention_mask": torch.ones(n, 3, dtype=torch.long),
        "completion_mask": torch.ones(n, 3, dtype=torch.long),
        "ref_logps": ref_logps,
        "ref_KL_logps": ref_kl_logps,
    }
    loss = KTOTrainer._compute_loss(stub, lambda **kwargs: outputs, batch, return_outputs=False)
    return loss, stub._metrics["train"]


@pytest.mark.parametrize(
    ("kl_shift", "beta", "lam_d", "lam_u"), [(1.0, 0.1, 1.0, 1.0), (-2.0, 0.5, 1.33, 0.75), (0.3, 2.0, 0.5, 2.0)]
)
def test_kto_matches_trl(trl, kl_shift, beta, lam_d, lam_u):
    pw, pl = [x[0] for x in KTO_W], [x[0] for x in KTO_L]
    rw, rl = [x[1] for x in KTO_W], [x[1] for x in KTO_L]
    pkl = torch.tensor([-3.0, -7.0, -5.5, -1.0], dtype=torch.float64)
    rkl = pkl - kl_shift + torch.tensor([0.4, -0.4, 0.1, -0.1], dtype=torch.float64)
    # paired: TRL on the unpaired version of the batch (chosen rows, then rejected rows)
    trl_in = t64(pw + pl)
    trl_loss, trl_metrics = run_trl_kto(
        trl_in, torch.tensor(rw + rl, dtype=torch.float64), [True] * 4 + [False] * 4, pkl, rkl, beta, lam_d, lam_u
    )
    (trl_grad,) = torch.autograd.grad(trl_loss, (trl_in,))
    w, lo = t64(pw), t64(pl)
    ours, cr, rr, metrics = kto.kto_objective(
        w, torch.tensor(rw).double(), pkl, rkl, beta, lam_d, lam_u, lo, torch.tensor(rl).double()
    )
    gw, gl = torch.autograd.grad(ours.mean(), (w, lo))  # the trainer's loss: sum over pairs / pairs
    assert ours.mean().item() == pytest.approx(trl_loss.item(), abs=1e-6)
    torch.testing.assert_close(torch.cat([gw, gl]), trl_grad, rtol=0, atol=1e-6)
    assert metrics["kl"][0].item() == pytest.approx(trl_metrics["kl"][0], abs=1e-6)
    assert cr.mean().item() == pytest.approx(trl_metrics["rewards/chosen"][0], abs=1e-6)
    assert rr.mean().item() == pytest.approx(trl_metrics["rewards/rejected"][0], abs=1e-6)
    # unpaired, mixed labels
    labels = [True, False, False, True, False, True, True]
    logps, refs = [pw[0], pl[1], pl[2], pw[3], pl[0], pw[1], pw[2]], [rw[0], rl[1], rl[2], rw[3], rl[0], rw[1], rw[2]]
    trl_in = t64(logps)
    trl_loss, trl_metrics = run_trl_kto(trl_in, torch.tensor(refs, dtype=torch.float64), labels, pkl, rkl, beta, lam_d, lam_u)
    (trl_grad,) = torch.autograd.grad(trl_loss, (trl_in,))
    p = t64(logps)
    ours, _, _, metrics = kto.kto_objective(
        p, torch.tensor(refs).double(), pkl, rkl, beta, lam_d, lam_u, label=torch.tensor(labels)
    )
    (g,) = torch.autograd.grad(ours.mean(), (p,))
    assert ours.mean().item() == pytest.approx(trl_loss.item(), abs=1e-6)
    torch.testing.assert_close(g, trl_grad, rtol=0, atol=1e-6)
    assert metrics["rewards_desirable"].mean().item() == pytest.approx(trl_metrics["rewards/chosen"][0], abs=1e-6)
    assert metrics["rewards_undesirable"].mean().item() == pytest.approx(trl_metrics["rewards/rejected"][0], abs=1e-6)


# ---------------------------------------------------------------------------- 3. config files and validation


@pytest.mark.parametrize("name", NAMES)
def test_yaml_matches_declaration_and_composes(name):
    from hydra import compose, initialize_config_dir

    decl = losses.OBJECTIVES[name]
    on_disk = yaml.safe_load((CONFIG_DIR / "loss" / f"{name}.yaml").read_text())
    assert on_disk == {"name": name, **{k: key.default for k, key in decl.keys.items()}}
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=[f"loss={name}"])
    assert losses.validate_loss_config(cfg.loss) is decl


EXPECTED_DECLARATIONS = {
    "simpo": dict(reference=False, average_log_prob=True, nll=False, unpaired=False, mismatched_kl=False),
    "cpo": dict(reference=False, average_log_prob=False, nll=True, unpaired=False, mismatched_kl=False),
    "orpo": dict(reference=False, average_log_prob=True, nll=True, unpaired=False, mismatched_kl=False),
    "kto": dict(reference=True, average_log_prob=False, nll=False, unpaired=True, mismatched_kl=True),
}


@pytest.mark.parametrize("name", NAMES)
def test_declarations(name):
    decl = losses.OBJECTIVES[name]
    assert {k: getattr(decl, k) for k in EXPECTED_DECLARATIONS[name]} == EXPECTED_DECLARATIONS[name]
    assert decl.uses_reference({"name": name}) is EXPECTED_DECLARATIONS[name]["reference"]


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"name": "simpo", "gamma": -0.5}, "loss.gamma must be >= 0"),
        ({"name": "simpo", "beta": 0.0}, "loss.beta must be > 0"),
        ({"name": "simpo", "label_smoothing": 0.5}, "loss.label_smoothing must be in [0, 0.5)"),
        ({"name": "cpo", "beta": -1.0}, "loss.beta must be > 0"),
        ({"name": "cpo", "cpo_alpha": -0.1}, "loss.cpo_alpha must be >= 0"),
        ({"name": "cpo", "nll_weight": 1.0}, "has no key 'nll_weight'"),
        ({"name": "orpo", "beta": 0}, "loss.beta must be > 0"),
        ({"name": "kto", "desirable_weight": 0.0}, "loss.desirable_weight must be > 0"),
        ({"name": "kto", "undesirable_weight": -1.0}, "loss.undesirable_weight must be > 0"),
        ({"name": "kto", "beta": 0.0}, "loss.beta must be > 0"),
        ({"name": "kto", "nll_weight": -0.1}, "loss.nll_weight must be >= 0"),
    ],
)
def test_bad_values_give_one_sentence(config, words):
    with pytest.raises(losses.ObjectiveConfigError) as err:
        losses.validate_loss_config(config)
    message = str(err.value)
    assert words in message and message.count(". ") == 0 and message.endswith(".") and "\n" not in message


# ---------------------------------------------------------------------------- 4. Objective.compute


def test_compute_simpo_cpo_orpo_with_nll():
    w = torch.tensor([-0.8, -2.0, -0.3])
    lo = torch.tensor([-1.3, -0.5, -0.3])
    nll = torch.tensor([0.8, 2.0, 0.3])
    inputs = losses.ObjectiveInputs(policy_chosen_logps=w, policy_rejected_logps=lo, policy_chosen_nll=nll)
    for name in ("simpo", "cpo", "orpo"):
        plain = losses.OBJECTIVES[name].compute(inputs, {"name": name})
        assert plain.losses.shape == (3,) and plain.chosen_rewards.shape == (3,)
    simpo = losses.OBJECTIVES["simpo"].compute(inputs, {"name": "simpo", "beta": 2.0, "gamma": 0.5, "nll_weight": 0.4})
    expected = [neg_log_sig(2.0 * (a - b) - 0.5) + 0.4 * n for a, b, n in zip(w.tolist(), lo.tolist(), nll.tolist())]
    assert simpo.losses.tolist() == pytest.approx(expected, rel=1e-6)
    assert simpo.metrics["nll"].tolist() == pytest.approx(nll.tolist())
    cpo = losses.OBJECTIVES["cpo"].compute(inputs, {"name": "cpo"}, beta=0.2)  # this epoch's beta wins
    expected = [neg_log_sig(0.2 * (a - b)) + 1.0 * n for a, b, n in zip(w.tolist(), lo.tolist(), nll.tolist())]
    assert cpo.losses.tolist() == pytest.approx(expected, rel=1e-6)
    orpo = losses.OBJECTIVES["orpo"].compute(inputs, {"name": "orpo"})
    expected = [
        n + 0.1 * neg_log_sig(hand_log_odds(a) - hand_log_odds(b)) for a, b, n in zip(w.tolist(), lo.tolist(), nll.tolist())
    ]
    assert orpo.losses.tolist() == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError, match="needs policy_chosen_nll"):
        losses.OBJECTIVES["cpo"].compute(losses.ObjectiveInputs(policy_chosen_logps=w, policy_rejected_logps=lo), {"name": "cpo"})


def test_compute_kto_paired_and_unpaired_with_nll():
    kto = losses.OBJECTIVES["kto"]
    pw, rw = torch.tensor([x[0] for x in KTO_W]), torch.tensor([x[1] for x in KTO_W])
    pl, rl = torch.tensor([x[0] for x in KTO_L]), torch.tensor([x[1] for x in KTO_L])
    pkl, rkl = torch.tensor([-3.0, -5.0, -4.0, -4.0]), torch.tensor([-4.0, -5.0, -4.5, -4.5])  # z0 = 0.5
    nll = torch.tensor([1.0, 2.0, 3.0, 4.0])
    paired = losses.ObjectiveInputs(
        policy_chosen_logps=pw, policy_rejected_logps=pl, reference_chosen_logps=rw, reference_rejected_logps=rl,
        policy_kl_logps=pkl, reference_kl_logps=rkl, policy_chosen_nll=nll,
    )  # fmt: skip
    out = kto.compute(paired, {"name": "kto", "nll_weight": 0.5})
    for i in range(4):
        loss_w, _ = hand_kto(KTO_W[i][0] - KTO_W[i][1], 0.5, 0.1, 1.0, True)
        loss_l, _ = hand_kto(KTO_L[i][0] - KTO_L[i][1], 0.5, 0.1, 1.0, False)
        assert out.losses[i].item() == pytest.approx((loss_w + loss_l) / 2 + 0.5 * nll[i].item(), rel=1e-6)
    assert out.metrics["kl"].tolist() == pytest.approx([0.5] * 4)
    # unpaired: the rows are the chosen completions then the rejected ones; NLL counts on desirable rows only
    label = torch.tensor([True] * 4 + [False] * 4)
    unpaired = losses.ObjectiveInputs(
        policy_chosen_logps=torch.cat([pw, pl]), reference_chosen_logps=torch.cat([rw, rl]),
        policy_kl_logps=pkl, reference_kl_logps=rkl, policy_chosen_nll=torch.cat([nll, nll]), label=label,
    )  # fmt: skip
    out_u = kto.compute(unpaired, {"name": "kto", "nll_weight": 0.5})
    assert out_u.chosen_rewards is None and out_u.rejected_rewards is None
    assert out_u.losses.sum().item() == pytest.approx(
        2 * (out.losses.sum().item() - 0.5 * nll.sum().item()) + 0.5 * nll.sum().item(), rel=1e-6
    )
    assert out_u.metrics["nll"].tolist() == [1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="needs policy_kl_logps"):
        kto.compute(losses.ObjectiveInputs(policy_chosen_logps=pw, reference_chosen_logps=rw, label=label[:4]), {"name": "kto"})
