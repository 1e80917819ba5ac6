"""loss=ld_dpo (objectives/ld_dpo.py): LD-DPO (Liu et al. 2024) equal to TRL 1.16's DPOTrainer with ``ld_alpha`` to 1e-6
in the loss and every gradient, its token weights by hand, and the same numbers on every forward path (packed, padded,
chunked output layer) as each sequence forwarded alone and weighed by hand."""

from __future__ import annotations

import types

import pytest
import torch
from test_objectives_trl import BETA, TRL_PAIRS, trl_dpo_loss
from test_packed import make_model, random_pairs

import losses
import trainers
from modeling import logprobs
from preference_datasets import collate


def test_the_weights_are_one_for_the_shorter_responses_length_and_alpha_after_by_hand():
    weight = losses.get_objective("ld_dpo").token_weights({"name": "ld_dpo", "ld_alpha": 0.3})
    # two pairs: chosen lengths 3 and 5, rejected 4 and 2 -> the public lengths are 3 and 2
    n_tokens = torch.tensor([3.0, 5.0, 4.0, 2.0])
    sequence = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3])
    got = weight(logprobs.token_ranks(sequence, 4), sequence, n_tokens)
    assert got.tolist() == pytest.approx([1, 1, 1] + [1, 1, 0.3, 0.3, 0.3] + [1, 1, 1, 0.3] + [1, 1])
    shuffled = torch.tensor([2, 0, 2, 0, 2, 0, 2])  # ranks count each sequence's tokens in the order they come
    assert logprobs.token_ranks(shuffled, 3).tolist() == [0, 0, 1, 1, 2, 2, 3]


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.7, 1.0])
def test_equals_trl_dpo_trainer_ld_alpha(alpha):
    pytest.importorskip("trl.trainer.dpo_trainer")
    dtype = torch.float64
    b = len(TRL_PAIRS)
    lengths = [p[4] for p in TRL_PAIRS] + [p[5] for p in TRL_PAIRS]  # rows: chosen..., rejected...
    t = max(lengths)
    mask = torch.zeros(2 * b, t + 1, dtype=torch.long)  # TRL's completion_mask; position 0 is the prompt
    values = torch.zeros(2 * b, t, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    for row, n in enumerate(lengths):
        mask[row, 1 : n + 1] = 1
        values[row, :n] = -torch.rand(n, generator=g, dtype=dtype) * 3  # per-token log-probs
    ref_chosen = torch.tensor([p[2] for p in TRL_PAIRS], dtype=dtype)
    ref_rejected = torch.tensor([p[3] for p in TRL_PAIRS], dtype=dtype)

    leaf = values.clone().requires_grad_(True)
    trl_loss = trl_dpo_loss(leaf, mask, ref_chosen, ref_rejected, ["sigmoid"], [1.0], ld_alpha=alpha)
    trl_loss.backward()

    cfg = {"name": "ld_dpo", "beta": BETA, "ld_alpha": alpha}
    decl = losses.validate_loss_config(cfg)
    ours_leaf = values.clone().requires_grad_(True)
    response = mask[:, 1:].bool()
    sequence = torch.arange(2 * b)[:, None].expand(2 * b, t)[response]
    logps, n_tokens = logprobs.sum_by_sequence(ours_leaf[response], sequence, 2 * b, False, decl.token_weights(cfg))
    ours_inputs = losses.ObjectiveInputs(
        policy_chosen_logps=logps[:b],
        policy_rejected_logps=logps[b:],
        reference_chosen_logps=ref_chosen,
        reference_rejected_logps=ref_rejected,
        chosen_n_tokens=n_tokens[:b],
        rejected_n_tokens=n_tokens[b:],
    )
    ours = decl.compute(ours_inputs, cfg).losses.mean()
    ours.backward()
    assert ours.item() == pytest.approx(trl_loss.item(), rel=1e-6, abs=1e-6)
    torch.testing.assert_close(ours_leaf.grad * response, leaf.grad * response, rtol=1e-6, atol=1e-7)


def by_hand(model, elements, alpha):
    """Each sequence forwarded alone, its per-token log-probs weighed by hand: 1 up to the pair's shorter response."""
    out = {"chosen": [], "rejected": []}
    for el in elements:
        public = min(sum(x != losses.IGNORE_INDEX for x in el[f"{s}_labels"]) for s in out)
        for side in out:
            ids, labels = torch.tensor([el[f"{side}_input_ids"]]), torch.tensor(el[f"{side}_labels"])
            per_token = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            picked = [per_token[i, labels[i + 1]] for i in range(len(labels) - 1) if labels[i + 1] != losses.IGNORE_INDEX]
            out[side].append(sum(lp * (1.0 if k < public else alpha) for k, lp in enumerate(picked)))
    return torch.stack(out["chosen"]), torch.stack(out["rejected"])


@pytest.mark.parametrize("packed, chunk", [(True, None), (True, 3), (False, None), (False, 3)])
def test_every_forward_path_weighs_as_each_sequence_alone_by_hand(packed, chunk):
    alpha = 0.25
    model = make_model()
    elements = random_pairs([(5, 7, 3), (12, 2, 9), (3, 6, 6), (4, 1, 8)], seed=3)
    batch = collate(elements, pad_token_id=0)
    weight = losses.get_objective("ld_dpo").token_weights({"ld_alpha": alpha})
    stub = types.SimpleNamespace(
        average_log_prob=False,
        device=torch.device("cpu"),
        max_forward_chunks=None,
        output_layer_chunk=chunk,
        packed=packed,
        token_weight=weight,
    )
    with torch.no_grad():
        chosen, rejected, _ = trainers.BasicTrainer.concatenated_forward(stub, model, batch)
        expected_chosen, expected_rejected = by_hand(model, elements, alpha)
        unweighed = types.SimpleNamespace(**(vars(stub) | {"token_weight": None}))
        plain_chosen, _, _ = trainers.BasicTrainer.concatenated_forward(unweighed, model, batch)
    torch.testing.assert_close(chosen, expected_chosen, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(rejected, expected_rejected, rtol=2e-5, atol=2e-5)
    assert not torch.allclose(chosen, plain_chosen)  # the weights acted (a pair's chosen is the longer one)


def test_the_trainer_weighs_the_reference_too_as_trl_does(tmp_path):
    # TRL's ld_alpha weighs the reference's log-probs as the policy's; so does the trainer's one seam to the reference
    from test_train import build_trainer

    trainer = build_trainer(["loss=ld_dpo", "loss.ld_alpha=0.2"], tmp_path)
    batch = next(iter(trainers.get_batch_iterator(trainer.train_examples, trainer.tokenizer, 8, 64, 32, seed=0, n_examples=8)))
    elements = []
    for i in range(len(batch["prompt"])):
        element = {}
        for side in ("chosen", "rejected"):
            kept = batch[f"{side}_attention_mask"][i].bool()
            element[f"{side}_input_ids"] = batch[f"{side}_input_ids"][i][kept].tolist()
            element[f"{side}_labels"] = batch[f"{side}_labels"][i][kept].tolist()
        elements.append(element)
    lengths = [[sum(x != losses.IGNORE_INDEX for x in e[f"{s}_labels"]) for s in ("chosen", "rejected")] for e in elements]
    assert any(c != r for c, r in lengths)  # some pairs weigh a tail
    with torch.no_grad():
        chosen, rejected = trainer.reference_logps(batch)
        expected = by_hand(trainer.reference_model, elements, 0.2)
    torch.testing.assert_close(chosen, expected[0], rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(rejected, expected[1], rtol=2e-5, atol=2e-5)


def test_a_mix_refuses_it_in_one_sentence():
    # the mix's components share one unweighted forward: ld_dpo in it would silently be DPO
    with pytest.raises(losses.ObjectiveConfigError, match=r"^loss.losses of loss=mix names 'ld_dpo', which weighs response"):
        losses.validate_loss_config({"name": "mix", "losses": ["dpo", "ld_dpo"], "weights": [1.0, 1.0]})
