"""TRL's pairwise DPO loss family and ``loss=mix`` (losses.py, "TRL's pairwise family").

1. Each objective's per-example values and gradients against the paper's formula worked out
   with plain ``math`` on hand-picked pairs (one with a large margin).
2. Each against TRL 1.16's own ``DPOTrainer._compute_loss`` on the same per-token log-probs.
3. Each ``config/loss/<name>.yaml`` against its declaration; each composes through Hydra.
4. ``validate_loss_config``'s sentences.
"""

from __future__ import annotations

import collections
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import losses
from objectives import mix

REPO = Path(__file__).resolve().parents[1]
NAMES = [
    "hinge",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sigmoid_norm",
]
BETA = 0.5

# (policy chosen, policy rejected, reference chosen, reference rejected, |y_w|, |y_l|): summed log-probs.
# h_w, h_l = (1, -0.5), (-1, 1.5), (0, 0), (1, -997): gaps 1.5, -2.5, 0, 998 (the last a large margin).
PAIRS = [
    (-10.0, -12.0, -11.0, -11.5, 5, 6),
    (-20.0, -18.0, -19.0, -19.5, 8, 4),
    (-5.0, -7.0, -5.0, -7.0, 3, 3),
    (-1.0, -1000.0, -2.0, -3.0, 2, 10),
]


# ----------------------------------------------------------------------------- plain-math formulas


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def dsig(x: float) -> float:
    return sig(x) * sig(-x)


def smoothed(z: float, eps: float) -> tuple[float, float]:
    """-(1-eps) log σ(z) - eps log σ(-z) and its derivative in z."""
    return -(1 - eps) * logsig(z) - eps * logsig(-z), -(1 - eps) * sig(-z) + eps * sig(z)


def by_hand(name: str, cfg: dict, pairs=PAIRS) -> tuple[list[float], list[float], list[float]]:
    """(losses, d sum(losses) / d policy_chosen, d sum(losses) / d policy_rejected) per pair."""
    b = BETA
    hw = [pc - rc for pc, pr, rc, rr, nw, nl in pairs]
    hl = [pr - rr for pc, pr, rc, rr, nw, nl in pairs]
    if name in ("aot", "aot_unpaired"):  # losses by rank; the gradient flows back through the sort
        eps = cfg.get("label_smoothing", 0.0)
        if name == "aot":
            a = [pc - pr for pc, pr, rc, rr, nw, nl in pairs]
            r = [rc - rr for pc, pr, rc, rr, nw, nl in pairs]
        else:
            a, r = hw, hl
        order_a = sorted(range(len(a)), key=a.__getitem__)
        order_r = sorted(range(len(r)), key=r.__getitem__)
        out, g_w, g_l = [], [0.0] * len(a), [0.0] * len(a)
        for i, k in zip(order_a, order_r):
            value, dz = smoothed(b * (a[i] - r[k]), eps)
            out.append(value)
            g_w[i] += b * dz  # a_i moves with policy_chosen_i
            g_l[i] -= b * dz if name == "aot" else 0.0
            if name == "aot_unpaired":
                g_l[k] -= b * dz  # r_k = h_l,k moves with policy_rejected_k
        return out, g_w, g_l
    out, g_w, g_l = [], [], []
    for (*_, nw, nl), w, lo in zip(pairs, hw, hl):
        d = w - lo
        z = b * d
        if name == "hinge":
            value, dw, dl = max(0.0, 1 - z), (-b if 1 - z > 0 else 0.0), (b if 1 - z > 0 else 0.0)
        elif name == "exo_pair":
            eps = cfg["label_smoothing"]
            qw, ql = sig(z), sig(-z)
            value = qw * (logsig(z) - math.log(1 - eps)) + ql * (logsig(-z) - math.log(eps))
            dz = qw * ql * (z - math.log((1 - eps) / eps))
            dw, dl = b * dz, -b * dz
        elif name == "nca_pair":
            value = -logsig(b * w) - 0.5 * logsig(-b * w) - 0.5 * logsig(-b * lo)
            dw, dl = b * (-sig(-b * w) + 0.5 * sig(b * w)), b * 0.5 * sig(b * lo)
        elif name == "robust":
            eps = cfg["label_smoothing"]
            value = (-(1 - eps) * logsig(z) + eps * logsig(-z)) / (1 - 2 * eps)
            dz = (-(1 - eps) * sig(-z) - eps * sig(z)) / (1 - 2 * eps)
            dw, dl = b * dz, -b * dz
        elif name == "bco_pair":
            value = -logsig(b * w) - logsig(-b * lo)
            dw, dl = -b * sig(-b * w), b * sig(b * lo)
        elif name == "sppo_hard":
            value = (w - 1 / (2 * b)) ** 2 + (lo + 1 / (2 * b)) ** 2
            dw, dl = 2 * (w - 1 / (2 * b)), 2 * (lo + 1 / (2 * b))
        elif name == "apo_zero":
            value = 1 - sig(b * w) + sig(b * lo)
            dw, dl = -b * dsig(b * w), b * dsig(b * lo)
        elif name == "apo_down":
            value = sig(b * w) + 1 - sig(z)
            dw, dl = b * dsig(b * w) - b * dsig(z), b * dsig(z)
        elif name == "discopop":
            tau = cfg.get("discopop_tau", 0.05)
            m = sig(z / tau)
            value = (1 - m) * -logsig(z) + m * math.exp(-z)
            dm = m * (1 - m) / tau
            dz = dm * logsig(z) - (1 - m) * sig(-z) + dm * math.exp(-z) - m * math.exp(-z)
            dw, dl = b * dz, -b * dz
        elif name == "sigmoid_norm":
            g = w / nw - lo / nl
            value = -logsig(b * g)
            dw, dl = -b * sig(-b * g) / nw, b * sig(-b * g) / nl
        elif name == "dpo":
            value, dz = smoothed(z, cfg.get("label_smoothing", 0.0))
            dw, dl = b * dz, -b * dz
        elif name == "ipo":  # on per-token log-probs
            g = w / nw - lo / nl
            value = (g - 1 / (2 * b)) ** 2
            dw, dl = 2 * (g - 1 / (2 * b)) / nw, -2 * (g - 1 / (2 * b)) / nl
        else:
            raise AssertionError(name)
        out.append(value)
        g_w.append(dw)
        g_l.append(dl)
    return out, g_w, g_l


