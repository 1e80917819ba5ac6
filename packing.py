"""The packed DPO forward: no padding computed, each prompt forwarded once per pair.

Each pair becomes one row: the shared prefix (the prompt, and any first response tokens both
sides share), then the rest of chosen, then the rest of rejected, which attends to the prefix but
not to chosen (a 4-D attention mask, position ids continuing from the prefix on both sides). Rows
are grouped by length into a few forward calls, each padded only to its own longest row, and the
output layer runs only at positions that predict a labelled token. The log-probs equal those of
each sequence forwarded alone (tests/test_packed.py); ``BasicTrainer.concatenated_forward`` and
the reference precompute use it, and fall back to the padded forward when it does not apply.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys

import numpy as np
import torch

import losses

PACKED_CHUNK_COST = 0.05
"""The cost of one more forward call in :func:`plan_chunks`, as a fraction of the positions of the
whole batch padded to its longest row (a call's fixed overhead: Python, kernel launches, smaller
matrices). On 2 CPU cores, 2-4 calls per DPO batch of 8 pairs were fastest; 8 were slower."""


@dataclasses.dataclass
class PackedRow:
    """One row of a packed forward: a single sequence, or a pair's shared prefix (the prompt, and
    any first response tokens both sides share) followed by the rest of chosen, then the rest of
    rejected, which attends to the prefix but not to chosen.

    Attributes:
        ids: the row's tokens, no padding.
        positions: position id of each token (None: 0, 1, ... for a single sequence).
        branch: per token 0 (shared prefix), 1 (chosen's rest) or 2 (rejected's rest); None for
            a single sequence.
        target_cols, target_ids, target_seqs: for each labelled token of the row's sequences,
            the column that predicts it, its label, and its sequence (0..2B-1, chosen first).
    """

    ids: list[int]
    positions: list[int] | None
    branch: list[int] | None
    target_cols: list[int]
    target_ids: list[int]
    target_seqs: list[int]


def _targets(labels: list[int], seq: int, column) -> tuple[list[int], list[int], list[int]]:
    """(columns, labels, sequence ids) of a sequence's labelled tokens; token t is predicted at
    logical position t - 1, placed by ``column``; the label at position 0 predicts nothing."""
    ts = [t for t in range(1, len(labels)) if labels[t] != losses.IGNORE_INDEX]
    return [column(t - 1) for t in ts], [labels[t] for t in ts], [seq] * len(ts)


def pack_preference_rows(batch: dict, share_prompt: bool = True) -> list[PackedRow] | None:
    """The rows of a packed forward for a DPO batch: padding removed and, with ``share_prompt``,
    each pair's common prefix (at least the prompt) in one row with both responses after it.

    Args:
        batch: ``chosen_*`` and ``rejected_*`` ``input_ids``, ``attention_mask``, ``labels``,
            each (B, T_c) / (B, T_r), right-padded (as ``preference_datasets.collate`` makes them).
        share_prompt: put chosen and rejected of a pair in one row when their first tokens agree.

    Returns:
        The rows (B of them when every pair shares a prefix, else up to 2B), or None when a
        sequence is not right-padded or has a label under attention mask 0 (the caller then
        uses the plain padded forward, which handles such batches as before).
    """
    n = batch["chosen_input_ids"].shape[0]
    sides = []
    for side in ("chosen", "rejected"):
        ids, mask, labels = (batch[f"{side}_{k}"] for k in ("input_ids", "attention_mask", "labels"))
        lengths = mask.sum(1)
        expected = torch.arange(mask.shape[1], device=mask.device) < lengths[:, None]
        if not torch.equal(mask.bool(), expected) or bool((labels[~expected] != losses.IGNORE_INDEX).any()):
            return None
        sides.append([(i[:length], lab[:length]) for i, lab, length in zip(ids.tolist(), labels.tolist(), lengths.tolist())])
    rows = []
    for i, ((c_ids, c_lab), (r_ids, r_lab)) in enumerate(zip(*sides)):
        shared = 0
        if share_prompt:
            limit = min(len(c_ids), len(r_ids))
            while shared < limit and c_ids[shared] == r_ids[shared]:
                shared += 1
        if shared == 0:
            for seq, (ids, lab) in ((i, (c_ids, c_lab)), (n + i, (r_ids, r_lab))):
                rows.append(PackedRow(ids, None, None, *_targets(lab, seq, lambda p: p)))
            continue
        c_len = len(c_ids)
        c_cols, c_tgt, c_seq = _targets(c_lab, i, lambda p: p)
        r_cols, r_tgt, r_seq = _targets(r_lab, n + i, lambda p, s=shared, c=c_len: p if p < s else c + p - s)
        rows.append(
            PackedRow(
                ids=c_ids + r_ids[shared:],
                positions=list(range(c_len)) + list(range(shared, len(r_ids))),
                branch=[0] * shared + [1] * (c_len - shared) + [2] * (len(r_ids) - shared),
                target_cols=c_cols + r_cols,
                target_ids=c_tgt + r_tgt,
                target_seqs=c_seq + r_seq,
            )
        )
    return rows


def plan_chunks(lengths: list[int], max_chunks: int | None = None, chunk_cost: float = PACKED_CHUNK_COST) -> list[list[int]]:
    """Group rows into forward calls of similar lengths, each padded only to its own longest row.

    Rows are sorted by length and cut into contiguous groups minimising
    ``sum(rows_in_group * longest_in_group) + n_groups * chunk_cost * len(lengths) * max(lengths)``
    (positions computed, plus a fixed cost per call), by dynamic programming.

    Args:
        lengths: each row's length in tokens (>= 0).
        max_chunks: at most this many groups (None: as many as pay off; 1: one call, as FSDP
            needs, whose ranks must make the same number of calls).
        chunk_cost: the per-call cost as a fraction of the fully padded batch.

    Returns:
        Lists of row indices, shortest rows first, every index exactly once.

    Raises:
        ValueError: if ``max_chunks`` < 1.
    """
    if max_chunks is not None and max_chunks < 1:
        raise ValueError(f"max_chunks must be >= 1, not {max_chunks}.")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    n = len(order)
    if n <= 1 or max_chunks == 1:
        return [order] if n else []
    width = np.array([lengths[i] for i in order], dtype=np.float64)
    penalty = chunk_cost * n * max(width[-1], 1.0)
    start, end = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
    # cost[i, j]: rows i..j-1 (sorted) in one call
    cost = np.where(start < end, (end - start) * np.concatenate([[0.0], width])[end] + penalty, np.inf)
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    cuts, totals = [], []
    for _ in range(min(max_chunks or n, n, int(1 / chunk_cost) + 1)):  # more calls than that never pay
        candidates = best[:, None] + cost
        cuts.append(candidates.argmin(0))
        best = candidates.min(0)
        totals.append(best[n])
    j, groups = n, []
    for k in range(int(np.argmin(totals)), -1, -1):
        i = int(cuts[k][j])
        groups.append(order[i:j])
        j = i
    return groups[::-1]


def _family_module(model):
    """The transformers module (``transformers.models.<family>.modeling_<family>``) defining
    ``model``'s class, or None for a model from elsewhere (also under FSDP's wrapper class)."""
    for cls in type(model).__mro__:
        if cls.__module__.startswith("transformers.models."):
            return sys.modules.get(cls.__module__)
    return None


def packed_forward_support(model) -> tuple[bool, bool]:
    """What of the packed forward ``model`` supports: (per-position ``logits_to_keep``,
    a shared prompt).

    A 2-D boolean ``logits_to_keep`` (transformers >= 5) applies the output layer only where a
    token is predicted; without it, the output layer covers a suffix of each call. Sharing the
    prompt needs a custom 4-D mask and position ids, which transformers' ``create_causal_mask``
    passes through unchanged for SDPA and eager attention, and no sliding window.
    """
    module = _family_module(model)
    if module is None:
        return False, False
    config = getattr(model, "config", None)
    keep_bool = hasattr(module, "slice_logits_to_keep")
    window = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    share = (
        hasattr(module, "create_causal_mask")
        and getattr(config, "_attn_implementation", None) in ("sdpa", "eager")
        and not window
        and "position_ids" in inspect.signature(model.forward).parameters
    )
    return keep_bool, share


def keep_mask_device(model, device) -> torch.device:
    """Where the boolean ``logits_to_keep`` mask goes: the model indexes its last hidden states
    with it, which for a model split over several GPUs by ``model.device_map`` (accelerate's
    ``hf_device_map``) end on the last one, not on ``device`` (where the inputs go). A CPU index
    may index a tensor on any device, so a split model gets it on the CPU; others on ``device``."""
    placed = getattr(model, "hf_device_map", None) or {}
    return torch.device("cpu") if len({str(d) for d in placed.values()}) > 1 else torch.device(device)


def _row_matrix(values: list[list[int]], width: int, fill: int) -> torch.Tensor:
    return torch.tensor([v + [fill] * (width - len(v)) for v in values], dtype=torch.long)


def _packed_chunk_logps(model, rows: list[PackedRow], device, keep_bool: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward call over ``rows``, padded to the longest of them: (per-target log-probs
    (N,) float32, their sequence ids (N,) long), targets in row order."""
    width = max(len(r.ids) for r in rows)
    kwargs = {"input_ids": _row_matrix([r.ids for r in rows], width, 0).to(device), "use_cache": False}
    if any(r.branch is not None for r in rows):
        positions = [r.positions if r.positions is not None else list(range(len(r.ids))) for r in rows]
        branch = _row_matrix([r.branch if r.branch is not None else [0] * len(r.ids) for r in rows], width, 3)
        # causal, except that rejected's rest (2) does not see chosen's rest (1); padding (3)
        # sees what precedes it, so no row is empty (no NaN), and nothing real sees padding
        allowed = torch.ones(width, width, dtype=torch.bool).tril() & ~((branch[:, :, None] == 2) & (branch[:, None, :] == 1))
        allowed = allowed[:, None].to(device)
        if model.config._attn_implementation == "eager":
            dtype = next(model.parameters()).dtype
            allowed = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
        kwargs["attention_mask"] = allowed
        kwargs["position_ids"] = _row_matrix(positions, width, 0).to(device)
    row_idx = torch.tensor([k for k, r in enumerate(rows) for _ in r.target_cols], dtype=torch.long)
    col_idx = torch.tensor([c for r in rows for c in r.target_cols], dtype=torch.long)
    targets = torch.tensor([t for r in rows for t in r.target_ids], dtype=torch.long)
    seqs = torch.tensor([s for r in rows for s in r.target_seqs], dtype=torch.long, device=device)
    keep = torch.zeros(len(rows), width, dtype=torch.bool)
    keep[row_idx, col_idx] = True
    # the row of the kept logits (row-major over ``keep``) that predicts each target
    where = (keep.flatten().cumsum(0) - 1)[row_idx * width + col_idx]
    if keep_bool:
        logits = model(**kwargs, logits_to_keep=keep.to(keep_mask_device(model, device))).logits
        if logits.dim() != 2 or logits.shape[0] != int(keep.sum()):
            raise RuntimeError(f"{type(model).__name__} ignored a boolean logits_to_keep (logits {tuple(logits.shape)}).")
    else:
        first = int(col_idx.min()) if len(col_idx) else width - 1
        logits = model(**kwargs, logits_to_keep=width - first).logits
        logits = logits[keep[:, first:].to(logits.device)]
    # the indices go where the logits came out (a split model's last GPU), the log-probs to ``device``
    token_logps = losses.gathered_token_logps(logits, where.to(logits.device), targets.to(logits.device))
    return token_logps.to(device), seqs


