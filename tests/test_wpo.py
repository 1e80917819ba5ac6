"""loss=wpo (objectives/wpo.py): WPO (Zhou et al. 2024, Eq. 2) equal to TRL 1.16's DPOTrainer with
``use_weighting`` to 1e-6 in the loss and every gradient, its weights by hand from the softmax, the same numbers on every
forward path (packed, padded, chunked output layer) as each sequence forwarded alone, the trainer's step, and loss=mix's
refusal. (TRL's hinge with use_weighting fails in its backward: ``per_sequence_loss *= weights`` writes into relu's output.)"""

from __future__ import annotations

import math
import types

import pytest
import torch
from test_objectives_trl import BETA, TRL_PAIRS, trl_dpo_loss
from test_packed import make_model, random_pairs

import losses
import trainers
from objectives import wpo
from preference_datasets import collate


@pytest.mark.parametrize(
    "loss_type, base",
    [
        ("sigmoid", "dpo"),
        ("ipo", "ipo"),
        ("nca_pair", "nca_pair"),
        ("discopop", "discopop"),
        ("bco_pair", "bco_pair"),
        ("sigmoid_norm", "sigmoid_norm"),
    ],
)
def test_equals_trl_dpo_trainer_use_weighting(loss_type, base):
    pytest.importorskip("trl.trainer.dpo_trainer")
    dtype = torch.float64
    b = len(TRL_PAIRS)
    lengths = [p[4] for p in TRL_PAIRS] + [p[5] for p in TRL_PAIRS]  # rows: chosen..., rejected...
    t = max(lengths)
    mask = torch.zeros(2 * b, t + 1, dtype=torch.long)  # TRL's completion_mask; position 0 is the prompt
    values = torch.zeros(2 * b, t, dtype=dtype)
    log_sum_sq = torch.zeros(2 * b, t, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    for row, n in enumerate(lengths):
        mask[row, 1 : n + 1] = 1
        values[row, :n] = -torch.rand(n, generator=g, dtype=dtype) * 3  # per-token log-probs
        log_sum_sq[row, :n] = -torch.rand(n, generator=g, dtype=dtype) * 2  # log sum_v p_v^2 <= 0
    ref_chosen = torch.tensor([p[2] for p in TRL_PAIRS], dtype=dtype)
    ref_rejected = torch.tensor([p[3] for p in TRL_PAIRS], dtype=dtype)

    leaf = values.clone().requires_grad_(True)
    options = {"use_weighting": True, "log_sum_sq_probs": log_sum_sq}
    trl_loss = trl_dpo_loss(leaf, mask, ref_chosen, ref_rejected, [loss_type], [1.0], **options)
    trl_loss.backward()

    cfg = {"name": "wpo", "loss_type": base, "beta": BETA}
    decl = losses.validate_loss_config(cfg)
    ours_leaf = values.clone().requires_grad_(True)
    response = mask[:, 1:].to(dtype)
    n_tokens = response.sum(1)
    logps = ours_leaf.sum(1)
    statistic = ((values - log_sum_sq) * response).sum(1) / n_tokens  # each response's mean log weight
    ref_c, ref_r = ref_chosen, ref_rejected
    if decl.averages(cfg):
        logps, ref_c, ref_r = logps / n_tokens, ref_c / n_tokens[:b], ref_r / n_tokens[b:]
    ours_inputs = losses.ObjectiveInputs(
        policy_chosen_logps=logps[:b],
        policy_rejected_logps=logps[b:],
        reference_chosen_logps=ref_c,
        reference_rejected_logps=ref_r,
        chosen_n_tokens=n_tokens[:b],
        rejected_n_tokens=n_tokens[b:],
        policy_chosen_statistic=statistic[:b],
        policy_rejected_statistic=statistic[b:],
    )
    ours = decl.compute(ours_inputs, cfg).losses.mean()
    ours.backward()
    assert ours.item() == pytest.approx(trl_loss.item(), rel=1e-6, abs=1e-6)
    torch.testing.assert_close(ours_leaf.grad * response, leaf.grad * response, rtol=1e-6, atol=1e-7)
    unweighted = losses.get_objective(base).compute(ours_inputs, cfg).losses.mean()
    assert unweighted.item() != pytest.approx(ours.item(), rel=1e-3)  # the weights acted


def test_the_weights_by_hand_from_the_softmax():
    logits = torch.tensor([[1.0, 2.0, 0.5], [0.0, -1.0, 3.0], [0.2, 0.2, 0.2]])
    rows, targets = torch.tensor([0, 1, 1, 2]), torch.tensor([1, 2, 0, 0])  # position 1 predicts two tokens
    expected = []
    for row, target in zip(rows.tolist(), targets.tolist()):
        exp = [math.exp(z) for z in logits[row].tolist()]
        p = [e / sum(exp) for e in exp]
        expected.append(math.log(p[target]) - math.log(sum(q * q for q in p)))
    got = wpo.log_weight_per_token(logits, rows, targets)
    assert got.tolist() == pytest.approx(expected, rel=1e-6, abs=1e-6)
    assert got[3].item() == pytest.approx(0.0, abs=1e-6)  # a uniform p: p_y = sum p^2
    # one pair: chosen's tokens are the first two, rejected's the last two; the loss is DPO's times w(y_w) w(y_l)
    w_chosen, w_rejected = math.exp((expected[0] + expected[1]) / 2), math.exp((expected[2] + expected[3]) / 2)
    pc, pr, rc, rr = (torch.tensor([v]) for v in (-3.0, -4.0, -3.5, -3.6))
    inputs = losses.ObjectiveInputs(
        policy_chosen_logps=pc,
        policy_rejected_logps=pr,
        reference_chosen_logps=rc,
        reference_rejected_logps=rr,
        policy_chosen_statistic=got[:2].mean().reshape(1),
        policy_rejected_statistic=got[2:].mean().reshape(1),
    )
    out = losses.get_objective("wpo").compute(inputs, {"name": "wpo", "beta": 0.5})
    dpo = -math.log(1 / (1 + math.exp(-0.5 * ((-3.0 + 4.0) - (-3.5 + 3.6)))))
    assert out.losses.item() == pytest.approx(dpo * w_chosen * w_rejected, rel=1e-6)
    with pytest.raises(ValueError, match=r"^loss=wpo needs the policy's WPO weights"):
        losses.get_objective("wpo").compute(losses.ObjectiveInputs(pc, pr, rc, rr), {"name": "wpo"})


def by_hand(model, elements):
    """(2B,) each response's mean of log p(y_t) - log sum_v p_v^2, each sequence forwarded alone, chosen first."""
    out = {"chosen": [], "rejected": []}
    for el in elements:
        for side in out:
            ids, labels = torch.tensor([el[f"{side}_input_ids"]]), torch.tensor(el[f"{side}_labels"])
            p = torch.softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
            values = [
                math.log(p[i, labels[i + 1]]) - math.log((p[i] ** 2).sum())
                for i in range(len(labels) - 1)
                if labels[i + 1] != losses.IGNORE_INDEX
            ]
            out[side].append(sum(values) / len(values))
    return torch.tensor(out["chosen"] + out["rejected"], dtype=torch.float64)


@pytest.mark.parametrize("packed, chunk", [(True, None), (True, 3), (False, None), (False, 3)])
def test_every_forward_path_gives_the_weights_of_each_sequence_alone_by_hand(packed, chunk):
    model = make_model()
    elements = random_pairs([(5, 7, 3), (12, 2, 9), (3, 6, 6), (4, 1, 8)], seed=3)
    batch = collate(elements, pad_token_id=0)
    stub = types.SimpleNamespace(
        average_log_prob=False, device=torch.device("cpu"), max_forward_chunks=None, output_layer_chunk=chunk, packed=packed
    )
    forward = trainers.BasicTrainer.concatenated_forward
    chosen, rejected, n_tokens, statistic = forward(stub, model, batch, wpo.log_weight_per_token)
    assert not statistic.requires_grad  # from the logits, without gradient
    (chosen.sum() + rejected.sum()).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    plain = forward(stub, model, batch)  # nothing declared: the same log-probs and gradients, nothing more
    assert len(plain) == 3
    (plain[0].sum() + plain[1].sum()).backward()
    torch.testing.assert_close(chosen, plain[0], rtol=0, atol=0)
    torch.testing.assert_close(rejected, plain[1], rtol=0, atol=0)
    for grad, p in zip(grads, model.parameters()):
        torch.testing.assert_close(grad, p.grad, rtol=1e-6, atol=1e-7)
    with torch.no_grad():
        torch.testing.assert_close(statistic.double(), by_hand(model, elements), rtol=2e-5, atol=2e-5)


def test_the_trainers_step_weighs_each_pairs_loss(tmp_path):
    from test_train import build_trainer

    weighted = build_trainer(["loss=wpo"], tmp_path / "wpo")
    plain = build_trainer(["loss=dpo"], tmp_path / "dpo")
    batch = next(iter(trainers.get_batch_iterator(plain.train_examples, plain.tokenizer, 8, 64, 32, seed=0, n_examples=8)))
    loss, metrics = weighted.get_batch_metrics(batch, 8, 1.0, "train")
    plain_loss, plain_metrics = plain.get_batch_metrics(batch, 8, 1.0, "train")
    with torch.no_grad():
        _, _, _, statistic = plain.concatenated_forward(plain.policy, batch, wpo.log_weight_per_token)
    weights = torch.exp(statistic[:8] + statistic[8:])
    expected = torch.tensor(plain_metrics["loss/train"]) * weights
    assert metrics["loss/train"] == pytest.approx(expected.tolist(), rel=1e-5)
    assert loss.item() == pytest.approx(expected.sum().item() / 8, rel=1e-5)
    assert metrics["rewards_train/chosen"] == pytest.approx(plain_metrics["rewards_train/chosen"])  # rewards unweighted
    assert not torch.allclose(loss, plain_loss)  # the weights acted


def test_each_loss_type_takes_its_own_keys_and_aot_and_mix_are_refused_in_one_sentence():
    for name in wpo.WEIGHTED:
        cfg = {"name": "wpo", "loss_type": name}
        decl = losses.validate_loss_config(cfg)
        assert decl.keys_for(cfg) == {"loss_type": wpo.LOSS_TYPE, **losses.get_objective(name).keys}
        assert decl.averages(cfg) == losses.get_objective(name).averages(cfg)  # ipo: per token
    assert not losses.get_objective("wpo").uses_reference({"name": "wpo", "reference_free": True})
    with pytest.raises(losses.ObjectiveConfigError, match=r"^loss.loss_type must be one of dpo, ipo, .* for loss=wpo, got aot.$"):
        losses.validate_loss_config({"name": "wpo", "loss_type": "aot"})
    with pytest.raises(losses.ObjectiveConfigError, match=r"^loss.losses of loss=mix names 'wpo', whose inputs come from a "):
        losses.validate_loss_config({"name": "mix", "losses": ["dpo", "wpo"], "weights": [1.0, 1.0]})


@pytest.mark.parametrize("loss_type", ["ipo", "hinge", "f_dpo"])
def test_the_yaml_with_only_loss_type_composes_to_that_losss_own_defaults(loss_type):
    # regression (a new user): wpo.yaml carried DPO's keys, so loss_type=ipo trained on summed log-probs (IPO's default
    # is per token) and loss_type=hinge was refused until each DPO key was removed by hand, one command per key
    from conftest import compose_config

    from runs import checks

    config = compose_config(["loss=wpo", f"loss.loss_type={loss_type}"])
    checks.validate_config(config)  # no key to remove
    base = losses.get_objective(loss_type)
    assert losses.get_objective("wpo").averages(config.loss) == base.averages({"name": loss_type})
    assert losses.get_objective("wpo").averages(config.loss) == (loss_type == "ipo")


def test_a_key_of_the_weighed_loss_is_added_with_plus_not_removed():
    # regression: "loss=wpo has no key 'f_divergence_type' ...; remove it." for a key loss_type=f_dpo reads
    from runs.overrides import override_error

    said = override_error(["loss=wpo", "loss.loss_type=f_dpo", "loss.f_divergence_type=js_divergence"])
    assert said.endswith("to add it, write +loss.f_divergence_type=js_divergence.")
    assert override_error(["loss=wpo", "loss.gamma=1"]).startswith("loss=wpo has no key 'gamma'")  # dpo reads no gamma
