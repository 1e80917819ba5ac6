"""Sequence parallelism (``sequence_parallel_size``): each rank of a group holds a slice of every row's positions, so a
pair longer than one device holds can train; DeepSpeed-Ulysses' all-to-all over attention heads (Jacobs et al. 2023).

Why Ulysses and not ring attention (``torch.distributed.tensor.experimental.context_parallel``): PyTorch's context
parallelism supports only causal masks on CUDA SDPA kernels, while our packed rows need a block mask (rejected's rest
must not see chosen's rest) and the tests run on CPU with gloo. Ulysses swaps the sequence split for a head split
before attention (an all-to-all gives each rank all S positions of H/N heads), so attention runs on whole rows with
any mask, and the inverse all-to-all after it; everything else (embeddings, MLPs, norms, the output layer) is local
to each position. It is registered as a transformers attention implementation (:data:`ATTENTION`, wrapping SDPA)
rather than a patch of modeling code; outside a sequence-parallel forward it is plain SDPA (generation). Key/value heads fewer than N (or not divisible by it, GQA) are repeated to the query heads
before the all-to-all. Heads must be divisible by N.

Per row: padded to a multiple of N (the pad is never a target and never seen by a real position), rank r takes
positions [r * L, (r + 1) * L), each with its true position id (RoPE), and the output layer (chunked or not) runs on
its local positions; the per-sequence log-prob sums are summed over the group by a differentiable all-reduce whose
backward is the identity (every rank computes the same loss from the same sums, so each rank's gradient is its own
positions' share, and the shares sum to the one-process gradient). FSDP shards over all ranks (data x sequence), so
its average over them is undone by ``grad_scale`` = world size.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist

import losses
import trainers
import utils
from modeling import logprobs, models
from modeling.packing import PackedRow, output_layer_logps, pack_preference_rows, packed_forward_support
from parallel.dist import Dist
from runs import checks

ATTENTION = "ulysses_sdpa"
"""The attn_implementation name of the Ulysses attention (:func:`ulysses_attention`)."""

_GROUP: list = [None]  # the sequence-parallel process group while a sequence-parallel forward runs, else None
_SUPPORT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> packed_forward_support under SDPA


@contextlib.contextmanager
def active(group):
    """Make :func:`ulysses_attention` exchange heads over ``group`` inside the block."""
    _GROUP[0] = group
    try:
        yield
    finally:
        _GROUP[0] = None


def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    inputs = [t.contiguous() for t in x.chunk(size, dim=scatter_dim)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(size)]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """All-to-all over ``group``: ``scatter_dim`` split into N parts, part j to rank j, received parts joined along
    ``gather_dim`` in rank order; its backward is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


class _SumOverGroup(torch.autograd.Function):
    """The sum of ``x`` over ``group``; backward the identity (each rank backpropagates the same loss of the sum)."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sum_over_group(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` summed over ``group``, differentiable (the gradient of each rank's share is the sum's)."""
    return _SumOverGroup.apply(x, group)