def packed_sequence_logps(
    model, batch: dict, average_log_prob: bool, device, max_chunks: int | None = None, share_prompt: bool = True
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Chosen and rejected log-probs of a DPO batch without computing padding or a second copy
    of each prompt; the same values as the plain padded forward, within float tolerance.

    The rows of :func:`pack_preference_rows` are forwarded in the groups of :func:`plan_chunks`,
    each trimmed to its own longest row: rows without a shared prefix need no attention mask
    at all (right padding is invisible to a causal model), rows with one get a 4-D mask in which
    rejected does not see chosen, and position ids that continue the prompt on both sides. The
    output layer is applied only where a token is predicted (when the model supports it). All
    calls stay in one autograd graph, so one backward gives the gradient of the whole batch.

    Args:
        model: a Hugging Face causal LM (plain, FSDP- or tensor-parallel-wrapped).
        batch: a collated DPO batch (B pairs), see :func:`pack_preference_rows`.
        average_log_prob: mean per response token instead of the sum.
        device: where the model's inputs go.
        max_chunks: at most this many forward calls (1 under FSDP).
        share_prompt: forward each pair's prompt once (if the model supports it).

    Returns:
        (logps, n_tokens), each (2B,) float32, chosen rows first, as ``losses.get_batch_logps``
        over ``concatenated_inputs``; None when the batch is not right-padded (see
        :func:`pack_preference_rows`).
    """
    keep_bool, can_share = packed_forward_support(model)
    rows = pack_preference_rows(batch, share_prompt and can_share)
    if rows is None:
        return None
    parts = [
        _packed_chunk_logps(model, [rows[k] for k in group], device, keep_bool)
        for group in plan_chunks([len(r.ids) for r in rows], max_chunks)
    ]
    token_logps = torch.cat([p[0] for p in parts])
    seqs = torch.cat([p[1] for p in parts])
    return losses.sum_by_sequence(token_logps, seqs, 2 * batch["chosen_input_ids"].shape[0], average_log_prob)
