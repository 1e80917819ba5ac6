"""The padded forward a reader learns from: a causal LM's logits from the first response token on, the responses'
log-probs summed per sequence (the output layer all at once or a chunk of positions at a time), and single sequences
(SFT targets, KTO completions) packed or padded."""

from __future__ import annotations

import torch

import losses
from modeling import logprobs
from modeling.packing import DEFAULT_OUTPUT_LAYER_CHUNK, output_layer_logps, packed_single_logps
from preference_datasets import stacked_model_inputs


def _kept_positions(labels: torch.Tensor) -> int:
    """K, the last positions of each (B, T) row that the padded forward keeps logits for: from
    the one before the batch's first labelled token on."""
    length = labels.shape[1]
    labelled = (labels != losses.IGNORE_INDEX).any(0)
    first = int(labelled.float().argmax()) if labelled.any() else length - 1
    return length - max(first - 1, 0)


def model_kwargs(inputs: dict) -> dict:
    """What ``model`` takes of ``inputs``: the ids, the mask and any other inputs beside them (e.g. pixel values)."""
    return {k: v for k, v in inputs.items() if k != "labels"}


def response_logits(model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (B, K, V) from the position before the batch's first response token on
    (``logits_to_keep``), and the labels (B, K) aligned with them; inputs (B, T) right-padded, K <= T."""
    labels = inputs["labels"]
    keep = _kept_positions(labels)  # the output layer (B x T x V) skips the prompts
    logits = model(**model_kwargs(inputs), logits_to_keep=keep).logits
    # a split model's logits may end on another GPU
    return logits, labels[:, labels.shape[1] - logits.shape[1] :].to(logits.device)


def response_logps(
    model,
    inputs: dict,
    average_log_prob: bool = False,
    chunk: int | None = DEFAULT_OUTPUT_LAYER_CHUNK,
    token_weight=None,
    token_statistic=None,
) -> tuple[torch.Tensor, ...]:
    """(logps, n_tokens), each (B,) float32 on the model's output device: ``logprobs.get_batch_logps`` of the padded
    forward of inputs (B, T) padded on either side, the output layer ``chunk`` predicted positions at a time
    (``packing.output_layer_logps``; None or 0: all at once), each token weighed by ``token_weight`` if given, and with
    ``token_statistic`` its (B,) means (``logprobs.statistic_means``)."""
    if not chunk:
        logits, labels = response_logits(model, inputs)
        return logprobs.get_batch_logps(logits, labels, average_log_prob, token_weight, token_statistic)
    labels = inputs["labels"]
    n, length = labels.shape
    keep = _kept_positions(labels)
    predicted = labels[:, 1:].cpu()
    seqs, cols = (predicted != losses.IGNORE_INDEX).nonzero(as_tuple=True)  # column cols predicts token cols + 1
    rows = seqs * keep + cols - (length - keep)
    out = output_layer_logps(model, model_kwargs(inputs), keep, rows, predicted[seqs, cols], chunk, n * keep, token_statistic)
    token_logps = out if token_statistic is None else out[0]
    sums = logprobs.sum_by_sequence(token_logps, seqs.to(token_logps.device), n, average_log_prob, token_weight)
    return sums if token_statistic is None else (*sums, logprobs.statistic_means(out[1], seqs.to(out[1].device), n))


def single_logps(
    model,
    rows: dict,
    average_log_prob: bool,
    device,
    max_forward_chunks: int | None = None,
    output_layer_chunk: int | None = DEFAULT_OUTPUT_LAYER_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logps, n_tokens), each (B,), of single sequences ``rows`` (B, T) (SFT targets, KTO completions), packed
    without padding (:func:`packed_single_logps`), or padded (:func:`response_logps`) when not right-padded."""
    if "model_inputs" not in rows:  # images: padded, each row's own (packing would join rows and their images)
        packed = packed_single_logps(model, rows, average_log_prob, device, max_forward_chunks, output_layer_chunk)
        if packed is not None:
            return packed
    inputs = {k: v.to(device) for k, v in rows.items() if k != "model_inputs"}
    inputs |= {k: v.to(device) for k, v in stacked_model_inputs(rows.get("model_inputs") or []).items()}
    logps, n_tokens = response_logps(model, inputs, average_log_prob, output_layer_chunk)
    return logps.to(device), n_tokens.to(device)
