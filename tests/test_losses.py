"""Tests for losses.py (and the batch helpers of trainers.py that feed it).

Expected values are worked out by hand from the papers' formulas with plain
``math``, never by calling the code under test:

* DPO (Rafailov et al. 2023, Eq. 7): loss = -log sigmoid(beta * h),
  h = (pc - pr) - (rc - rr).
* Conservative DPO (Mitchell 2023):
  loss = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h).
* IPO (Azar et al. 2023, Eq. 17): loss = (h - 1 / (2 beta)) ** 2.
* reference_free: the reference log-probs are taken as 0.
"""

from __future__ import annotations

import math

import pytest
import torch

import losses
from losses import IGNORE_INDEX, dpo_loss, ipo_loss
from modeling.logprobs import get_batch_logps
from trainers import concatenated_inputs, split_batch

# ----------------------------------------------------------------------------- hand formulas


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def log_sigmoid(x: float) -> float:
    return -math.log(1.0 + math.exp(-x))


def margin(pc: float, pr: float, rc: float, rr: float) -> float:
    return (pc - pr) - (rc - rr)


def log_softmax_at(row: list[float], index: int) -> float:
    return row[index] - math.log(sum(math.exp(v) for v in row))


# Four preference pairs: (policy chosen, policy rejected, ref chosen, ref rejected).
PAIRS = [
    (-12.0, -15.0, -13.0, -14.0),  # h = 3 - 1 = 2
    (-20.5, -18.0, -19.0, -19.5),  # h = -2.5 - 0.5 = -3
    (-7.25, -7.25, -8.0, -8.0),  # h = 0
    (-3.0, -40.0, -5.0, -9.0),  # h = 37 - 4 = 33 (large, checks stability)
]


def as_tensors(pairs=PAIRS, requires_grad: bool = False):
    cols = list(zip(*pairs))
    out = [torch.tensor(c, dtype=torch.float64) for c in cols]
    if requires_grad:
        out[0].requires_grad_(True)
        out[1].requires_grad_(True)
    return out


def assert_close_list(actual: torch.Tensor, expected: list[float], tol: float = 1e-9):
    assert actual.shape == (len(expected),)
    for a, e in zip(actual.tolist(), expected):
        assert a == pytest.approx(e, rel=tol, abs=tol)


# ----------------------------------------------------------------------------- DPO


@pytest.mark.parametrize("beta", [0.1, 0.5, 1.0])
def test_dpo_loss_matches_eq7(beta):
    pc, pr, rc, rr = as_tensors()
    loss, _, _ = dpo_loss(pc, pr, rc, rr, beta=beta)
    expected = [-log_sigmoid(beta * margin(*p)) for p in PAIRS]
    assert_close_list(loss, expected)


def test_dpo_loss_concrete_number():
    # beta = 0.5, h = 2: loss = -log sigmoid(1) = log(1 + e^-1).
    loss, _, _ = dpo_loss(*[torch.tensor([v], dtype=torch.float64) for v in PAIRS[0]], beta=0.5)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-1.0)), rel=1e-12)
    assert loss.item() == pytest.approx(0.31326168751822286, rel=1e-12)


@pytest.mark.parametrize("beta", [0.1, 0.7])
def test_dpo_loss_is_ln2_at_zero_margin(beta):
    z = torch.tensor([-5.0, 0.0, -100.0], dtype=torch.float64)
    loss, _, _ = dpo_loss(z, z, z - 1.0, z - 1.0, beta=beta)
    assert_close_list(loss, [math.log(2.0)] * 3)


def test_dpo_rewards_are_implicit_rewards_and_detached():
    beta = 0.25
    pc, pr, rc, rr = as_tensors(requires_grad=True)
    _, chosen, rejected = dpo_loss(pc, pr, rc, rr, beta=beta)
    assert_close_list(chosen, [beta * (p[0] - p[2]) for p in PAIRS])
    assert_close_list(rejected, [beta * (p[1] - p[3]) for p in PAIRS])
    assert not chosen.requires_grad and not rejected.requires_grad


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_gradients_match_hand_derivation(beta):
    pc, pr, rc, rr = as_tensors(requires_grad=True)
    loss, _, _ = dpo_loss(pc, pr, rc, rr, beta=beta)
    loss.sum().backward()
    # d/dpc [-log sigmoid(beta h)] = -beta * sigmoid(-beta h); d/dpr = +beta * sigmoid(-beta h).
    g = [beta * sigmoid(-beta * margin(*p)) for p in PAIRS]
    assert_close_list(pc.grad, [-v for v in g])
    assert_close_list(pr.grad, g)


