"""KTO (Ethayarajh et al. 2024, Eq. 8): a prospect-theoretic loss on desirable and undesirable completions, paired or
unpaired, its reference point z0 from mismatched pairs (TRL's KTOTrainer)."""

from __future__ import annotations

import torch

from losses import BETA, IGNORE_INDEX, NLL_WEIGHT, Key, ObjectiveInputs, _positive, objective


def kto_inputs(trainer, batch: dict) -> ObjectiveInputs:
    """KTO's inputs: the pairs' (``trainer.pair_inputs``) or, for unpaired rows, each completion's log-probs with its
    label (:func:`unpaired_inputs`), and the mismatched pairs' (:func:`mismatched_kl_logps`), the reference point z0."""
    inputs = unpaired_inputs(trainer, batch) if "label" in batch else trainer.pair_inputs(batch)
    inputs.policy_kl_logps, inputs.reference_kl_logps = mismatched_kl_logps(trainer, batch)
    return inputs


def unpaired_inputs(trainer, batch: dict) -> ObjectiveInputs:
    """Unpaired rows' inputs (``chosen_*``: each row's completion; ``label`` (B,) bool: desirable): each completion's
    log-probs under the policy and the reference, (B,) each, its target tokens and the label."""
    chosen = {k: batch[f"chosen_{k}"] for k in ("input_ids", "attention_mask", "labels")}
    policy_chosen, n_tokens = trainer.one_side_logps(trainer.policy, chosen)
    uses_reference = trainer.uses_reference
    ref_chosen = trainer.reference_logps(as_pair_batch(chosen))[0] if uses_reference else torch.zeros_like(policy_chosen)
    return ObjectiveInputs(
        policy_chosen_logps=policy_chosen,
        reference_chosen_logps=ref_chosen,
        chosen_n_tokens=n_tokens,
        label=batch["label"].to(trainer.device),
    )


