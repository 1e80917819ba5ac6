"""The packed DPO forward: no padding computed, each prompt forwarded once per pair.

Each pair becomes one row: the shared prefix (the prompt, and any first response tokens both
sides share), then the rest of chosen, then the rest of rejected, which attends to the prefix but
not to chosen (a 4-D attention mask, position ids continuing from the prefix on both sides). Rows
are grouped by length into a few forward calls, each padded only to its own longest row, and the
output layer runs only at positions that predict a labelled token. The log-probs equal those of
each sequence forwarded alone (tests/test_packed.py); ``BasicTrainer.concatenated_forward`` and
the reference precompute use it, and fall back to the padded forward when it does not apply.

The output layer itself runs in chunks of ``output_layer_chunk`` positions
(:func:`output_layer_logps`): each chunk's ``[positions, vocab]`` logits exist only while its
log-probs are taken, and the backward recomputes them, so no tensor of the size of the whole
batch's logits is ever held.
"""

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


def _unpadded(ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> list[tuple[list[int], list[int]]] | None:
    """Each row's (ids, labels) without its right padding; None when a row is not right-padded
    or has a label under attention mask 0."""
    lengths = mask.sum(1)
    expected = torch.arange(mask.shape[1], device=mask.device) < lengths[:, None]
    if not torch.equal(mask.bool(), expected) or bool((labels[~expected] != losses.IGNORE_INDEX).any()):
        return None
    return [(i[:length], lab[:length]) for i, lab, length in zip(ids.tolist(), labels.tolist(), lengths.tolist())]


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
    sides = [
        _unpadded(*(batch[f"{side}_{k}"] for k in ("input_ids", "attention_mask", "labels"))) for side in ("chosen", "rejected")
    ]
    if None in sides:
        return None
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
    passes through unchanged for SDPA and eager attention, and no sliding window. A peft
    model is judged by the model it wraps (``get_base_model()``), to which it passes these
    arguments through.
    """
    if hasattr(model, "get_base_model"):  # peft's PeftModel: forward(*args, **kwargs)
        model = model.get_base_model()
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


DEFAULT_OUTPUT_LAYER_CHUNK = 1024
"""``output_layer_chunk``'s default: positions per chunk of the output layer. At SmolLM2's
49,152-entry vocabulary one chunk's float32 logits are 0.2 GB (and the backward's few
temporaries of that size), against 1.6 GB for all 8,000 labelled positions of a DPO batch of
8 pairs at 512 tokens."""

LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config attributes of families that change the logits after the output layer (Gemma 2-4's
soft-capping, Cohere's scale, Granite's divisor): their log-probs take the unchunked path."""

_UNCHUNKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> why it takes the unchunked path