def test_dpo_gradient_at_zero_margin_is_half_beta():
    beta = 0.3
    pc = torch.tensor([-4.0], dtype=torch.float64, requires_grad=True)
    pr = torch.tensor([-4.0], dtype=torch.float64, requires_grad=True)
    loss, _, _ = dpo_loss(pc, pr, torch.tensor([-4.0]).double(), torch.tensor([-4.0]).double(), beta=beta)
    loss.backward()
    assert pc.grad.item() == pytest.approx(-beta / 2)
    assert pr.grad.item() == pytest.approx(beta / 2)


def test_dpo_large_margins_are_finite():
    pc = torch.tensor([0.0, -1e4], dtype=torch.float32, requires_grad=True)
    pr = torch.tensor([-1e4, 0.0], dtype=torch.float32, requires_grad=True)
    z = torch.zeros(2)
    loss, _, _ = dpo_loss(pc, pr, z, z, beta=1.0)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(pc.grad).all()
    assert loss[0].item() == pytest.approx(0.0, abs=1e-6)
    assert loss[1].item() == pytest.approx(1e4, rel=1e-6)  # -log sigmoid(-1e4) ~ 1e4


# ----------------------------------------------------------------------------- conservative DPO


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3, 0.49])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_cdpo_loss_matches_mitchell(beta, eps):
    pc, pr, rc, rr = as_tensors()
    loss, _, _ = dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=eps)
    expected = []
    for p in PAIRS:
        x = beta * margin(*p)
        expected.append(-(1 - eps) * log_sigmoid(x) - eps * log_sigmoid(-x))
    assert_close_list(loss, expected)


def test_cdpo_concrete_number():
    # beta = 0.5, h = 2, eps = 0.2: 0.8 * log(1 + e^-1) + 0.2 * log(1 + e).
    loss, _, _ = dpo_loss(*[torch.tensor([v], dtype=torch.float64) for v in PAIRS[0]], beta=0.5, label_smoothing=0.2)
    expected = 0.8 * math.log(1 + math.exp(-1.0)) + 0.2 * math.log(1 + math.exp(1.0))
    assert loss.item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("eps", [0.1, 0.25])
def test_cdpo_gradients_match_hand_derivation(eps):
    beta = 0.5
    pc, pr, rc, rr = as_tensors(requires_grad=True)
    loss, _, _ = dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=eps)
    loss.sum().backward()
    # d/dpc = -beta [(1 - eps) sigmoid(-beta h) - eps sigmoid(beta h)], d/dpr is its negative.
    g = []
    for p in PAIRS:
        x = beta * margin(*p)
        g.append(-beta * ((1 - eps) * sigmoid(-x) - eps * sigmoid(x)))
    assert_close_list(pc.grad, g)
    assert_close_list(pr.grad, [-v for v in g])


def test_cdpo_gradient_vanishes_at_its_finite_optimum():
    # (1 - eps) sigmoid(-x) = eps sigmoid(x)  <=>  x = log((1 - eps) / eps).
    beta, eps = 0.2, 0.1
    h = math.log((1 - eps) / eps) / beta
    pc = torch.tensor([h], dtype=torch.float64, requires_grad=True)
    z = torch.zeros(1, dtype=torch.float64)
    loss, _, _ = dpo_loss(pc, z, z, z, beta=beta, label_smoothing=eps)
    loss.backward()
    assert pc.grad.item() == pytest.approx(0.0, abs=1e-12)


# ----------------------------------------------------------------------------- reference-free DPO