def tensors(pairs=PAIRS):
    """(policy chosen, policy rejected) leaves and the ObjectiveInputs built from them, float64."""
    cols = list(zip(*pairs))
    pc = torch.tensor(cols[0], dtype=torch.float64, requires_grad=True)
    pr = torch.tensor(cols[1], dtype=torch.float64, requires_grad=True)
    nw, nl = (torch.tensor(c, dtype=torch.float64) for c in cols[4:6])
    inputs = losses.ObjectiveInputs(
        policy_chosen_logps=pc,
        policy_rejected_logps=pr,
        reference_chosen_logps=torch.tensor(cols[2], dtype=torch.float64),
        reference_rejected_logps=torch.tensor(cols[3], dtype=torch.float64),
        chosen_n_tokens=nw,
        rejected_n_tokens=nl,
        policy_chosen_nll=-pc / nw,
    )
    return pc, pr, inputs


HAND_CONFIGS = {
    "hinge": {},
    "exo_pair": {"label_smoothing": 0.1},
    "nca_pair": {},
    "robust": {"label_smoothing": 0.2},
    "bco_pair": {},
    "sppo_hard": {},
    "aot": {"label_smoothing": 0.1},
    "aot_unpaired": {"label_smoothing": 0.1},
    "apo_zero": {},
    "apo_down": {},
    "discopop": {"discopop_tau": 0.5},
    "sigmoid_norm": {},
}