def mismatched_kl_logps(trainer, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(policy_kl_logps, reference_kl_logps)`` of the micro-batch's mismatched pairs
    (:func:`mismatched_pairs`), the policy's without gradient, gathered by :func:`gathered_kl`."""
    rows = mismatched_pairs(batch, trainer.config.max_length)
    with torch.no_grad():  # the KL term is detached (TRL computes it under no_grad too)
        policy_kl, _ = trainer.one_side_logps(trainer.policy, rows)
    uses_reference = trainer.uses_reference
    ref_kl = trainer.reference_logps(as_pair_batch(rows))[0] if uses_reference else torch.zeros_like(policy_kl)
    return gathered_kl(trainer.dist, policy_kl, ref_kl)


def gathered_kl(dist, policy_kl: torch.Tensor, reference_kl: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mismatched pairs' log-probs as the objective gets them: (B,) each on one process; with several
    data-parallel processes (``dist``: trainers.Dist), the mean over processes of the mean difference, shape (1,), and
    a zero reference (one all-reduce; every process calls this once per micro-batch)."""
    if dist.data_world_size == 1:
        return policy_kl, reference_kl
    mean = dist.global_sum(float((policy_kl - reference_kl).float().mean())) / dist.data_world_size
    return torch.tensor([mean], dtype=torch.float32, device=policy_kl.device), torch.zeros(1, device=policy_kl.device)


def kto_objective(
    policy_chosen_logps,
    reference_chosen_logps,
    policy_kl_logps,
    reference_kl_logps,
    beta,
    desirable_weight,
    undesirable_weight,
    policy_rejected_logps=None,
    reference_rejected_logps=None,
    label=None,
):
    """KTO (Ethayarajh et al. 2024, Eq. 8; TRL KTOTrainer's ``kto``), desirable lambda_D (1 - sigmoid(beta (r - z0))) and
    undesirable lambda_U (1 - sigmoid(beta (z0 - r))) with r = log pi(y|x) - log ref(y|x) and z0 = max(0, mean r over the
    (N,) mismatched pairs (x_i, y_{i+1})) detached: (B,) summed log-probs in, (B,) losses and metric ``kl`` (z0) out.

    Paired (rejected log-probs, ``label`` None): a pair's loss is the mean of its two, rewards beta * r. Unpaired ((B,) bool
    ``label``): row i is desirable where ``label[i]``, rewards None, metrics ``rewards_desirable`` / ``rewards_undesirable``
    (left out when empty). ValueError for both or neither form.
    """
    paired = policy_rejected_logps is not None and reference_rejected_logps is not None
    if paired == (label is not None):
        raise ValueError("kto takes either rejected log-probs (paired rows) or a label (unpaired rows), not both or neither.")
    z0 = (policy_kl_logps - reference_kl_logps).mean().detach().clamp(min=0)
    chosen_logratios = policy_chosen_logps - reference_chosen_logps
    desirable = desirable_weight * (1 - torch.sigmoid(beta * (chosen_logratios - z0)))
    kl = z0.expand_as(policy_chosen_logps)
    if paired:
        rejected_logratios = policy_rejected_logps - reference_rejected_logps
        undesirable = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - rejected_logratios)))
        losses = (desirable + undesirable) / 2
        return losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach(), {"kl": kl}
    label = label.to(device=policy_chosen_logps.device, dtype=torch.bool)
    undesirable = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - chosen_logratios)))
    losses = torch.where(label, desirable, undesirable)
    rewards = beta * chosen_logratios.detach()
    metrics = {"kl": kl}
    if label.any():
        metrics["rewards_desirable"] = rewards[label]
    if not label.all():
        metrics["rewards_undesirable"] = rewards[~label]
    return losses, None, None, metrics


@objective(
    "kto",
    keys={
        "beta": BETA,
        "desirable_weight": Key(1.0, _positive, "> 0", "lambda_D, weight of the desirable completions' losses"),
        "undesirable_weight": Key(1.0, _positive, "> 0", "lambda_U, weight of the undesirable completions' losses"),
        "nll_weight": NLL_WEIGHT,
    },
    source="Ethayarajh et al. 2024, Eq. 8",
    summary="KTO: prospect-theoretic loss on desirable / undesirable completions (paired or unpaired)",
    average_log_prob=False,
    unpaired=True,
    mismatched_kl=True,
    couples_micro_batch="takes its reference point z0 from each rank's micro-batch",
    needs=("policy_chosen_logps", "reference_chosen_logps", "policy_kl_logps", "reference_kl_logps"),
    inputs=kto_inputs,
    unit="value loss per completion, in [0, λ]",
)
def kto(inputs: ObjectiveInputs, loss):
    """loss=kto: :func:`kto_objective` of the (B,) log-probs (paired, or unpaired with their labels), the mismatched
    pairs' and the keys."""
    return kto_objective(
        inputs.policy_chosen_logps,
        inputs.reference_chosen_logps,
        inputs.policy_kl_logps,
        inputs.reference_kl_logps,
        loss.beta,
        loss.desirable_weight,
        loss.undesirable_weight,
        inputs.policy_rejected_logps,
        inputs.reference_rejected_logps,
        inputs.label,
    )


# KTO's reference point z0 (Ethayarajh et al. 2024, Sec. 4.1): within each micro-batch of B examples, prompt x_i
# with the chosen (or only) completion y_{(i+1) mod B} (TRL's KTOTrainer: y_{i-1}, the same estimator); B == 1
# gives (x_i, y_i); under FSDP / data parallelism z0 is the mean over processes of each micro-batch mean.


def mismatched_pairs(batch: dict, max_length: int) -> dict:
    """The mismatched (x_i, y_{(i+1) mod B}) of a micro-batch: ``input_ids``, ``attention_mask``, ``labels`` (B, T) long."""
    device = batch["chosen_input_ids"].device
    ids, mask, labels = (batch[f"chosen_{k}"].cpu() for k in ("input_ids", "attention_mask", "labels"))
    prompt_lengths = batch["prompt_attention_mask"].sum(1).tolist()
    lengths = mask.sum(1).tolist()
    n = ids.shape[0]
    seqs, targets = [], []
    for i in range(n):
        j = (i + 1) % n
        p_i, p_j = prompt_lengths[i], prompt_lengths[j]
        seq = torch.cat([ids[i, :p_i], ids[j, p_j : lengths[j]]])[:max_length]  # cut at the end as TRL cuts its KL sequences
        lab = torch.cat([torch.full((p_i,), IGNORE_INDEX, dtype=labels.dtype), labels[j, p_j : lengths[j]]])
        seqs.append(seq)
        targets.append(lab[:max_length])
    width = max(len(s) for s in seqs)
    out = {
        "input_ids": torch.zeros(n, width, dtype=ids.dtype),
        "attention_mask": torch.zeros(n, width, dtype=mask.dtype),
        "labels": torch.full((n, width), IGNORE_INDEX, dtype=labels.dtype),
    }
    for i, (seq, lab) in enumerate(zip(seqs, targets)):
        out["input_ids"][i, : len(seq)] = seq
        out["attention_mask"][i, : len(seq)] = 1
        out["labels"][i, : len(lab)] = lab
    return {k: v.to(device) for k, v in out.items()}


def as_pair_batch(rows: dict) -> dict:
    """A pair batch whose chosen and rejected sides are both ``rows``; use the chosen half of the result."""
    return {f"{side}_{k}": v for side in ("chosen", "rejected") for k, v in rows.items()}
