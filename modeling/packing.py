"""The packed DPO forward: each pair one unpadded row (shared prompt, chosen's rest, rejected's rest masked from
chosen's), the output layer run in chunks only where a token is predicted; the padded forward's log-probs
(tests/test_packed.py)."""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import weakref

import numpy as np
import torch
import torch.utils.checkpoint

import losses
from modeling import logprobs

PACKED_CHUNK_COST = 0.05  # plan_chunks' cost of one more forward call, as a fraction of the batch's padded positions


@dataclasses.dataclass
class PackedRow:
    """One row of a packed forward, a single sequence or a pair's shared prefix, chosen's rest, rejected's rest:
    ``branch`` per token 0 / 1 / 2 (None: single), ``positions`` (None: 0, 1, ...), and per labelled token its
    predicting column, label and sequence (0..2B-1, chosen first)."""

    ids: list[int]
    positions: list[int] | None
    branch: list[int] | None
    target_cols: list[int]
    target_ids: list[int]
    target_seqs: list[int]


def _targets(labels: list[int], seq: int, column=lambda p: p) -> tuple[list[int], list[int], list[int]]:
    """(columns, labels, sequence ids) of a sequence's labelled tokens, token t predicted at the column ``column(t - 1)``."""
    ts = [t for t in range(1, len(labels)) if labels[t] != losses.IGNORE_INDEX]  # the label at position 0 predicts nothing
    return [column(t - 1) for t in ts], [labels[t] for t in ts], [seq] * len(ts)