@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_reference_free_ignores_reference(eps):
    beta = 0.5
    pc, pr, rc, rr = as_tensors()
    loss, chosen, rejected = dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=eps, reference_free=True)
    expected = []
    for p in PAIRS:
        x = beta * (p[0] - p[1])  # reference terms are 0
        expected.append(-(1 - eps) * log_sigmoid(x) - eps * log_sigmoid(-x))
    assert_close_list(loss, expected)
    assert_close_list(chosen, [beta * p[0] for p in PAIRS])
    assert_close_list(rejected, [beta * p[1] for p in PAIRS])
    # Any reference values give the same result.
    loss2, _, _ = dpo_loss(pc, pr, rc * 3 + 7, rr - 11, beta=beta, label_smoothing=eps, reference_free=True)
    assert torch.equal(loss, loss2)


def test_reference_free_gradient():
    beta = 0.1
    pc, pr, rc, rr = as_tensors(requires_grad=True)
    loss, _, _ = dpo_loss(pc, pr, rc, rr, beta=beta, reference_free=True)
    loss.sum().backward()
    g = [beta * sigmoid(-beta * (p[0] - p[1])) for p in PAIRS]
    assert_close_list(pc.grad, [-v for v in g])
    assert_close_list(pr.grad, g)


# ----------------------------------------------------------------------------- IPO


@pytest.mark.parametrize("beta", [0.05, 0.1, 0.5, 2.0])
def test_ipo_loss_matches_eq17(beta):
    pc, pr, rc, rr = as_tensors()
    loss, chosen, rejected = ipo_loss(pc, pr, rc, rr, beta=beta)
    assert_close_list(loss, [(margin(*p) - 1 / (2 * beta)) ** 2 for p in PAIRS])
    assert_close_list(chosen, [beta * (p[0] - p[2]) for p in PAIRS])
    assert_close_list(rejected, [beta * (p[1] - p[3]) for p in PAIRS])
    assert not chosen.requires_grad and not rejected.requires_grad


def test_ipo_concrete_number():
    # beta = 0.1 -> target 1 / (2 * 0.1) = 5; h = 2 -> (2 - 5)^2 = 9.
    loss, _, _ = ipo_loss(*[torch.tensor([v], dtype=torch.float64) for v in PAIRS[0]], beta=0.1)
    assert loss.item() == pytest.approx(9.0, rel=1e-12)


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_ipo_gradients_match_hand_derivation(beta):
    pc, pr, rc, rr = as_tensors(requires_grad=True)
    loss, _, _ = ipo_loss(pc, pr, rc, rr, beta=beta)
    loss.sum().backward()
    g = [2 * (margin(*p) - 1 / (2 * beta)) for p in PAIRS]
    assert_close_list(pc.grad, g)
    assert_close_list(pr.grad, [-v for v in g])


def test_ipo_minimum_at_target_margin():
    beta = 0.25
    pc = torch.tensor([1 / (2 * beta)], dtype=torch.float64, requires_grad=True)
    z = torch.zeros(1, dtype=torch.float64)
    loss, _, _ = ipo_loss(pc, z, z, z, beta=beta)
    loss.backward()
    assert loss.item() == pytest.approx(0.0, abs=1e-15)
    assert pc.grad.item() == pytest.approx(0.0, abs=1e-15)


# ----------------------------------------------------------------------------- implicit rewards


def test_implicit_rewards_by_hand():
    beta = 0.2
    pc, pr, rc, rr = as_tensors(requires_grad=True)
    for loss in (dpo_loss, ipo_loss):  # IPO reports DPO's implicit rewards
        _, chosen, rejected = loss(pc, pr, rc, rr, beta)
        assert_close_list(chosen, [0.2 * 1.0, 0.2 * -1.5, 0.2 * 0.75, 0.2 * 2.0])
        assert_close_list(rejected, [0.2 * -1.0, 0.2 * 1.5, 0.2 * 0.75, 0.2 * -31.0])
        assert not chosen.requires_grad and not rejected.requires_grad
    _, chosen, rejected = dpo_loss(pc, pr, rc, rr, beta, reference_free=True)
    assert_close_list(chosen, [0.2 * p[0] for p in PAIRS])
    assert_close_list(rejected, [0.2 * p[1] for p in PAIRS])


# ----------------------------------------------------------------------------- get_batch_logps