def _logit_transform(model) -> str | None:
    """The first of :data:`LOGIT_TRANSFORMS` set in ``model``'s config (or its text config), as
    ``"name=value"``; None when there is none."""
    config = getattr(model, "config", None)
    configs = [config]
    if hasattr(config, "get_text_config"):
        configs.append(config.get_text_config())
    for cfg in configs:
        for name in LOGIT_TRANSFORMS:
            value = getattr(cfg, name, None)
            if value is not None:
                return f"{name}={value}"
    return None


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
    """Stands in for a causal LM's output layer (``get_output_embeddings()``) during one forward
    call and returns, instead of logits, the log-prob of each target token.

    It calls the original output layer on ``chunk`` distinct positions at a time, each call
    inside ``torch.utils.checkpoint`` (non-reentrant) when gradients are on, so a chunk's
    ``[chunk, vocab]`` logits live only while its log-probs are taken and are recomputed by the
    backward. The original layer is called from inside the model's own forward, so FSDP2's
    unsharded parameters, accelerate's device hooks and tied weights are all as they are for
    the plain call. A position that predicts several targets (a shared prompt's last one) goes
    through the layer once.

    Args:
        head: the model's output layer (maps (..., H) to (..., V)).
        rows: (N,) long, for each target the index of the position that predicts it among the
            hidden states the layer receives, flattened to (M, H) in row-major order.
        targets: (N,) long token ids.
        chunk: at most this many positions per call of ``head`` (>= 1).
        n_positions: M, checked against what the layer receives (None: not checked).

    Attributes:
        result: the (N,) float32 log-probs of the last call (None before it).
    """

    def __init__(self, head, rows: torch.Tensor, targets: torch.Tensor, chunk: int, n_positions: int | None = None):
        super().__init__()
        self.head = head
        self.rows, self.targets, self.chunk, self.n_positions = rows.cpu(), targets.cpu(), int(chunk), n_positions
        self.result = None

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:  # e.g. ``.weight``, read by a model's own code: the head's
            return getattr(super().__getattr__("head"), name)

    def _chunk_logps(self, hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)  # (c, V); the head may move it to its own device
        return losses.gathered_token_logps(logits, rows.to(logits.device), targets.to(logits.device))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N,) float32 log-probs of the targets, in the order given, from ``hidden`` (..., H).

        Raises:
            RuntimeError: if ``hidden`` holds other than ``n_positions`` positions (the model
                ignored ``logits_to_keep``).
        """
        flat = hidden.reshape(-1, hidden.shape[-1])
        if self.n_positions is not None and flat.shape[0] != self.n_positions:
            raise RuntimeError(
                f"The output layer got {flat.shape[0]} positions, not the {self.n_positions} asked for by logits_to_keep."
            )
        positions, inverse = torch.unique(self.rows, sorted=True, return_inverse=True)
        order = torch.argsort(inverse, stable=True)  # targets grouped by position, positions ascending
        local, targets = inverse[order], self.targets[order]
        bounds = torch.searchsorted(local, torch.arange(0, len(positions) + self.chunk, self.chunk)).tolist()
        parts = []
        for k, lo in enumerate(range(0, max(len(positions), 1), self.chunk)):  # no target: one empty call keeps the graph
            hi = min(lo + self.chunk, len(positions))
            a, b = bounds[k], bounds[k + 1]
            args = (flat[positions[lo:hi].to(flat.device)], local[a:b] - lo, targets[a:b])
            if torch.is_grad_enabled():
                parts.append(torch.utils.checkpoint.checkpoint(self._chunk_logps, *args, use_reentrant=False))
            else:
                parts.append(self._chunk_logps(*args))
        sorted_logps = torch.cat(parts)
        self.result = sorted_logps[torch.argsort(order).to(sorted_logps.device)]
        return self.result


def _parent_of(model: torch.nn.Module, module: torch.nn.Module) -> tuple[torch.nn.Module, str] | None:
    """(parent, attribute name) under which ``model`` holds the submodule ``module``."""
    for parent in model.modules():
        for name, child in parent.named_children():
            if child is module:
                return parent, name
    return None


def output_layer_logps(
    model,
    kwargs: dict,
    logits_to_keep,
    rows: torch.Tensor,
    targets: torch.Tensor,
    chunk: int | None = DEFAULT_OUTPUT_LAYER_CHUNK,
    n_positions: int | None = None,
) -> torch.Tensor:
    """One forward call of ``model`` and the log-prob of each target token, never holding the
    logits of all kept positions at once when ``chunk`` is set.

    With ``chunk``, the model's output layer is replaced for this call by a
    :class:`ChunkedOutputLayer` (restored afterwards, also when the forward raises). A model
    whose own forward changes the logits after its output layer (see :data:`LOGIT_TRANSFORMS`;
    detected also when the returned ``logits`` is not the stand-in's output) or that has no
    ``get_output_embeddings()`` module takes the unchunked path, with a one-line note the first
    time.

    Args:
        model: a Hugging Face causal LM (plain, FSDP2- or tensor-parallel-wrapped, or split
            over GPUs by ``device_map``).
        kwargs: the forward's arguments (``input_ids``, masks, ...) without ``logits_to_keep``.
        logits_to_keep: passed to the forward: an int (the last positions of each row) or a
            2-D bool mask (exactly the positions kept, flattened row-major).
        rows: (N,) long, for each target the row of the kept positions, flattened to (M, V)
            in row-major order, that predicts it.
        targets: (N,) long token ids.
        chunk: positions per call of the output layer; None or 0: one call over all kept
            positions (the previous path).
        n_positions: M, the number of kept positions; checked when given.

    Returns:
        (N,) float32 log-probs in nats, on the device of the output layer's output.

    Raises:
        RuntimeError: if the model ignored ``logits_to_keep`` (other than ``n_positions`` kept).
    """
    prefer_masked_gqa(kwargs["input_ids"].device)
    place = None
    if chunk and model not in _UNCHUNKED:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        place = _parent_of(model, head) if isinstance(head, torch.nn.Module) else None
        if place is None:
            _refuse_chunking(model, "has no output layer module (get_output_embeddings) to call in chunks")
    if place is not None:
        reason = _logit_transform(model)
        if reason is not None:
            _refuse_chunking(model, f"changes its logits after the output layer ({reason})")
            place = None
    if place is not None:
        parent, name = place
        stand_in = ChunkedOutputLayer(head, rows, targets, chunk, n_positions)
        setattr(parent, name, stand_in)
        try:
            out = model(**kwargs, logits_to_keep=logits_to_keep)
        finally:
            setattr(parent, name, head)
        if stand_in.result is not None and out.logits is stand_in.result:
            return stand_in.result
        _refuse_chunking(model, "does not return its output layer's output as its logits")
    logits = model(**kwargs, logits_to_keep=logits_to_keep).logits
    flat = logits.reshape(-1, logits.shape[-1])
    if n_positions is not None and flat.shape[0] != n_positions:
        raise RuntimeError(
            f"{type(model).__name__} ignored logits_to_keep (logits {tuple(logits.shape)}, not {n_positions} positions)."
        )
    return losses.gathered_token_logps(flat, rows.to(flat.device), targets.to(flat.device))


def compute_dtype(model) -> torch.dtype:
    """The dtype ``model`` computes in: FSDP2's mixed-precision ``param_dtype`` when one is set
    (its parameters stay float32 outside the forward), else its parameters' dtype."""
    get_state = getattr(model, "_get_fsdp_state", None)  # FSDP2's FSDPModule
    if get_state is not None:
        dtype = getattr(getattr(get_state(), "_mp_policy", None), "param_dtype", None)
        if dtype is not None:
            return dtype
    return next(model.parameters()).dtype


GQA_SWITCH = "TRANSFORMERS_SDPA_FORCE_GQA"


def prefer_masked_gqa(device) -> None:
    """On the CPU, let transformers' SDPA attention hand grouped key/value heads to PyTorch with
    a mask (``enable_gqa``; PyTorch's CPU flash kernel takes both) instead of first repeating
    them for every query head, which keeps keys and values as large as the queries in every
    layer for the backward. transformers reads ``TRANSFORMERS_SDPA_FORCE_GQA`` at each call; it
    is set for the rest of the process (an activation-checkpointed layer's recompute in the
    backward must take the path its forward took), and never on a GPU, whose kernels fall back
    to the math path for masked GQA, nor over a value the user set."""
    if torch.device(device).type == "cpu":
        os.environ.setdefault(GQA_SWITCH, "1")


def _row_matrix(values: list[list[int]], width: int, fill: int) -> torch.Tensor:
    return torch.tensor([v + [fill] * (width - len(v)) for v in values], dtype=torch.long)


def _packed_chunk_logps(
    model, rows: list[PackedRow], device, keep_bool: bool, chunk: int | None = DEFAULT_OUTPUT_LAYER_CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward call over ``rows``, padded to the longest of them: (per-target log-probs
    (N,) float32, their sequence ids (N,) long), targets in row order; the output layer in
    chunks of ``chunk`` positions (:func:`output_layer_logps`)."""
    width = max(len(r.ids) for r in rows)
    kwargs = {"input_ids": _row_matrix([r.ids for r in rows], width, 0).to(device), "use_cache": False}
    if any(r.branch is not None for r in rows):
        positions = [r.positions if r.positions is not None else list(range(len(r.ids))) for r in rows]
        branch = _row_matrix([r.branch if r.branch is not None else [0] * len(r.ids) for r in rows], width, 3)
        # causal, except that rejected's rest (2) does not see chosen's rest (1); padding (3)
        # sees what precedes it, so no row is empty (no NaN), and nothing real sees padding.
        # Additive (0 / dtype min) in the compute dtype, built once per call: create_causal_mask
        # passes a 4-D mask through to every layer, and SDPA would turn a boolean one into such
        # a float copy in every layer, each kept for the backward.
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
    token_logps = output_layer_logps(model, kwargs, keep_arg, where, targets, chunk, n_positions)
    return token_logps.to(device), seqs  # a split model's log-probs come from its last GPU


def _packed_logps(
    model, rows: list[PackedRow], n_sequences: int, average_log_prob: bool, device, max_chunks, chunk
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence (logps, n_tokens), each (n_sequences,) float32, of packed ``rows`` forwarded
    in the groups of :func:`plan_chunks`, all in one autograd graph."""
    parts = [
        _packed_chunk_logps(model, [rows[k] for k in group], device, packed_forward_support(model)[0], chunk)
        for group in plan_chunks([len(r.ids) for r in rows], max_chunks)
    ]
    token_logps = torch.cat([p[0] for p in parts])
    seqs = torch.cat([p[1] for p in parts])
    return losses.sum_by_sequence(token_logps, seqs, n_sequences, average_log_prob)


def pack_single_rows(inputs: dict) -> list[PackedRow] | None:
    """The rows of a packed forward for single sequences (SFT targets, KTO completions): each
    sequence one row without its padding.

    Args:
        inputs: ``input_ids``, ``attention_mask``, ``labels``, each (B, T), right-padded.

    Returns:
        B rows (sequence k's targets carry id k), or None when a sequence is not right-padded
        or has a label under attention mask 0 (the caller then takes the padded forward).
    """
    sequences = _unpadded(inputs["input_ids"], inputs["attention_mask"], inputs["labels"])
    if sequences is None:
        return None
    return [PackedRow(ids, None, None, *_targets(labels, k, lambda p: p)) for k, (ids, labels) in enumerate(sequences)]


def packed_single_logps(
    model,
    inputs: dict,
    average_log_prob: bool,
    device,
    max_chunks: int | None = None,
    chunk: int | None = DEFAULT_OUTPUT_LAYER_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Log-probs of single right-padded sequences (:func:`pack_single_rows`) without computing
    their padding; the same values as ``losses.get_batch_logps`` over the padded forward.

    Args:
        model: a Hugging Face causal LM (plain, FSDP- or tensor-parallel-wrapped).
        inputs: ``input_ids``, ``attention_mask``, ``labels``, each (B, T).
        average_log_prob: mean per labelled token instead of the sum.
        device: where the model's inputs go.
        max_chunks: at most this many forward calls (1 under FSDP).
        chunk: positions per call of the output layer (:func:`output_layer_logps`).

    Returns:
        (logps, n_tokens), each (B,) float32; None when a sequence is not right-padded.
    """
    rows = pack_single_rows(inputs)
    if rows is None:
        return None
    return _packed_logps(model, rows, len(rows), average_log_prob, device, max_chunks, chunk)


def packed_sequence_logps(
    model,
    batch: dict,
    average_log_prob: bool,
    device,
    max_chunks: int | None = None,
    share_prompt: bool = True,
    chunk: int | None = DEFAULT_OUTPUT_LAYER_CHUNK,
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
        chunk: positions per call of the output layer (:func:`output_layer_logps`; None or 0:
            all of a forward call's at once).

    Returns:
        (logps, n_tokens), each (2B,) float32, chosen rows first, as ``losses.get_batch_logps``
        over ``concatenated_inputs``; None when the batch is not right-padded (see
        :func:`pack_preference_rows`).
    """
    _, can_share = packed_forward_support(model)
    rows = pack_preference_rows(batch, share_prompt and can_share)
    if rows is None:
        return None
    return _packed_logps(model, rows, 2 * batch["chosen_input_ids"].shape[0], average_log_prob, device, max_chunks, chunk)