def _unpadded(ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> list[tuple[list[int], list[int]]] | None:
    """Each row's (ids, labels) without its right padding; None when a row is not right-padded or has a label under mask 0."""
    lengths = mask.sum(1)
    expected = torch.arange(mask.shape[1], device=mask.device) < lengths[:, None]
    if not torch.equal(mask.bool(), expected) or bool((labels[~expected] != losses.IGNORE_INDEX).any()):
        return None
    return [(i[:length], lab[:length]) for i, lab, length in zip(ids.tolist(), labels.tolist(), lengths.tolist())]


def pack_preference_rows(batch: dict, share_prompt: bool = True) -> list[PackedRow] | None:
    """The packed rows of a DPO batch (``chosen_*`` / ``rejected_*`` (B, T), right-padded): one per pair with a shared prefix
    (``share_prompt``), else two; None when a sequence is not right-padded or has a label under mask 0."""
    n = batch["chosen_input_ids"].shape[0]
    sides = [_unpadded(*(batch[f"{s}_{k}"] for k in ("input_ids", "attention_mask", "labels"))) for s in ("chosen", "rejected")]
    if None in sides:
        return None
    rows = []
    for i, ((c_ids, c_lab), (r_ids, r_lab)) in enumerate(zip(*sides)):
        shared = len(os.path.commonprefix([c_ids, r_ids])) if share_prompt else 0  # leading tokens the pair shares
        if shared == 0:
            rows += [PackedRow(c_ids, None, None, *_targets(c_lab, i)), PackedRow(r_ids, None, None, *_targets(r_lab, n + i))]
            continue
        c_len, chosen = len(c_ids), _targets(c_lab, i)
        rejected = _targets(r_lab, n + i, lambda p, s=shared, c=c_len: p if p < s else c + p - s)  # rest after chosen's
        positions = list(range(c_len)) + list(range(shared, len(r_ids)))
        branch = [0] * shared + [1] * (c_len - shared) + [2] * (len(r_ids) - shared)
        rows.append(PackedRow(c_ids + r_ids[shared:], positions, branch, *(c + r for c, r in zip(chosen, rejected))))
    return rows


def plan_chunks(lengths: list[int], max_chunks: int | None = None, chunk_cost: float = PACKED_CHUNK_COST) -> list[list[int]]:
    """Row indices grouped into forward calls, shortest first, by dynamic programming minimising ``sum(rows * longest) +
    n_groups * chunk_cost * len(lengths) * max(lengths)`` positions in at most ``max_chunks`` calls (1 under FSDP; >= 1)."""
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
    best = np.concatenate([[0.0], np.full(n, np.inf)])  # best[j]: the cheapest cost of rows 0..j-1 so far
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


def packed_forward_support(model) -> tuple[bool, bool]:
    """(per-position boolean ``logits_to_keep``: transformers >= 5, shared prompt: custom 4-D mask and position
    ids with SDPA or eager attention, no sliding window) as ``model`` (a peft model: its base model) supports them."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft's PeftModel: forward(*args, **kwargs)
    # the modeling_<family> module defining the model's class (also under FSDP's wrapper class); None: not transformers'
    families = [c.__module__ for c in type(model).__mro__ if c.__module__.startswith("transformers.models.")]
    module = sys.modules.get(families[0]) if families else None
    if module is None:
        return False, False
    config = getattr(model, "config", None)
    window = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    masks = hasattr(module, "create_causal_mask") and getattr(config, "_attn_implementation", None) in ("sdpa", "eager")
    share = masks and not window and "position_ids" in inspect.signature(model.forward).parameters
    return hasattr(module, "slice_logits_to_keep"), share


def keep_mask_device(model, device) -> torch.device:
    """Where the bool ``logits_to_keep`` mask goes: the CPU for a model split over GPUs (``hf_device_map``), else ``device``."""
    placed = getattr(model, "hf_device_map", None) or {}
    return torch.device("cpu") if len({str(d) for d in placed.values()}) > 1 else torch.device(device)


DEFAULT_OUTPUT_LAYER_CHUNK = 1024  # output_layer_chunk's default: labelled positions per call of the output layer

LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config attributes that change the logits after the output layer (Gemma, Cohere, Granite): the unchunked path."""

_UNCHUNKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> why it takes the unchunked path


def _logit_transform(model) -> str | None:
    """The first of :data:`LOGIT_TRANSFORMS` set in ``model``'s config (or its text config) as ``"name=value"``, else None."""
    config = getattr(model, "config", None)
    configs = [config, config.get_text_config()] if hasattr(config, "get_text_config") else [config]
    found = [f"{name}={getattr(c, name)}" for c in configs for name in LOGIT_TRANSFORMS if getattr(c, name, None) is not None]
    return found[0] if found else None


def _refuse_chunking(model, reason: str) -> None:
    """Remember that ``model`` takes the unchunked output layer, and say so once (rank 0)."""
    _UNCHUNKED[model] = reason
    rank0 = not (torch.distributed.is_available() and torch.distributed.is_initialized()) or torch.distributed.get_rank() == 0
    if rank0:
        print(
            f"Note: {type(model).__name__} {reason}, so its log-probs take the unchunked output layer "
            "(output_layer_chunk is ignored for it)."
        )


class ChunkedOutputLayer(torch.nn.Module):
    """Stands in for a causal LM's output layer during one forward call and returns the (N,) float32 log-prob of each
    target, calling the real layer (inside the model's forward, so FSDP2, accelerate hooks and tied weights apply) on
    ``chunk`` positions at a time under non-reentrant checkpointing; ``rows`` (N,) index the (M, H) flattened hidden states;
    with ``token_statistic``, also each target's :func:`logprobs.statistic_values` from the same logits (``statistic``)."""

    def __init__(self, head, rows, targets, chunk: int, n_positions: int | None = None, token_statistic=None):
        super().__init__()
        self.head = head
        self.rows, self.targets, self.chunk, self.n_positions = rows.cpu(), targets.cpu(), int(chunk), n_positions
        self.token_statistic = token_statistic
        self.result = self.statistic = None

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:  # e.g. ``.weight``, read by a model's own code: the head's
            return getattr(super().__getattr__("head"), name)

    def _chunk_logps(self, hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor):
        logits = self.head(hidden)  # (c, V); the head may move it to its own device
        rows, targets = rows.to(logits.device), targets.to(logits.device)
        token_logps = logprobs.gathered_token_logps(logits, rows, targets)
        if self.token_statistic is None:
            return token_logps
        return token_logps, logprobs.statistic_values(self.token_statistic, logits, rows, targets)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N,) float32 log-probs of the targets from ``hidden`` (..., H); RuntimeError unless it holds ``n_positions``."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        if self.n_positions is not None and flat.shape[0] != self.n_positions:
            raise RuntimeError(
                f"The output layer got {flat.shape[0]} positions, not the {self.n_positions} asked for by logits_to_keep."
            )
        positions, inverse = torch.unique(self.rows, sorted=True, return_inverse=True)
        order = torch.argsort(inverse, stable=True)  # targets grouped by position, positions ascending
        local, targets = inverse[order], self.targets[order]
        bounds = torch.searchsorted(local, torch.arange(0, max(len(positions), 1) + self.chunk, self.chunk)).tolist()
        parts = []
        for k, lo in enumerate(range(0, max(len(positions), 1), self.chunk)):
            a, b = bounds[k], bounds[k + 1]
            args = (flat[positions[lo : lo + self.chunk].to(flat.device)], local[a:b] - lo, targets[a:b])
            if torch.is_grad_enabled():  # the backward recomputes each chunk's logits
                parts.append(torch.utils.checkpoint.checkpoint(self._chunk_logps, *args, use_reentrant=False))
            else:
                parts.append(self._chunk_logps(*args))
        if self.token_statistic is not None:  # (logps, statistic) per chunk
            statistic = torch.cat([p[1] for p in parts])
            self.statistic = statistic[torch.argsort(order).to(statistic.device)]
            parts = [p[0] for p in parts]
        sorted_logps = torch.cat(parts)
        self.result = sorted_logps[torch.argsort(order).to(sorted_logps.device)]
        return self.result