# B = 2, T = 4, V = 3. Position t's logits predict label t + 1.
LOGITS = [
    [[1.0, 2.0, 0.5], [0.0, -1.0, 3.0], [2.0, 2.0, 2.0], [9.0, -9.0, 0.0]],
    [[-0.5, 0.25, 1.5], [4.0, 0.0, -2.0], [0.3, 0.2, 0.1], [1.0, 1.0, 1.0]],
]
LABELS = [
    [IGNORE_INDEX, 2, 0, 1],  # all three predicted tokens labelled
    [IGNORE_INDEX, IGNORE_INDEX, 1, IGNORE_INDEX],  # one labelled token (predicted from position 1)
]


def hand_logps(average: bool) -> tuple[list[float], list[float]]:
    out, counts = [], []
    for row_logits, row_labels in zip(LOGITS, LABELS):
        total, n = 0.0, 0
        for t in range(1, len(row_labels)):
            if row_labels[t] != IGNORE_INDEX:
                total += log_softmax_at(row_logits[t - 1], row_labels[t])
                n += 1
        out.append(total / max(n, 1) if average else total)
        counts.append(float(n))
    return out, counts


def test_get_batch_logps_by_hand_sum():
    logps, n = get_batch_logps(torch.tensor(LOGITS), torch.tensor(LABELS), average_log_prob=False)
    expected, counts = hand_logps(average=False)
    # Spelled out for row 0: log softmax([1, 2, .5])[2] + log softmax([0, -1, 3])[0] + log softmax([2, 2, 2])[1].
    row0 = (
        0.5
        - math.log(math.exp(1) + math.exp(2) + math.exp(0.5))
        + 0.0
        - math.log(1 + math.exp(-1) + math.exp(3))
        + math.log(1 / 3)
    )
    assert expected[0] == pytest.approx(row0, rel=1e-12)
    assert_close_list(logps, expected, tol=1e-6)
    assert n.tolist() == counts == [3.0, 1.0]
    assert logps.dtype == torch.float32 and n.dtype == torch.float32


def test_get_batch_logps_by_hand_average():
    logps, n = get_batch_logps(torch.tensor(LOGITS), torch.tensor(LABELS), average_log_prob=True)
    expected, _ = hand_logps(average=True)
    assert_close_list(logps, expected, tol=1e-6)
    s, _ = get_batch_logps(torch.tensor(LOGITS), torch.tensor(LABELS), average_log_prob=False)
    assert torch.allclose(logps * n, s)


def test_get_batch_logps_ignores_logits_at_ignored_positions():
    labels = torch.tensor(LABELS)
    base, _ = get_batch_logps(torch.tensor(LOGITS), labels)
    noisy = torch.tensor(LOGITS).clone()
    # Row 1 only uses position 1; the last position never predicts anything.
    noisy[1, 0] += torch.tensor([5.0, -3.0, 1.0])
    noisy[1, 2:] = 100.0
    noisy[0, 3] = -50.0
    out, _ = get_batch_logps(noisy, labels)
    assert torch.equal(out, base)


def test_get_batch_logps_excludes_label_at_position_zero():
    # labels[:, 0] is never predicted (no position before it), even when it is not -100.
    labels = torch.tensor([[1, IGNORE_INDEX, 2, IGNORE_INDEX]])
    logps, n = get_batch_logps(torch.tensor(LOGITS[:1]), labels)
    assert n.tolist() == [1.0]
    assert logps.item() == pytest.approx(log_softmax_at(LOGITS[0][1], 2), rel=1e-6)


def test_get_batch_logps_no_labelled_token_gives_zero_not_nan():
    logits = torch.tensor(LOGITS, requires_grad=True)
    labels = torch.full((2, 4), IGNORE_INDEX)
    labels[0, 2] = 1
    avg, n = get_batch_logps(logits, labels, average_log_prob=True)
    assert n.tolist() == [1.0, 0.0]
    assert avg[1].item() == 0.0
    assert avg[0].item() == pytest.approx(log_softmax_at(LOGITS[0][1], 1), rel=1e-6)
    avg.sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert torch.all(logits.grad[1] == 0)
    s, _ = get_batch_logps(logits, labels, average_log_prob=False)
    assert s[1].item() == 0.0