def ulysses_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """SDPA over whole rows from each rank's slice of positions: query (B, H, L, D), key and value (B, H_kv, L, D) ->
    output (B, L, H, D); ``attention_mask`` the whole rows' (B, 1, S, S) bool mask, or None (causal). Plain SDPA
    outside :func:`active`."""
    group = _GROUP[0]
    if group is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    from transformers.integrations.sdpa_attention import repeat_kv

    size = dist.get_world_size(group)
    if key.shape[1] % size:  # GQA with fewer key/value heads than ranks: repeat them to the query heads first
        key, value = repeat_kv(key, query.shape[1] // key.shape[1]), repeat_kv(value, query.shape[1] // value.shape[1])
    query, key, value = (_AllToAll.apply(t, group, 1, 2) for t in (query, key, value))  # (B, H / N, S, D)
    if key.shape[1] != query.shape[1]:  # each rank's query heads use its own key/value heads, in order
        key, value = repeat_kv(key, query.shape[1] // key.shape[1]), repeat_kv(value, query.shape[1] // value.shape[1])
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=attention_mask is None
    )
    out = _AllToAll.apply(out, group, 2, 1)  # (B, H, L, D): this rank's positions of every head
    return out.transpose(1, 2).contiguous(), None


def _mask(**kwargs):
    """The mask transformers builds for :data:`ATTENTION`: none in a sequence-parallel forward (it passes its own or
    is causal), else SDPA's."""
    if _GROUP[0] is not None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(**kwargs)


def register() -> None:
    """Register :data:`ATTENTION` with transformers' attention and mask interfaces."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTENTION, ulysses_attention)
    AttentionMaskInterface.register(ATTENTION, _mask)


def use_sequence_parallel_attention(model) -> None:
    """Switch ``model`` to :data:`ATTENTION` (first noting its packed-forward support under SDPA); ValueError-free:
    a model without the attention interface (no ``_attn_implementation``) is left as it is."""
    register()
    _SUPPORT[model] = packed_forward_support(model)
    model.config._attn_implementation = ATTENTION  # every attention module reads it at each call


def _padded_rows(inputs: dict):
    """The padded forward's rows (S, T) of ``inputs`` (``input_ids``, ``attention_mask``, ``labels``: a DPO batch's
    chosen over rejected, or single sequences): ids, position ids, bool attention (None: causal suffices), and the
    targets' (rows, columns predicting them, labels), sequence = row."""
    ids, mask, labels = inputs["input_ids"], inputs["attention_mask"].bool(), inputs["labels"]
    width = ids.shape[1]
    positions = torch.arange(width).expand_as(ids)  # the padded forward's own (Llama: 0..T-1 whatever the padding)
    right_padded = torch.equal(mask, torch.arange(width) < mask.sum(1, keepdim=True))
    allowed = None
    if not right_padded:  # causal over the kept tokens; each position sees itself (no empty row, no NaN)
        allowed = torch.ones(width, width, dtype=torch.bool).tril() & mask[:, None, :] | torch.eye(width, dtype=torch.bool)
    rows, cols = (labels[:, 1:] != losses.IGNORE_INDEX).nonzero(as_tuple=True)  # column c predicts token c + 1
    return ids, positions, allowed, rows, cols, labels[rows, cols + 1], rows


def _packed_rows(rows: list[PackedRow]):
    """:func:`_padded_rows`' tensors for packed rows (one per pair, the prompt once, or one per sequence)."""
    from modeling.packing import _row_matrix

    width = max(len(r.ids) for r in rows)
    ids = _row_matrix([r.ids for r in rows], width, 0)
    positions = _row_matrix([r.positions if r.positions is not None else list(range(len(r.ids))) for r in rows], width, 0)
    allowed = None  # right padding only: causal suffices
    if any(r.branch is not None for r in rows):  # rejected's rest (2) does not see chosen's rest (1)
        branch = _row_matrix([r.branch if r.branch is not None else [0] * len(r.ids) for r in rows], width, 3)
        allowed = torch.ones(width, width, dtype=torch.bool).tril() & ~((branch[:, :, None] == 2) & (branch[:, None, :] == 1))
    row_idx = torch.tensor([k for k, r in enumerate(rows) for _ in r.target_cols], dtype=torch.long)
    col_idx = torch.tensor([c for r in rows for c in r.target_cols], dtype=torch.long)
    targets = torch.tensor([t for r in rows for t in r.target_ids], dtype=torch.long)
    seqs = torch.tensor([s for r in rows for s in r.target_seqs], dtype=torch.long)
    return ids, positions, allowed, row_idx, col_idx, targets, seqs