def output_layer_logps(
    model, kwargs: dict, logits_to_keep, rows, targets, chunk=DEFAULT_OUTPUT_LAYER_CHUNK, n_positions=None, token_statistic=None
):
    """The (N,) float32 log-prob in nats of each (N,) ``targets`` at its (N,) ``rows`` among the M kept positions (row-major;
    ``logits_to_keep``: an int, each row's last, or a 2-D bool mask) of one forward call of ``model``, the output layer
    a :class:`ChunkedOutputLayer` if ``chunk`` (else, or where it cannot be, unchunked); RuntimeError if M != ``n_positions``.
    With ``token_statistic``: (log-probs, each target's :func:`logprobs.statistic_values`), (N,) each."""
    prefer_masked_gqa(kwargs["input_ids"].device)
    if chunk and model not in _UNCHUNKED:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        # (parent, attribute name) under which the model holds its output layer
        place = next(((p, name) for p in model.modules() for name, c in p.named_children() if c is head), None)
        if not isinstance(head, torch.nn.Module) or place is None:
            _refuse_chunking(model, "has no output layer module (get_output_embeddings) to call in chunks")
        elif transform := _logit_transform(model):
            _refuse_chunking(model, f"changes its logits after the output layer ({transform})")
        else:
            stand_in = ChunkedOutputLayer(head, rows, targets, chunk, n_positions, token_statistic)
            setattr(*place, stand_in)
            try:
                out = model(**kwargs, logits_to_keep=logits_to_keep)
            finally:
                setattr(*place, head)
            if stand_in.result is not None and out.logits is stand_in.result:
                return stand_in.result if token_statistic is None else (stand_in.result, stand_in.statistic)
            _refuse_chunking(model, "does not return its output layer's output as its logits")
    logits = model(**kwargs, logits_to_keep=logits_to_keep).logits
    flat = logits.reshape(-1, logits.shape[-1])
    if n_positions is not None and flat.shape[0] != n_positions:
        raise RuntimeError(
            f"{type(model).__name__} ignored logits_to_keep (logits {tuple(logits.shape)}, not {n_positions} positions)."
        )
    rows, targets = rows.to(flat.device), targets.to(flat.device)
    token_logps = logprobs.gathered_token_logps(flat, rows, targets)
    if token_statistic is None:
        return token_logps
    return token_logps, logprobs.statistic_values(token_statistic, flat, rows, targets)


def compute_dtype(model) -> torch.dtype:
    """The dtype ``model`` computes in: FSDP2's mixed-precision ``param_dtype`` when set, else its parameters' dtype."""
    get_state = getattr(model, "_get_fsdp_state", None)  # FSDP2's FSDPModule, whose parameters stay float32 outside the forward
    dtype = getattr(getattr(get_state(), "_mp_policy", None), "param_dtype", None) if get_state is not None else None
    return dtype if dtype is not None else next(model.parameters()).dtype


GQA_SWITCH = "TRANSFORMERS_SDPA_FORCE_GQA"


def prefer_masked_gqa(device) -> None:
    """On the CPU (not a GPU: slow there), set ``TRANSFORMERS_SDPA_FORCE_GQA`` unless set, so SDPA keeps masked grouped heads."""
    if torch.device(device).type == "cpu":
        os.environ.setdefault(GQA_SWITCH, "1")


def _row_matrix(values: list[list[int]], width: int, fill: int) -> torch.Tensor:
    return torch.tensor([v + [fill] * (width - len(v)) for v in values], dtype=torch.long)