def test_get_batch_logps_bf16_logits_give_float32():
    logits = torch.tensor(LOGITS).to(torch.bfloat16)
    labels = torch.tensor(LABELS)
    for average in (False, True):
        logps, n = get_batch_logps(logits, labels, average_log_prob=average)
        assert logps.dtype == torch.float32 and n.dtype == torch.float32
        # Computed in float32 from the bf16-rounded logits.
        ref, _ = get_batch_logps(logits.float(), labels, average_log_prob=average)
        assert torch.allclose(logps, ref, atol=1e-6)
        # And close to the exact values (bf16 rounds the logits only).
        assert_close_list(logps, hand_logps(average)[0], tol=3e-2)


def test_get_batch_logps_shape_mismatch_raises():
    with pytest.raises(ValueError):
        get_batch_logps(torch.zeros(2, 4, 3), torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError):
        get_batch_logps(torch.zeros(2, 4, 3), torch.zeros(1, 4, dtype=torch.long))


def test_get_batch_logps_gradient_by_hand():
    # d/dlogits[t] of log softmax(logits[t])[y] = onehot(y) - softmax(logits[t]).
    # (get_batch_logps computes in float32 whatever the input dtype, hence the tolerance.)
    logits = torch.tensor(LOGITS[:1], dtype=torch.float64, requires_grad=True)
    labels = torch.tensor(LABELS[:1])
    logps, _ = get_batch_logps(logits, labels)
    logps.sum().backward()
    for t in range(3):
        row = LOGITS[0][t]
        z = sum(math.exp(v) for v in row)
        y = LABELS[0][t + 1]
        expected = [(1.0 if k == y else 0.0) - math.exp(row[k]) / z for k in range(3)]
        assert logits.grad[0, t].tolist() == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert logits.grad[0, 3].tolist() == [0.0, 0.0, 0.0]


# ----------------------------------------------------------------------------- padding invariance with a real causal LM


@pytest.fixture(scope="module")
def tiny_lm():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    model = transformers.LlamaForCausalLM(config).eval()
    return model


SEQ = [3, 5, 7, 11, 13, 17, 19]
PROMPT_LEN = 3
PAD_ID = 0


def lm_logps(model, ids, mask, labels, position_ids=None, average=False):
    with torch.no_grad():
        logits = model(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            position_ids=None if position_ids is None else torch.tensor(position_ids),
        ).logits
    return get_batch_logps(logits, torch.tensor(labels), average_log_prob=average)


def padded(seq, prompt_len, n_pad, side):
    labels = [IGNORE_INDEX] * prompt_len + seq[prompt_len:]
    if side == "right":
        return (
            seq + [PAD_ID] * n_pad,
            [1] * len(seq) + [0] * n_pad,
            labels + [IGNORE_INDEX] * n_pad,
            list(range(len(seq) + n_pad)),
        )
    return (
        [PAD_ID] * n_pad + seq,
        [0] * n_pad + [1] * len(seq),
        [IGNORE_INDEX] * n_pad + labels,
        [0] * n_pad + list(range(len(seq))),
    )


@pytest.mark.parametrize("average", [False, True])
def test_logps_independent_of_padding_amount_and_side(tiny_lm, average):
    ids, mask, labels, _ = padded(SEQ, PROMPT_LEN, 0, "right")
    base, n_base = lm_logps(tiny_lm, [ids], [mask], [labels], average=average)
    assert n_base.item() == len(SEQ) - PROMPT_LEN
    for side in ("right", "left"):
        for n_pad in (1, 4):
            ids, mask, labels, pos = padded(SEQ, PROMPT_LEN, n_pad, side)
            out, n = lm_logps(tiny_lm, [ids], [mask], [labels], position_ids=[pos], average=average)
            assert n.item() == n_base.item()
            assert out.item() == pytest.approx(base.item(), abs=1e-5), (side, n_pad)


def test_logps_in_mixed_padding_batch(tiny_lm):
    # Two sequences of different lengths in one batch: each row equals its unpadded value.
    short = [4, 6, 8, 10]
    singles = [
        lm_logps(tiny_lm, [padded(s, 2, 0, "right")[0]], [[1] * len(s)], [padded(s, 2, 0, "right")[2]])[0] for s in (SEQ, short)
    ]
    for side in ("right", "left"):
        width = len(SEQ) + 2
        rows = [padded(s, 2, width - len(s), side) for s in (SEQ, short)]
        ids, mask, labels, pos = (list(col) for col in zip(*rows))
        out, n = lm_logps(tiny_lm, ids, mask, labels, position_ids=pos)
        assert n.tolist() == [len(SEQ) - 2, len(short) - 2]
        assert out[0].item() == pytest.approx(singles[0].item(), abs=1e-5)
        assert out[1].item() == pytest.approx(singles[1].item(), abs=1e-5)