@pytest.mark.parametrize("name", NAMES)
def test_value_gradient_and_rewards_match_the_papers_formula(name):
    cfg = {"name": name, "beta": BETA, **HAND_CONFIGS[name]}
    pc, pr, inputs = tensors()
    out = losses.get_objective(name).compute(inputs, cfg)
    want, want_gw, want_gl = by_hand(name, cfg)
    assert torch.isfinite(out.losses).all()
    torch.testing.assert_close(out.losses, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-12)
    out.losses.sum().backward()
    torch.testing.assert_close(pc.grad, torch.tensor(want_gw, dtype=torch.float64), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(pr.grad, torch.tensor(want_gl, dtype=torch.float64), rtol=1e-9, atol=1e-12)
    want_rc = [BETA * (p[0] - p[2]) for p in PAIRS]  # TRL's rewards: beta * (log pi - log ref), summed log-probs
    want_rr = [BETA * (p[1] - p[3]) for p in PAIRS]
    assert out.chosen_rewards.tolist() == pytest.approx(want_rc) and out.rejected_rewards.tolist() == pytest.approx(want_rr)
    assert not out.chosen_rewards.requires_grad and not out.rejected_rewards.requires_grad


def test_nll_weight_adds_the_chosen_nll_per_token():
    _, _, inputs = tensors()
    out = losses.get_objective("hinge").compute(inputs, {"name": "hinge", "beta": BETA, "nll_weight": 0.5})
    hinge, _, _ = by_hand("hinge", {})
    want = [v + 0.5 * -p[0] / p[4] for v, p in zip(hinge, PAIRS)]
    assert out.losses.tolist() == pytest.approx(want, rel=1e-12)


def test_discopop_is_finite_for_a_very_wrong_pair():
    # z = beta d = -1000: TRL's m * exp(-z) is 0 * inf = nan; the loss is -log σ(-1000) + e^{1000 - 20000} = 1000.
    pairs = [(-2000.0, 0.0, 0.0, 0.0, 1, 1)]
    _, _, inputs = tensors(pairs)
    out = losses.get_objective("discopop").compute(inputs, {"name": "discopop", "beta": BETA})
    assert out.losses.item() == pytest.approx(1000.0, rel=1e-12)


def test_mpo_mix_is_the_weighted_sum_with_the_nll():
    cfg = {"name": "mix", "beta": BETA, "losses": ["dpo", "bco_pair", "nll"], "weights": [0.8, 0.2, 1.0]}
    pc, pr, inputs = tensors()
    decl = losses.validate_loss_config(cfg)
    assert decl.uses_nll(cfg) and decl.uses_reference(cfg) and not decl.averages(cfg)
    out = decl.compute(inputs, cfg)
    dpo, dpo_w, dpo_l = by_hand("dpo", {})
    bco, bco_w, bco_l = by_hand("bco_pair", {})
    want = [0.8 * a + 0.2 * c + -p[0] / p[4] for a, c, p in zip(dpo, bco, PAIRS)]
    assert out.losses.tolist() == pytest.approx(want, rel=1e-12)
    out.losses.sum().backward()
    assert pc.grad.tolist() == pytest.approx([0.8 * a + 0.2 * c - 1 / p[4] for a, c, p in zip(dpo_w, bco_w, PAIRS)], rel=1e-12)
    assert pr.grad.tolist() == pytest.approx([0.8 * a + 0.2 * c for a, c in zip(dpo_l, bco_l)], rel=1e-12)
    assert out.metrics["loss_bco_pair"].tolist() == pytest.approx(bco, rel=1e-12)
    assert out.chosen_rewards.tolist() == pytest.approx([BETA * (p[0] - p[2]) for p in PAIRS])


def test_a_mix_gives_ipo_its_per_token_log_probs():
    cfg = {"name": "mix", "beta": BETA, "losses": ["hinge", "ipo"], "weights": [2.0, 0.5]}
    _, _, inputs = tensors()  # summed log-probs
    out = losses.validate_loss_config(cfg).compute(inputs, cfg)
    hinge, _, _ = by_hand("hinge", {})
    ipo, _, _ = by_hand("ipo", {})
    assert out.losses.tolist() == pytest.approx([2.0 * a + 0.5 * c for a, c in zip(hinge, ipo)], rel=1e-12)


def test_a_mix_without_a_reference_user_is_reference_free():
    cfg = {"name": "mix", "losses": ["dpo", "nll"], "weights": [1.0, 1.0], "reference_free": True}
    assert not losses.validate_loss_config(cfg).uses_reference(cfg)
    assert losses.get_objective("mix").uses_reference({**cfg, "losses": ["dpo", "bco_pair"]})


# ----------------------------------------------------------------------------- against TRL 1.16

# Per pair: (chosen, rejected, reference chosen, reference rejected) summed log-probs and lengths.
TRL_PAIRS = [  # reference margins in another order than the policy's (AOT's sorts matter)
    (-10.0, -12.0, -11.0, -15.0, 5, 6),
    (-20.0, -18.0, -19.0, -19.5, 3, 4),
    (-6.0, -9.0, -6.5, -8.0, 5, 2),
    (-3.0, -40.0, -2.5, -8.0, 4, 7),
]
EQUAL_CHOSEN = [(pc, pr, rc, rr, 4, nl) for pc, pr, rc, rr, _, nl in TRL_PAIRS]  # TRL's sft is a token mean


class _Accelerator:
    device = torch.device("cpu")

    @staticmethod
    def gather_for_metrics(x):
        return x

    @staticmethod
    def gather(x):
        return x


class _Model:
    """Stands in for the policy: its forward returns the given per-token log-probs (and log sum_v p_v^2, WPO's)."""

    training = True

    def __init__(self, log_probs: torch.Tensor, log_sum_sq_probs: torch.Tensor | None = None):
        self.log_probs, self.log_sum_sq_probs = log_probs, log_sum_sq_probs

    def __call__(self, **kwargs):
        zeros = torch.zeros_like(self.log_probs).detach()
        out = SimpleNamespace(log_probs=self.log_probs, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())
        out.log_sum_sq_probs = self.log_sum_sq_probs
        return out


def trl_dpo_loss(log_probs, completion_mask, ref_chosen, ref_rejected, loss_types, loss_weights, **options):
    """TRL 1.16's ``DPOTrainer._compute_loss`` on a stand-in trainer of 2B rows (chosen, then rejected): its policy returns
    the (2B, T) per-token ``log_probs`` (``options["log_sum_sq_probs"]``: WPO's), the reference is precomputed (B,) each,
    ``completion_mask`` (2B, T + 1) has the prompt at position 0; ``options`` set the trainer's other attributes
    (label_smoothing, ld_alpha, use_weighting, discopop_tau, f_divergence_type, ...)."""
    from trl.trainer.dpo_trainer import DPOTrainer

    model = _Model(log_probs, options.pop("log_sum_sq_probs", None))
    stand_in = SimpleNamespace(
        model=model,
        accelerator=_Accelerator(),
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=loss_types,
        loss_weights=loss_weights,
        beta=BETA,
        label_smoothing=0.0,
        use_weighting=False,
        args=SimpleNamespace(discopop_tau=options.pop("discopop_tau", 0.05), gradient_checkpointing_kwargs=None),
        _metrics=collections.defaultdict(lambda: collections.defaultdict(list)),
        _total_train_tokens=0,
        _tp_size=1,
    )
    vars(stand_in).update(options)
    inputs = {
        "input_ids": torch.zeros_like(completion_mask),
        "attention_mask": torch.ones_like(completion_mask),
        "completion_mask": completion_mask,
        "ref_chosen_logps": ref_chosen,
        "ref_rejected_logps": ref_rejected,
    }
    return DPOTrainer._compute_loss(stand_in, model, inputs, return_outputs=False)


def trl_and_ours(loss_types, loss_weights, trl_label_smoothing, cfg, pairs, dtype=torch.float64, **trl_options):
    """(TRL's scalar loss, its gradient per response token, our mean loss, our gradient per response
    token); the gradients are zeroed outside the responses (TRL sums log-probs over every position,
    relying on the model's zeros there, except for its sft, which masks)."""
    b = len(pairs)
    lengths = [p[4] for p in pairs] + [p[5] for p in pairs]  # rows: [chosen..., rejected...]
    summed = [p[0] for p in pairs] + [p[1] for p in pairs]
    t = max(lengths)
    mask = torch.zeros(2 * b, t + 1, dtype=torch.long)  # completion_mask; position 0 is the prompt
    values = torch.zeros(2 * b, t, dtype=dtype)
    for row, (n, total) in enumerate(zip(lengths, summed)):
        mask[row, 1 : n + 1] = 1
        values[row, :n] = torch.linspace(total / n - 0.5, total / n + 0.5, n, dtype=dtype) if n > 1 else total  # sums to `total`
    assert values.sum(1).tolist() == pytest.approx(summed)
    ref_chosen = torch.tensor([p[2] for p in pairs], dtype=dtype)
    ref_rejected = torch.tensor([p[3] for p in pairs], dtype=dtype)

    leaf = values.clone().requires_grad_(True)
    options = {"discopop_tau": cfg.get("discopop_tau", 0.05), "label_smoothing": trl_label_smoothing, **trl_options}
    trl_loss = trl_dpo_loss(leaf, mask, ref_chosen, ref_rejected, loss_types, loss_weights, **options)
    trl_loss.backward()

    ours_leaf = values.clone().requires_grad_(True)
    logps = ours_leaf.sum(1)
    n_tokens = torch.tensor(lengths, dtype=dtype)
    decl = losses.validate_loss_config(cfg)
    policy_chosen, policy_rejected = logps[:b], logps[b:]
    ref_c, ref_r = ref_chosen, ref_rejected
    if decl.averages(cfg):
        policy_chosen, policy_rejected = policy_chosen / n_tokens[:b], policy_rejected / n_tokens[b:]
        ref_c, ref_r = ref_c / n_tokens[:b], ref_r / n_tokens[b:]
    ours_inputs = losses.ObjectiveInputs(
        policy_chosen_logps=policy_chosen,
        policy_rejected_logps=policy_rejected,
        reference_chosen_logps=ref_c,
        reference_rejected_logps=ref_r,
        chosen_n_tokens=n_tokens[:b],
        rejected_n_tokens=n_tokens[b:],
        policy_chosen_nll=-logps[:b] / n_tokens[:b],
    )
    ours = decl.compute(ours_inputs, cfg).losses.mean()
    ours.backward()
    response = mask[:, 1:].to(dtype)
    return trl_loss, leaf.grad * response, ours, ours_leaf.grad * response


# (TRL's loss_type, its label_smoothing, our config)
TRL_CASES = [
    ("sigmoid", 0.0, {"name": "dpo"}),
    ("ipo", 0.0, {"name": "ipo"}),
    ("hinge", 0.0, {"name": "hinge"}),
    ("exo_pair", 0.1, {"name": "exo_pair", "label_smoothing": 0.1}),
    ("exo_pair", 1e-3, {"name": "exo_pair"}),
    ("nca_pair", 0.0, {"name": "nca_pair"}),
    ("robust", 0.2, {"name": "robust", "label_smoothing": 0.2}),
    ("bco_pair", 0.0, {"name": "bco_pair"}),
    ("sppo_hard", 0.0, {"name": "sppo_hard"}),
    ("aot", 0.1, {"name": "aot", "label_smoothing": 0.1}),
    ("aot_unpaired", 0.1, {"name": "aot_unpaired", "label_smoothing": 0.1}),
    ("apo_zero", 0.0, {"name": "apo_zero"}),
    ("apo_down", 0.0, {"name": "apo_down"}),
    ("discopop", 0.0, {"name": "discopop"}),
    ("discopop", 0.0, {"name": "discopop", "discopop_tau": 0.5}),
    ("sigmoid_norm", 0.0, {"name": "sigmoid_norm"}),
]


@pytest.mark.parametrize("loss_type, label_smoothing, cfg", TRL_CASES, ids=[f"{c[0]}-{c[2]}" for c in TRL_CASES])
def test_equals_trl_dpo_trainer(loss_type, label_smoothing, cfg):
    pytest.importorskip("trl.trainer.dpo_trainer")
    cfg = {**cfg, "beta": BETA}
    trl_loss, trl_grad, ours, our_grad = trl_and_ours([loss_type], [1.0], label_smoothing, cfg, TRL_PAIRS)
    assert ours.item() == pytest.approx(trl_loss.item(), rel=1e-6, abs=1e-6)
    torch.testing.assert_close(our_grad, trl_grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "loss_types, weights, cfg",
    [
        (["sft"], [1.0], {"name": "mix", "losses": ["nll"], "weights": [1.0]}),
        (
            ["sigmoid", "bco_pair", "sft"],  # MPO, config/loss/mpo.yaml
            [0.8, 0.2, 1.0],
            {"name": "mix", "losses": ["dpo", "bco_pair", "nll"], "weights": [0.8, 0.2, 1.0]},
        ),
        (
            ["ipo", "hinge", "apo_zero"],
            [0.5, 2.0, 0.3],
            {"name": "mix", "losses": ["ipo", "hinge", "apo_zero"], "weights": [0.5, 2.0, 0.3]},
        ),
    ],
    ids=["sft", "mpo", "ipo+hinge+apo_zero"],
)
def test_weighted_combinations_equal_trl(loss_types, weights, cfg):
    pytest.importorskip("trl.trainer.dpo_trainer")
    if "beta" in losses.get_objective("mix").keys_for(cfg):  # [nll] alone has no beta
        cfg = {**cfg, "beta": BETA}
    trl_loss, trl_grad, ours, our_grad = trl_and_ours(loss_types, weights, 0.0, cfg, EQUAL_CHOSEN)
    assert ours.item() == pytest.approx(trl_loss.item(), rel=1e-6, abs=1e-6)
    torch.testing.assert_close(our_grad, trl_grad, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- configs


def _yaml(name: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(REPO / "config" / "loss" / f"{name}.yaml"))


@pytest.mark.parametrize("name", [*NAMES, "mix", "mpo"])
def test_yaml_keys_and_defaults_equal_the_declaration(name):
    cfg = _yaml(name)
    decl = losses.get_objective(cfg.pop("name"))
    keys = decl.keys_for(cfg)
    assert list(cfg) == list(keys)
    preset = {"losses", "weights"} if name == "mpo" else set()
    assert {k: v for k, v in cfg.items() if k not in preset} == {k: s.default for k, s in keys.items() if k not in preset}
    if name == "mpo":
        assert cfg["losses"] == ["dpo", "bco_pair", "nll"] and cfg["weights"] == [0.8, 0.2, 1.0]


def test_dpo_and_ipo_yaml_declare_nll_weight():
    for name in ("dpo", "ipo"):
        assert _yaml(name)["nll_weight"] == 0.0 == losses.get_objective(name).keys["nll_weight"].default


def test_every_config_composes_through_hydra_and_validates():
    with initialize_config_dir(config_dir=str(REPO / "config"), version_base="1.3"):
        for name in [*NAMES, "mix", "mpo", "dpo", "ipo"]:
            loss = compose(config_name="config", overrides=[f"loss={name}"]).loss
            decl = losses.validate_loss_config(loss)
            assert decl.name == ("mix" if name == "mpo" else name)
            assert decl.uses_reference(loss)


@pytest.mark.parametrize(
    "cfg, sentence",
    [
        (
            {"name": "hinge", "label_smoothing": 0.1},
            "loss=hinge has no key 'label_smoothing' (its keys: ['beta', 'name', 'nll_weight']); label_smoothing is a key of "
            "loss=aot, loss=aot_unpaired, loss=cpo, loss=dpo, loss=exo_pair, loss=f_dpo, loss=mix, loss=robust, loss=simpo; remove it.",
        ),
        (
            {"name": "nca_pair", "beta": 0},
            "loss.beta must be > 0 (or a list of values > 0, one per epoch) for loss=nca_pair, got 0.",
        ),
        ({"name": "robust", "label_smoothing": 0.5}, "loss.label_smoothing must be in [0, 0.5) for loss=robust, got 0.5."),
        ({"name": "exo_pair", "label_smoothing": 0.0}, "loss.label_smoothing must be in (0, 1) for loss=exo_pair, got 0.0."),
        ({"name": "discopop", "discopop_tau": 0}, "loss.discopop_tau must be > 0 for loss=discopop, got 0."),
        (
            {"name": "mix", "losses": ["dpo", "bco_pair", "nll"], "weights": [0.8, 0.2]},
            "loss.weights has 2 entries but loss.losses has 3 (dpo, bco_pair, nll); give one weight per loss.",
        ),
        (
            {"name": "mix", "losses": ["dpo", "bco_pairr"], "weights": [1, 1]},
            "loss.losses of loss=mix names 'bco_pairr', which is not a pairwise objective; did you mean bco_pair? choose from "
            + ", ".join(sorted([n for n, d in losses.OBJECTIVES.items() if mix._mixable(d)] + ["nll"]))
            + ".",
        ),
        (
            {"name": "mix", "losses": ["dpo", "bco_pair"], "weights": [1.0, -0.2]},
            "loss.weights[1] (the weight of bco_pair) is -0.2; weights must be >= 0.",
        ),
        (
            {"name": "mix", "losses": ["dpo", "sft"], "weights": [1.0, 1.0]},
            "loss.losses of loss=mix names 'sft'; write 'nll' for the chosen responses' NLL per token "
            "(TRL's loss_type sft; loss=sft is SFT on targets alone).",
        ),
        (
            {"name": "mix", "losses": ["dpo", "exo_pair"], "weights": [1.0, 1.0]},
            "loss.label_smoothing must be in [0, 0.5) and in (0, 1) (exo_pair shares it) for loss=mix, got 0.0.",
        ),
        (
            {"name": "mix", "losses": ["dpo"], "weights": [1.0], "discopop_tau": 0.1},
            "loss=mix has no key 'discopop_tau' (its keys: "
            "['beta', 'label_smoothing', 'losses', 'name', 'nll_weight', 'reference_free', 'weights']); discopop_tau is a key of loss=discopop; remove it.",
        ),
    ],
)
def test_validate_loss_config_sentences(cfg, sentence):
    with pytest.raises(losses.ObjectiveConfigError) as info:
        losses.validate_loss_config(cfg)
    assert str(info.value) == sentence


def test_mix_components_are_pairwise_objectives():
    assert {"dpo", "ipo", "hinge", "bco_pair", "aot"} <= {n for n, d in losses.OBJECTIVES.items() if mix._mixable(d)}
    assert not any(mix._mixable(losses.OBJECTIVES[n]) for n in ("sft", "reward", "mix"))