def sequence_parallel_logps(
    model,
    batch: dict,
    group,
    device,
    *,
    packed: bool = True,
    average_log_prob: bool = False,
    chunk: int | None = None,
    token_weight=None,
    token_statistic=None,
) -> tuple[torch.Tensor, ...]:
    """``BasicTrainer.concatenated_forward``'s (logps, n_tokens[, statistic means]), each (2B,) float32 chosen first, from
    this rank's slice of every row, summed over ``group`` (differentiably): every rank of the group returns the same.
    Given single sequences, ``forward.single_logps``' (logps, n_tokens), each (B,).

    Args:
        model: a causal LM using :data:`ATTENTION` (:func:`use_sequence_parallel_attention`).
        batch: ``{chosen,rejected}_{input_ids,attention_mask,labels}`` (B, T_c) and (B, T_r); or single sequences
            (SFT targets) ``{input_ids,attention_mask,labels}`` (B, T), each its own causal row.
        group: the sequence-parallel process group (N ranks); ``device``: where the inputs go.
        packed: each pair one row, the prompt once (``modeling.packing``), else the padded rows.
        chunk: positions per output-layer call (None or 0: all at once); token_weight, token_statistic: the
            objective's (``logprobs.sum_by_sequence``, ``logprobs.statistic_means``).
    """
    from preference_datasets import concatenated_inputs

    keep_bool, share = _SUPPORT.get(model, (True, True))
    if "input_ids" in batch:  # single sequences: no pair to pack
        n_sequences, rows, inputs = batch["input_ids"].shape[0], None, batch
    else:
        n_sequences = 2 * batch["chosen_input_ids"].shape[0]
        rows = pack_preference_rows(batch, share) if packed else None
        inputs = None if rows else concatenated_inputs(batch)
    ids, positions, allowed, row_idx, col_idx, targets, seqs = _packed_rows(rows) if rows else _padded_rows(inputs)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    n_rows, width = ids.shape
    local = -(-width // size)  # positions per rank; the rows padded to size * local
    pad = size * local - width
    ids, positions = torch.nn.functional.pad(ids, (0, pad)), torch.nn.functional.pad(positions, (0, pad))
    lo, hi = rank * local, (rank + 1) * local
    kwargs = {"input_ids": ids[:, lo:hi].to(device), "position_ids": positions[:, lo:hi].to(device), "use_cache": False}
    if allowed is not None:  # the whole rows' mask on every rank: attention runs on whole rows; the pad sees itself
        allowed = torch.nn.functional.pad(allowed, (0, pad, 0, pad)) | torch.eye(size * local, dtype=torch.bool)
        kwargs["attention_mask"] = allowed[:, None].to(device)
    mine = (col_idx >= lo) & (col_idx < hi)  # the targets this rank's positions predict
    r, c = row_idx[mine], col_idx[mine] - lo
    if keep_bool:  # logits only where a target is predicted
        keep = torch.zeros(n_rows, local, dtype=torch.bool)
        keep[r, c] = True
        where = (keep.flatten().cumsum(0) - 1)[r * local + c]
        keep_arg, n_positions = keep.to(device), int(keep.sum())
    else:  # every local position's logits
        where, keep_arg, n_positions = r * local + c, 0, n_rows * local
    with active(group):
        out = output_layer_logps(model, kwargs, keep_arg, where, targets[mine], chunk, n_positions, token_statistic)
    token_logps = out if token_statistic is None else out[0]
    seqs = seqs.to(token_logps.device)
    n_tokens = torch.zeros(n_sequences, dtype=torch.float32, device=token_logps.device).index_add(
        0, seqs, torch.ones_like(seqs, dtype=torch.float32)
    )
    local_seqs = seqs[mine.to(seqs.device)]
    if token_weight is not None:  # each token's place among its whole sequence's tokens, wherever it is held
        ranks = logprobs.token_ranks(seqs, n_sequences)[mine.to(seqs.device)]
        token_logps = token_logps * token_weight(ranks, local_seqs, n_tokens).to(token_logps.dtype)
    total = torch.zeros(n_sequences, dtype=torch.promote_types(token_logps.dtype, torch.float32), device=token_logps.device)
    total = sum_over_group(total.index_add(0, local_seqs, token_logps.to(total.dtype)), group)
    logps = total / n_tokens.clamp(min=1.0) if average_log_prob else total
    if token_statistic is None:
        return logps, n_tokens
    statistic = torch.zeros(n_sequences, dtype=torch.float32, device=out[1].device).index_add(0, local_seqs, out[1].float())
    dist.all_reduce(statistic, group=group)
    return logps, n_tokens, statistic / n_tokens.clamp(min=1.0)


# ============================================================================ the trainer and its config rules


class SequenceParallelDist(Dist):
    """:class:`parallel.dist.Dist` over a (dp, sp) mesh: the ranks of an ``sp`` group hold the same pairs (each a slice
    of their positions), and FSDP shards over every rank (``whole``, a 1-D mesh)."""

    def __init__(self, rank: int, world_size: int, mesh, whole):
        super().__init__(rank, world_size, mesh)
        self.whole = whole

    tp_size = 1  # no tensor parallelism beside it (runs/checks.py's rules)

    @property
    def shard_mesh(self):
        return self.whole

    @property
    def sequence_group(self):
        """The process group of the ranks that split this rank's rows."""
        return self.mesh["sp"].get_group()


class SequenceParallelTrainer:
    """Mixed over FSDPTrainer when ``sequence_parallel_size`` > 1: the policy's and the reference's log-probs from each
    rank's slice of every row (:func:`sequence_parallel_logps`), FSDP over all ranks."""

    # chosen and rejected each a causal row: no S x S mask on any rank, so memory per rank falls as 1/N (bench: 8192
    # tokens 705, 358, 180 MiB on 1, 2, 4 ranks); a packed pair (its prompt once) needs a dense S x S block mask on each
    packed = False

    def make_dist(self, config, rank: int, world_size: int) -> Dist:
        """A (dp, sp) mesh of world size / ``sequence_parallel_size`` data-parallel groups, and the whole world for FSDP."""
        from torch.distributed.device_mesh import init_device_mesh

        size = config.sequence_parallel_size
        mesh = init_device_mesh(self.device.type, (world_size // size, size), mesh_dim_names=("dp", "sp"))
        return SequenceParallelDist(rank, world_size, mesh, init_device_mesh(self.device.type, (world_size,)))

    @property
    def grad_scale(self) -> float:
        return float(self.dist.world_size)  # FSDP averages over all ranks; data groups' and positions' shares add up

    def prepare_models(self) -> None:
        """Switch the policy and reference to :data:`ATTENTION` (ConfigError if the group does not divide their heads), then FSDP."""
        for model in (self.policy, self.reference_model):
            if model is not None:
                check_heads(model.config, self.config.sequence_parallel_size)
                use_sequence_parallel_attention(model)
        if self.dist.is_main:
            groups, size = self.dist.data_world_size, self.config.sequence_parallel_size
            print(f"Sequence parallelism: every row split over {size} ranks (Ulysses), {groups} data-parallel group(s).")
        super().prepare_models()

    def concatenated_forward(self, model, batch: dict, token_statistic=None) -> tuple[torch.Tensor, ...]:
        """``BasicTrainer.concatenated_forward``'s values, from this rank's slice of every row."""
        n = batch["chosen_input_ids"].shape[0]
        out = sequence_parallel_logps(
            model, batch, self.dist.sequence_group, self.device, packed=self.packed, average_log_prob=self.average_log_prob,
            chunk=self.output_layer_chunk, token_weight=self.token_weight, token_statistic=token_statistic,
        )  # fmt: skip
        return out[0][:n], out[0][n:], *out[1:]

    def one_side_logps(self, model, rows: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """``BasicTrainer.one_side_logps``' (logps, n_tokens) of single sequences (SFT targets), from this rank's slice of each."""
        inputs = {k: rows[k] for k in ("input_ids", "attention_mask", "labels")}
        args = (model, inputs, self.dist.sequence_group, self.device)
        return sequence_parallel_logps(*args, average_log_prob=self.average_log_prob, chunk=self.output_layer_chunk)


def check_heads(hf_config, size: int) -> None:
    """ConfigError unless ``size`` ranks divide the attention heads of a model with transformers config ``hf_config``."""
    heads = getattr(hf_config, "num_attention_heads", None)
    if heads is not None and heads % size:
        raise utils.ConfigError(
            f"The model's {heads} attention heads cannot be split over sequence_parallel_size={size} ranks; "
            "choose a sequence_parallel_size that divides them."
        )


def _check_model(config, hf_config_of, world_size: int) -> None:
    """models.PARALLEL_MODEL_CHECKS' row: the heads' check before any process starts."""
    if _on(config) and config.trainer == "FSDPTrainer":
        check_heads(hf_config_of(), config.sequence_parallel_size)


def _size(c) -> int:
    return 1 if c.get("sequence_parallel_size") is None else c.sequence_parallel_size  # 0 is refused, not taken as 1


def sequence_parallel_trainer(config, cls: type) -> type:
    """``cls`` with :class:`SequenceParallelTrainer` mixed in when ``sequence_parallel_size`` > 1 (trainers.TRAINER_EXTENSIONS)."""
    return type(f"SequenceParallel{cls.__name__}", (SequenceParallelTrainer, cls), {}) if _size(config) > 1 else cls


def _unsplit(objective) -> str:
    """What ``objective`` computes that the split rows do not."""
    if objective.score_head:
        return "trains a score head"
    if objective.token_weights is not None:
        return "weighs each response token"
    return "trains on unpaired rows" if objective.unpaired else "computes its own per-token inputs"


def _on(c) -> bool:
    return isinstance(_size(c), int) and _size(c) > 1


RULES = [
    ("sequence_parallel_size", lambda c: isinstance(_size(c), int) and not isinstance(_size(c), bool) and _size(c) >= 1,
     "sequence_parallel_size must be a whole number >= 1, got {c.sequence_parallel_size!r}."),
    ("sequence_parallel_size", lambda c: not _on(c) or c.trainer == "FSDPTrainer",
     "sequence_parallel_size > 1 is for trainer=FSDPTrainer (FSDP over data x sequence ranks), not {c.trainer}."),
    ("sequence_parallel_size", lambda c, world_size: None if not _on(c) or not world_size % _size(c) else
     f"sequence_parallel_size ({_size(c)}) must divide the number of processes ({world_size})."),
    ("sequence_parallel_size", lambda c: not _on(c) or (c.get("tensor_parallel_size") or 1) == 1,
     "sequence_parallel_size > 1 does not combine with tensor_parallel_size > 1; choose one of them."),
    ("sequence_parallel_size", lambda c: not _on(c) or not checks.online_enabled(c),
     "sequence_parallel_size > 1 does not work with online DPO (its sampling runs whole sequences); set online.enabled=false."),
    ("sequence_parallel_size", lambda c: not _on(c) or c.get("launcher", "local") == "local",
     "sequence_parallel_size > 1 runs with launcher=local (Ray's reference and policy workers do not split sequences)."),
    ("sequence_parallel_size", lambda c: not _on(c) or not checks.lora_settings(c.model),
     "sequence_parallel_size > 1 is untested with model.lora; set model.lora.r=null or sequence_parallel_size=1."),
    ("sequence_parallel_size", lambda c: not _on(c) or (losses.get_objective(c.loss.name).inputs in (None, losses.sft_inputs)
     and not losses.get_objective(c.loss.name).score_head and losses.get_objective(c.loss.name).token_weights is None),
     lambda c: "sequence_parallel_size > 1 splits the rows of pairs and SFT's targets for their log-probs alone, but "
     f"loss={c.loss.name} {_unsplit(losses.get_objective(c.loss.name))} (untested split); use another loss or "
     "sequence_parallel_size=1."),
    ("sequence_parallel_size", lambda c: not _on(c) or not c.precompute_ref_log_probs,
     "sequence_parallel_size > 1 is untested with precompute_ref_log_probs=true; set it false (the live reference is split "
     "over the group as the policy is)."),
]  # fmt: skip
"""runs/checks.py's rows for ``sequence_parallel_size``, one sentence each."""

checks.RULES.extend(RULES)
trainers.TRAINER_EXTENSIONS.append(sequence_parallel_trainer)
models.PARALLEL_MODEL_CHECKS.append(_check_model)