def test_concatenated_forward_path_matches_unpadded(tiny_lm):
    # concatenated_inputs right-pads chosen and rejected to a common width; the model is then
    # called without position_ids, as BasicTrainer.concatenated_forward does.
    chosen = [2, 9, 4, 4, 5, 6, 7, 8]
    rejected = [2, 9, 4, 30]
    batch = {
        "chosen_input_ids": torch.tensor([chosen]),
        "chosen_attention_mask": torch.ones(1, len(chosen), dtype=torch.long),
        "chosen_labels": torch.tensor([[IGNORE_INDEX] * 3 + chosen[3:]]),
        "rejected_input_ids": torch.tensor([rejected]),
        "rejected_attention_mask": torch.ones(1, len(rejected), dtype=torch.long),
        "rejected_labels": torch.tensor([[IGNORE_INDEX] * 3 + rejected[3:]]),
    }
    inputs = concatenated_inputs(batch)
    with torch.no_grad():
        logits = tiny_lm(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    logps, n = get_batch_logps(logits, inputs["labels"])
    for row, side in enumerate(("chosen", "rejected")):
        single, n_single = lm_logps(
            tiny_lm,
            batch[f"{side}_input_ids"].tolist(),
            batch[f"{side}_attention_mask"].tolist(),
            batch[f"{side}_labels"].tolist(),
        )
        assert logps[row].item() == pytest.approx(single.item(), abs=1e-5)
        assert n[row].item() == n_single.item()


def test_micro_batch_scaling_of_preference_losses():
    # The trainer scales each micro-batch's summed loss by 1 / n_batch_examples;
    # summing over chunks must give the full-batch mean.
    pc, pr, rc, rr = as_tensors()
    full, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.1)
    expected = sum(-log_sigmoid(0.1 * margin(*p)) for p in PAIRS) / len(PAIRS)
    assert full.mean().item() == pytest.approx(expected)
    batch = {"prompt": ["a", "b", "c", "d"], "pc": pc, "pr": pr, "rc": rc, "rr": rr}
    total = 0.0
    for chunk in split_batch(batch, 3):
        per_example, _, _ = dpo_loss(chunk["pc"], chunk["pr"], chunk["rc"], chunk["rr"], beta=0.1)
        total += per_example.sum().item() / len(PAIRS)
    assert total == pytest.approx(expected, rel=1e-12)


# ----------------------------------------------------------------------------- trainers.concatenated_inputs


def make_pair_batch(b, t_c, t_r):
    g = torch.Generator().manual_seed(t_c * 10 + t_r)
    batch = {}
    for side, t in (("chosen", t_c), ("rejected", t_r)):
        batch[f"{side}_input_ids"] = torch.randint(1, 50, (b, t), generator=g)
        batch[f"{side}_attention_mask"] = torch.ones(b, t, dtype=torch.long)
        labels = batch[f"{side}_input_ids"].clone()
        labels[:, :2] = IGNORE_INDEX
        batch[f"{side}_labels"] = labels
    return batch


@pytest.mark.parametrize(("t_c", "t_r"), [(6, 4), (3, 7), (5, 5)])
def test_concatenated_inputs_shapes_and_padding(t_c, t_r):
    b = 3
    batch = make_pair_batch(b, t_c, t_r)
    out = concatenated_inputs(batch)
    width = max(t_c, t_r)
    assert set(out) == {"input_ids", "attention_mask", "labels"}
    for key in out:
        assert out[key].shape == (2 * b, width)
        assert out[key].dtype == torch.long
    for rows, side, t in ((slice(0, b), "chosen", t_c), (slice(b, 2 * b), "rejected", t_r)):
        for key in ("input_ids", "attention_mask", "labels"):
            assert torch.equal(out[key][rows, :t], batch[f"{side}_{key}"])
        assert torch.all(out["input_ids"][rows, t:] == 0)
        assert torch.all(out["attention_mask"][rows, t:] == 0)
        assert torch.all(out["labels"][rows, t:] == IGNORE_INDEX)
    assert losses.IGNORE_INDEX == -100