def _packed_chunk_logps(model, rows: list[PackedRow], device, keep_bool: bool, chunk=DEFAULT_OUTPUT_LAYER_CHUNK, statistic=None):
    """(log-probs (N,) float32, sequence ids (N,) long[, ``statistic``'s values (N,)]) of the targets of ``rows``, in row
    order, from one forward call padded to the longest row (:func:`output_layer_logps`)."""
    width = max(len(r.ids) for r in rows)
    kwargs = {"input_ids": _row_matrix([r.ids for r in rows], width, 0).to(device), "use_cache": False}
    if any(r.branch is not None for r in rows):
        positions = [r.positions if r.positions is not None else list(range(len(r.ids))) for r in rows]
        branch = _row_matrix([r.branch if r.branch is not None else [0] * len(r.ids) for r in rows], width, 3)
        # causal, but rejected's rest (2) does not see chosen's rest (1); padding (3) sees what precedes it (no NaN row).
        # Additive in the compute dtype, built once: SDPA would make a float copy of a boolean mask in every layer.
        allowed = torch.ones(width, width, dtype=torch.bool).tril() & ~((branch[:, :, None] == 2) & (branch[:, None, :] == 1))
        dtype = compute_dtype(model)
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        kwargs["attention_mask"] = mask[:, None].to(device)
        kwargs["position_ids"] = _row_matrix(positions, width, 0).to(device)
    row_idx = torch.tensor([k for k, r in enumerate(rows) for _ in r.target_cols], dtype=torch.long)
    col_idx = torch.tensor([c for r in rows for c in r.target_cols], dtype=torch.long)
    targets = torch.tensor([t for r in rows for t in r.target_ids], dtype=torch.long)
    seqs = torch.tensor([s for r in rows for s in r.target_seqs], dtype=torch.long, device=device)
    if keep_bool:
        keep = torch.zeros(len(rows), width, dtype=torch.bool)
        keep[row_idx, col_idx] = True
        # the row of the kept positions (row-major over ``keep``) that predicts each target
        where = (keep.flatten().cumsum(0) - 1)[row_idx * width + col_idx]
        keep_arg, n_positions = keep.to(keep_mask_device(model, device)), int(keep.sum())
    else:  # the last ``width - first`` positions of every row
        first = int(col_idx.min()) if len(col_idx) else width - 1
        where = row_idx * (width - first) + col_idx - first
        keep_arg, n_positions = width - first, len(rows) * (width - first)
    out = output_layer_logps(model, kwargs, keep_arg, where, targets, chunk, n_positions, statistic)
    if statistic is not None:  # (log-probs, statistic values)
        return out[0].to(device), seqs, out[1].to(device)
    return out.to(device), seqs  # a split model's log-probs come from its last GPU


def _packed_logps(
    model, rows: list[PackedRow], n_sequences, average_log_prob, device, max_chunks, chunk, token_weight=None, statistic=None
):
    """(logps, n_tokens[, statistic means]), each (n_sequences,) float32, of packed ``rows`` forwarded in :func:`plan_chunks`'
    groups, one graph (``token_weight``: :func:`logprobs.sum_by_sequence`'s; ``statistic``: :func:`logprobs.statistic_means`)."""
    keep_bool = packed_forward_support(model)[0]
    groups = plan_chunks([len(r.ids) for r in rows], max_chunks)
    parts = [_packed_chunk_logps(model, [rows[k] for k in group], device, keep_bool, chunk, statistic) for group in groups]
    token_logps, seqs = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    out = logprobs.sum_by_sequence(token_logps, seqs, n_sequences, average_log_prob, token_weight)
    if statistic is None:
        return out
    return *out, logprobs.statistic_means(torch.cat([p[2] for p in parts]), seqs, n_sequences)


def pack_single_rows(inputs: dict) -> list[PackedRow] | None:
    """The packed rows of single (B, T) right-padded sequences (SFT targets, KTO completions), row k's targets of id k;
    None when one is not right-padded or has a label under mask 0."""
    sequences = _unpadded(inputs["input_ids"], inputs["attention_mask"], inputs["labels"])
    if sequences is None:
        return None
    return [PackedRow(ids, None, None, *_targets(labels, k)) for k, (ids, labels) in enumerate(sequences)]


def packed_single_logps(
    model,
    inputs: dict,
    average_log_prob: bool,
    device,
    max_chunks: int | None = None,
    chunk: int | None = DEFAULT_OUTPUT_LAYER_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(logps, n_tokens), each (B,) float32, of single right-padded sequences forwarded packed (``logprobs.get_batch_logps``'s
    values on the padded forward); None when one is not right-padded."""
    rows = pack_single_rows(inputs)
    if rows is None:
        return None
    return _packed_logps(model, rows, len(rows), average_log_prob, device, max_chunks, chunk)


def packed_sequence_logps(
    model,
    batch: dict,
    average_log_prob: bool,
    device,
    max_chunks=None,
    share_prompt=True,
    chunk=DEFAULT_OUTPUT_LAYER_CHUNK,
    token_weight=None,
    token_statistic=None,
) -> tuple[torch.Tensor, ...] | None:
    """(logps, n_tokens), each (2B,) float32 chosen first, of a DPO batch forwarded packed (the padded forward's within float
    tolerance) in at most ``max_chunks`` calls, ``chunk`` positions per output-layer call (None or 0: all), each response
    token weighed by ``token_weight`` (:func:`logprobs.sum_by_sequence`), and with ``token_statistic`` its (2B,) means
    (:func:`logprobs.statistic_means`); None if not right-padded."""
    rows = pack_preference_rows(batch, share_prompt and packed_forward_support(model)[1])
    if rows is None:
        return None
    n = 2 * batch["chosen_input_ids"].shape[0]
    return _packed_logps(model, rows, n, average_log_prob, device, max_chunks, chunk, token_weight, token_statistic)
