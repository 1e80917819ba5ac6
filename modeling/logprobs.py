"""Log-probabilities of response tokens from a causal LM's logits, as pure tensor functions (B sequences, T tokens,
V vocabulary; nats): the padded forward's (:func:`get_batch_logps`) and the gathered positions' of the packed and
chunked forwards (:func:`gathered_token_logps`, summed per sequence by :func:`sum_by_sequence`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from losses import IGNORE_INDEX


def get_batch_logps(
    logits: torch.Tensor,
    labels: torch.Tensor,
    average_log_prob: bool = False,
    token_weight: Callable | None = None,
    token_statistic: Callable | None = None,
) -> tuple[torch.Tensor, ...]:
    """(logps, n_tokens), each (B,), of each sequence's labelled tokens from (B, T, V) ``logits`` and (B, T) ``labels``
    (position t predicts label t + 1): logps in nats, float32 (float64 for float64 logits), summed or, with
    ``average_log_prob``, per token; n_tokens float32; ValueError if the shapes disagree. ``token_weight``: each labelled
    token's weight in the sum (:func:`sum_by_sequence`); ``token_statistic``: also its (B,) mean per sequence
    (:func:`statistic_means`)."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} must share (B, T).")
    full = logits
    labels = labels[:, 1:]
    logits = logits[:, :-1, :]
    mask = labels != IGNORE_INDEX
    safe_labels = torch.where(mask, labels, 0)
    dtype = torch.promote_types(logits.dtype, torch.float32)  # float32, or float64 for float64 logits
    picked = torch.gather(logits, 2, safe_labels.unsqueeze(2)).squeeze(2).to(dtype)
    per_token = picked - torch.logsumexp(logits.to(dtype), dim=-1)  # no full-vocabulary log-softmax copy
    per_token = torch.where(mask, per_token, 0.0)  # not * mask: a NaN at a pad position must not leak
    n_tokens = mask.sum(-1).float()
    if token_weight is not None:  # the labelled tokens in order, as sum_by_sequence weighs them
        rows = torch.arange(mask.shape[0], device=mask.device)[:, None].expand_as(mask)
        rank = (mask.cumsum(-1) - 1)[mask]
        weights = torch.zeros_like(per_token)
        weights[mask] = token_weight(rank, rows[mask], n_tokens).to(per_token.dtype)
        per_token = per_token * weights
    total = per_token.sum(-1)
    if average_log_prob:
        total = total / n_tokens.clamp(min=1.0)  # a sequence with no labelled token gets 0, never NaN (0 / 0)
    if token_statistic is None:
        return total, n_tokens
    seqs, cols = mask.nonzero(as_tuple=True)
    rows = seqs * full.shape[1] + cols  # the position predicting each labelled token, row-major over (B, T)
    values = statistic_values(token_statistic, full.reshape(-1, full.shape[-1]), rows, labels[mask])
    return total, n_tokens, statistic_means(values, seqs, mask.shape[0])


def gathered_token_logps(logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(N,) log softmax(logits[rows[k]])[targets[k]] in nats, float32 (float64 for float64 logits), from (M, V)
    ``logits`` and (N,) long ``rows`` and ``targets``; ValueError for other shapes."""
    if logits.dim() != 2 or rows.shape != targets.shape or rows.dim() != 1:
        raise ValueError(
            f"logits must be (M, V) and rows, targets (N,); got {tuple(logits.shape)}, {tuple(rows.shape)}, {tuple(targets.shape)}."
        )
    dtype = torch.promote_types(logits.dtype, torch.float32)
    picked = logits[rows, targets].to(dtype)
    return picked - torch.logsumexp(logits.to(dtype), dim=-1)[rows]  # logsumexp once per row, no log-softmax copy


def sum_by_sequence(
    token_logps, sequence, n_sequences: int, average_log_prob: bool = False, token_weight: Callable | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logps, n_tokens), each (S = ``n_sequences``,), the sums (or means) of (N,) ``token_logps`` per (N,) ``sequence``:
    logps in nats, float32 (float64 for float64 input), n_tokens float32; a sequence without tokens gets 0.

    ``token_weight(rank, sequence, n_tokens)`` (an objective's ``token_weights``, e.g. LD-DPO's), if given, returns each
    token's (N,) weight in the sum from its 0-based place among its sequence's tokens (they come in order), its
    sequence and the (S,) token counts."""
    total = torch.zeros(n_sequences, dtype=torch.promote_types(token_logps.dtype, torch.float32), device=token_logps.device)
    ones = torch.ones_like(token_logps, dtype=torch.float32)
    n_tokens = torch.zeros(n_sequences, dtype=torch.float32, device=token_logps.device).index_add(0, sequence, ones)
    if token_weight is not None:
        token_logps = token_logps * token_weight(token_ranks(sequence, n_sequences), sequence, n_tokens).to(token_logps.dtype)
    total = total.index_add(0, sequence, token_logps.to(total.dtype))
    return (total / n_tokens.clamp(min=1.0) if average_log_prob else total), n_tokens


def token_ranks(sequence: torch.Tensor, n_sequences: int) -> torch.Tensor:
    """(N,) each token's 0-based place among the tokens of its (N,) ``sequence``, in the order they come."""
    order = torch.argsort(sequence, stable=True)
    counts = torch.bincount(sequence, minlength=n_sequences)
    starts = counts.cumsum(0) - counts
    ranks = torch.empty_like(sequence)
    ranks[order] = torch.arange(len(sequence), device=sequence.device) - starts[sequence[order]]
    return ranks


def statistic_values(token_statistic: Callable, logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(N,) ``token_statistic(logits, rows, targets)``, an objective's quantity per target token (WPO's log weight) from the
    (M, V) logits of the positions, (N,) ``rows`` predicting (N,) ``targets``, computed without gradient."""
    with torch.no_grad():
        return token_statistic(logits.detach(), rows, targets)


def statistic_means(values: torch.Tensor, sequence: torch.Tensor, n_sequences: int) -> torch.Tensor:
    """(S,) float32 means per (N,) ``sequence`` of the (N,) :func:`statistic_values` (0 for a sequence without tokens)."""
    return sum_by_sequence(values, sequence, n_sequences, average_log_prob=True)[0]
