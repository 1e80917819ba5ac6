"""Preference-learning losses and batch log-probabilities.

Every function here is pure: tensors in, tensors out, no model and no config.
The trainers call them; a new loss never touches a trainer's sharding code.

Notation (shared by all functions):
    B  number of preference pairs (or SFT sequences) in the batch
    T  sequence length (tokens), V vocabulary size
    logps  log-probability of a whole response, log pi(y | x), in nats
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""Label value marking a position that carries no loss (prompt or padding)."""


def get_batch_logps(
    logits: torch.Tensor, labels: torch.Tensor, average_log_prob: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each sequence's labelled tokens under the given logits.

    Position t of ``logits`` predicts token t + 1 of ``labels``; positions whose
    label is ``IGNORE_INDEX`` (-100: the prompt and the padding) are excluded, so
    the result does not depend on how much padding there is or on which side.
    Computed in float32 whatever the logits' dtype, as ``logit[label] -
    logsumexp(logits)``, so no full-vocabulary log-softmax copy is made.

    Args:
        logits: (B, T, V) unnormalised scores from a causal LM.
        labels: (B, T) token ids, ``IGNORE_INDEX`` where no loss is wanted.
        average_log_prob: if True return the mean log-prob per labelled token
            (length-normalised, as IPO's authors use), else the sum.

    Returns:
        (logps, n_tokens): logps of shape (B,) in nats (sum, or mean per token),
        and n_tokens of shape (B,), the number of labelled tokens (float32).

    Raises:
        ValueError: if logits and labels disagree in batch size or length.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} must share (B, T).")
    labels = labels[:, 1:]
    logits = logits[:, :-1, :]
    mask = labels != IGNORE_INDEX
    safe_labels = torch.where(mask, labels, 0)
    picked = torch.gather(logits, 2, safe_labels.unsqueeze(2)).squeeze(2).float()
    per_token = picked - torch.logsumexp(logits.float(), dim=-1)
    per_token = torch.where(mask, per_token, 0.0)  # not * mask: a NaN at a pad position must not leak
    n_tokens = mask.sum(-1).float()
    total = per_token.sum(-1)
    if average_log_prob:
        # A sequence with no labelled token gets 0, never NaN (0 / 0).
        return total / n_tokens.clamp(min=1.0), n_tokens
    return total, n_tokens


def gathered_token_logps(logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits[rows[k]])[targets[k]] for every k, in float32, as in :func:`get_batch_logps`.

    For logits that were computed only where a token is predicted (the packed forward of
    ``packing.packed_sequence_logps``): one row of logits may predict several targets (a shared
    prompt's last position predicts the first token of both responses). Computed as
    ``logit[target] - logsumexp(logits)``, the logsumexp once per row of ``logits``, so no
    full-vocabulary log-softmax copy is made.

    Args:
        logits: (M, V) unnormalised scores, any float dtype.
        rows: (N,) long, which row of ``logits`` predicts each target (values in [0, M)).
        targets: (N,) long token ids (no ``IGNORE_INDEX``: only real targets are passed).

    Returns:
        (N,) float32 log-probabilities in nats.

    Raises:
        ValueError: if ``logits`` is not 2-D or ``rows`` and ``targets`` differ in shape.
    """
    if logits.dim() != 2 or rows.shape != targets.shape or rows.dim() != 1:
        raise ValueError(
            f"logits must be (M, V) and rows, targets (N,); got {tuple(logits.shape)}, {tuple(rows.shape)}, {tuple(targets.shape)}."
        )
    picked = logits[rows, targets].float()
    return picked - torch.logsumexp(logits.float(), dim=-1)[rows]


def sum_by_sequence(
    token_logps: torch.Tensor, sequence: torch.Tensor, n_sequences: int, average_log_prob: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence totals of per-token log-probs, the same reduction as :func:`get_batch_logps`.

    Args:
        token_logps: (N,) float32 log-probs of the labelled tokens of all sequences.
        sequence: (N,) long, which sequence each token belongs to (values in [0, n_sequences)).
        n_sequences: S, the number of sequences (one with no token gets 0 and a count of 0).
        average_log_prob: if True the mean per labelled token (0 for none), else the sum.

    Returns:
        (logps, n_tokens): each (S,) float32; logps in nats.
    """
    zeros = torch.zeros(n_sequences, dtype=torch.float32, device=token_logps.device)
    total = zeros.index_add(0, sequence, token_logps.float())
    n_tokens = zeros.index_add(0, sequence, torch.ones_like(token_logps, dtype=torch.float32))
    if average_log_prob:
        return total / n_tokens.clamp(min=1.0), n_tokens
    return total, n_tokens


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    reference_chosen_logps: torch.Tensor,
    reference_rejected_logps: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    reference_free: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO loss, and conservative DPO when ``label_smoothing`` > 0.

    DPO (Rafailov et al. 2023, "Direct Preference Optimization", Eq. 7):
        h = (log pi(y_w|x) - log pi(y_l|x)) - (log ref(y_w|x) - log ref(y_l|x))
        loss = -log sigmoid(beta * h)
    Conservative DPO (Mitchell 2023, "A note on DPO with noisy preferences"):
    the label is flipped with probability eps = ``label_smoothing``,
        loss = -(1 - eps) log sigmoid(beta * h) - eps log sigmoid(-beta * h).
    With ``reference_free`` the reference terms are taken as 0 (a uniform reference).

    Args:
        policy_chosen_logps: (B,) log pi(y_w | x).
        policy_rejected_logps: (B,) log pi(y_l | x).
        reference_chosen_logps: (B,) log ref(y_w | x).
        reference_rejected_logps: (B,) log ref(y_l | x).
        beta: KL-penalty strength, > 0 (0.1 to 0.5 is typical).
        label_smoothing: assumed probability that a label is wrong, in [0, 0.5).
        reference_free: ignore the reference model.

    Returns:
        (losses, chosen_rewards, rejected_rewards), each (B,). The rewards are the
        implicit rewards beta * (log pi - log ref), detached.
    """
    pi_logratios = policy_chosen_logps - policy_rejected_logps
    ref_logratios = reference_chosen_logps - reference_rejected_logps
    if reference_free:
        ref_logratios = torch.zeros_like(ref_logratios)
    h = pi_logratios - ref_logratios
    losses = -F.logsigmoid(beta * h) * (1 - label_smoothing) - F.logsigmoid(-beta * h) * label_smoothing
    chosen_rewards, rejected_rewards = implicit_rewards(
        policy_chosen_logps,
        policy_rejected_logps,
        reference_chosen_logps,
        reference_rejected_logps,
        beta,
        reference_free,
    )
    return losses, chosen_rewards, rejected_rewards


def ipo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    reference_chosen_logps: torch.Tensor,
    reference_rejected_logps: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """IPO loss (Azar et al. 2023, "A General Theoretical Paradigm to Understand
    Learning from Human Preferences", Eq. 17, empirical form of IPO):

        h = (log pi(y_w|x) - log pi(y_l|x)) - (log ref(y_w|x) - log ref(y_l|x))
        loss = (h - 1 / (2 * beta)) ** 2

    Here ``beta`` is the paper's tau (the regularisation strength). IPO regresses
    the log-ratio gap to a finite target instead of pushing it to infinity. The
    authors use length-normalised log-probs, hence ``loss.average_log_prob: true``
    in config/loss/ipo.yaml.

    Args:
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps,
        reference_rejected_logps: (B,) each, as in :func:`dpo_loss`.
        beta: tau in the paper, > 0.

    Returns:
        (losses, chosen_rewards, rejected_rewards), each (B,); rewards as in DPO.
    """
    h = (policy_chosen_logps - policy_rejected_logps) - (reference_chosen_logps - reference_rejected_logps)
    losses = (h - 1 / (2 * beta)) ** 2
    chosen_rewards, rejected_rewards = implicit_rewards(
        policy_chosen_logps,
        policy_rejected_logps,
        reference_chosen_logps,
        reference_rejected_logps,
        beta,
    )
    return losses, chosen_rewards, rejected_rewards


def implicit_rewards(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    reference_chosen_logps: torch.Tensor,
    reference_rejected_logps: torch.Tensor,
    beta: float,
    reference_free: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DPO's implicit rewards r = beta * (log pi(y|x) - log ref(y|x)) (Rafailov et al. 2023, Eq. 5
    up to the partition function), detached. With ``reference_free`` the reference is 0.

    Shapes: all inputs (B,); returns (chosen_rewards, rejected_rewards), each (B,).
    """
    if reference_free:
        reference_chosen_logps = torch.zeros_like(reference_chosen_logps)
        reference_rejected_logps = torch.zeros_like(reference_rejected_logps)
    chosen = beta * (policy_chosen_logps - reference_chosen_logps).detach()
    rejected = beta * (policy_rejected_logps - reference_rejected_logps).detach()
    return chosen, rejected


def sft_loss(policy_logps_sum: torch.Tensor, n_tokens_total: float | torch.Tensor) -> torch.Tensor:
    """Supervised fine-tuning loss: negative log-likelihood per target token.

    The sum of the target tokens' log-probs is divided by the number of target
    tokens in the *whole* batch, so the loss does not depend on sequence length,
    on how the batch is split into micro-batches, or on which sequences share a
    batch (the reference repository sums per sequence instead).

    Args:
        policy_logps_sum: (B,) summed log pi(y | x) of each sequence's target tokens.
        n_tokens_total: number of target tokens in the full batch (all micro-batches).

    Returns:
        Scalar loss in nats per token.
    """
    return -policy_logps_sum.sum() / n_tokens_total


def bradley_terry_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> torch.Tensor:
    """Reward-model loss of the Bradley–Terry preference model, per pair.

    P(chosen > rejected) = sigmoid(r(x, y_c) - r(x, y_r)) (Bradley & Terry 1952; the reward
    model loss of Ouyang et al. 2022, Eq. 1, with one comparison per prompt), so the loss is
    ``-log sigmoid(r_c - r_r)``: ln 2 when the scores are equal.

    Args:
        chosen_scores, rejected_scores: (B,) scalar rewards of the chosen and rejected sequences.

    Returns:
        (B,) float32 losses, in nats.
    """
    return -F.logsigmoid(chosen_scores.float() - rejected_scores.float())


def last_token_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Scalar score of each right-padded sequence at its last real token, from a Hugging Face
    ``*ForSequenceClassification`` model with one label (its head is ``model.score``).

    The head's output is read at index ``attention_mask.sum(1) - 1`` of each row, not where the
    model's own pooling looks (the last token that is not ``pad_token_id``, which is wrong when
    the pad token is EOS and a sequence ends with EOS). Gradients flow (reward-model training).

    Args:
        model: e.g. ``LlamaForSequenceClassification`` with ``num_labels=1``.
        input_ids, attention_mask: (N, T) long, right-padded, each row with at least one real token.

    Returns:
        (N,) float32 scores.

    Raises:
        ValueError: if the model has no ``score`` head with one output.
    """
    head = getattr(model, "score", None)
    if head is None or getattr(head, "out_features", 1) != 1:
        raise ValueError(f"{type(model).__name__} has no one-output `score` head; load it with num_labels=1.")
    captured = []
    handle = head.register_forward_hook(lambda module, args, output: captured.append(output))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask)
    finally:
        handle.remove()
    per_position = captured[0][..., 0]  # (N, T)
    last = (attention_mask.sum(1) - 1).clamp(min=0).to(per_position.device)
    return per_position.gather(1, last.unsqueeze(1)).squeeze(1).float()