def test_concatenated_inputs_keeps_logps():
    # Padding added by concatenated_inputs never changes a row's log-prob.
    batch = make_pair_batch(2, 6, 3)
    out = concatenated_inputs(batch)
    torch.manual_seed(1)
    logits = torch.randn(4, 6, 50)
    logps, n = get_batch_logps(logits, out["labels"])
    chosen, n_c = get_batch_logps(logits[:2, :6], batch["chosen_labels"])
    rejected, n_r = get_batch_logps(logits[2:, :3], batch["rejected_labels"])
    assert torch.allclose(logps, torch.cat([chosen, rejected]))
    assert n.tolist() == [4.0, 4.0, 1.0, 1.0] == torch.cat([n_c, n_r]).tolist()


# ----------------------------------------------------------------------------- trainers.split_batch


def make_split_batch(size):
    return {
        "prompt": [f"p{i}" for i in range(size)],
        "chosen_input_ids": torch.arange(size * 3).reshape(size, 3),
        "chosen_labels": torch.arange(size) * 10,
    }


def test_split_batch_five_into_two():
    chunks = split_batch(make_split_batch(5), 2)
    sizes = [len(c["prompt"]) for c in chunks]
    assert len(chunks) == 2
    assert sorted(sizes) == [2, 3]  # nothing dropped (np.round gives 2 + 3)
    assert sum(sizes) == 5
    assert [p for c in chunks for p in c["prompt"]] == [f"p{i}" for i in range(5)]


@pytest.mark.parametrize("size", range(1, 13))
@pytest.mark.parametrize("n_chunks", [1, 2, 3, 4, 5, 8])
def test_split_batch_never_drops_and_is_balanced(size, n_chunks):
    batch = make_split_batch(size)
    chunks = split_batch(batch, n_chunks)
    sizes = [len(c["prompt"]) for c in chunks]
    assert len(chunks) == min(size, n_chunks)
    assert all(s > 0 for s in sizes)
    assert sum(sizes) == size
    assert max(sizes) - min(sizes) <= 1
    # Order kept, lists and tensors split identically.
    assert [p for c in chunks for p in c["prompt"]] == batch["prompt"]
    assert torch.equal(torch.cat([c["chosen_input_ids"] for c in chunks]), batch["chosen_input_ids"])
    assert torch.equal(torch.cat([c["chosen_labels"] for c in chunks]), batch["chosen_labels"])
    for c in chunks:
        idx = [int(p[1:]) for p in c["prompt"]]
        assert c["chosen_labels"].tolist() == [10 * i for i in idx]
        assert set(c) == set(batch)


def test_nan_logits_at_unlabelled_positions_do_not_leak():
    logits = torch.zeros(1, 4, 3)
    logits[0, 0] = float("nan")  # predicts token 1, which is a prompt token (label -100)
    labels = torch.tensor([[0, -100, 2, 1]])
    logps, _ = get_batch_logps(logits, labels)
    assert torch.isfinite(logps).all()
    assert logps.item() == pytest.approx(2 * -math.log(3))


def test_response_logits_give_the_same_logps_as_full_logits():
    from transformers import LlamaConfig, LlamaForCausalLM

    from modeling.forward import response_logits

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    ).eval()
    ids = torch.randint(1, 32, (3, 10))
    mask = torch.ones_like(ids)
    mask[2, 8:] = 0
    labels = ids.clone()
    labels[0, :4] = IGNORE_INDEX  # prompts of 4, 6 and 5 tokens
    labels[1, :6] = IGNORE_INDEX
    labels[2, :5] = IGNORE_INDEX
    labels[2, 8:] = IGNORE_INDEX  # padding
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    with torch.no_grad():
        logits, kept = response_logits(model, inputs)
        full = model(input_ids=ids, attention_mask=mask).logits
    assert logits.shape[1] == 7  # from the position before the first response token (index 4)
    torch.testing.assert_close(get_batch_logps(logits, kept)[0], get_batch_logps(full, labels)[0], rtol=1e-5, atol=1e-5)
