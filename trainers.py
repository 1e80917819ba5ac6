"""The training loop: BasicTrainer (one process) and its FSDP and tensor-parallel subclasses, computing what the
objective of ``config.loss.name`` (losses.py) declares, the reference's side through :meth:`BasicTrainer.reference_logps`."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import torch
import tqdm

import losses
import utils
from modeling import logprobs, models
from modeling.packing import DEFAULT_OUTPUT_LAYER_CHUNK, output_layer_logps, packed_sequence_logps, packed_single_logps
from parallel.fsdp import find_block_classes, fully_shard_blocks
from parallel.tensor_parallel import _gpt2_state_to_conv1d, tensor_parallel_plan
from preference_datasets import concatenated_inputs, get_batch_iterator, stop_token_ids
from runs import checkpoints, checks, tracking
from runs.resume import numpy_rng_state, read_checkpoint_file, read_sharded_checkpoint, set_numpy_rng_state

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2") if hasattr(signal, name))
"""The signals on which :meth:`BasicTrainer.train` saves a checkpoint and stops (SIGUSR1, SIGUSR2: SLURM's
``--signal=USR1@<seconds>``, submitit's USR2; absent on Windows); train.py then exits with 128 + the signal."""


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """Learning-rate multiplier for optimizer step ``step`` (0-based): linear warmup
    ``min(1, (step + 1) / (warmup_steps + 1))``, then ``constant``, or ``linear`` / ``cosine`` decay to 0 at ``total_steps``."""
    warm = min(1.0, (step + 1) / (warmup_steps + 1))  # step 0 already moves the weights
    if schedule == "constant" or step < warmup_steps:
        return warm
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return warm * (1.0 - progress)
    return warm * 0.5 * (1.0 + math.cos(math.pi * progress))


def beta_for_epoch(beta, epoch: int) -> float:
    """``loss.beta`` in ``epoch`` (0-based): a number, or a list with one value per epoch whose
    last value repeats (TRL's OnlineDPOConfig ``beta`` list has the same meaning)."""
    if isinstance(beta, (int, float)):
        return float(beta)
    values = list(beta)
    return float(values[min(epoch, len(values) - 1)])


class NonFiniteLossError(RuntimeError):
    """The loss or gradient became NaN or inf; the message names the step."""


class RunStoppedError(RuntimeError):
    """A trainer that extends BasicTrainer stopped the run after a checkpoint (online DPO: its judge failed too often);
    the message names the checkpoint kept."""


def _kept_positions(labels: torch.Tensor) -> int:
    """K, the last positions of each (B, T) row that the padded forward keeps logits for: from
    the one before the batch's first labelled token on."""
    length = labels.shape[1]
    labelled = (labels != losses.IGNORE_INDEX).any(0)
    first = int(labelled.float().argmax()) if labelled.any() else length - 1
    return length - max(first - 1, 0)


def response_logits(model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (B, K, V) from the position before the batch's first response token on
    (``logits_to_keep``), and the labels (B, K) aligned with them; inputs (B, T) right-padded, K <= T."""
    labels = inputs["labels"]
    keep = _kept_positions(labels)  # the output layer (B x T x V) skips the prompts
    logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], logits_to_keep=keep).logits
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
    kwargs = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
    out = output_layer_logps(model, kwargs, keep, rows, predicted[seqs, cols], chunk, n * keep, token_statistic)
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
    packed = packed_single_logps(model, rows, average_log_prob, device, max_forward_chunks, output_layer_chunk)
    if packed is not None:
        return packed
    inputs = {k: v.to(device) for k, v in rows.items()}
    logps, n_tokens = response_logps(model, inputs, average_log_prob, output_layer_chunk)
    return logps.to(device), n_tokens.to(device)


def split_batch(batch: dict, n_chunks: int) -> list[dict]:
    """Split a batch into ``n_chunks`` micro-batches along dim 0 (sizes differ by at most one;
    nothing is dropped). Lists are split the same way as tensors."""
    size = len(batch["prompt"])
    bounds = np.linspace(0, size, n_chunks + 1).round().astype(int)
    chunks = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi > lo:
            chunks.append({k: v[lo:hi] for k, v in batch.items()})
    return chunks


def concatenated_per_rank(metrics: dict, group=None) -> dict:
    """Every rank's metric lists (of ``group``, default all), concatenated in rank order."""
    out: dict = defaultdict(list)
    for part in utils.all_gather_object(dict(metrics), group=group):
        for k, v in part.items():
            out[k].extend(v)
    return out


def parameter_groups(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``params`` in lists of one kind each: plain tensors, and DTensors by device mesh, in order of first
    appearance (the same on every rank); one list when all are of one kind (or there are none)."""
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for p in params:
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return list(groups.values()) or [[]]  # torch's foreach kernels refuse a mix of kinds


class Dist:
    """The processes a trainer runs on and their collectives: each returns its input on one process (``mesh`` None) and
    runs over the (dp, tp) device mesh's groups otherwise (tensor-parallel peers hold the same data)."""

    def __init__(self, rank: int = 0, world_size: int = 1, mesh=None):
        self.rank, self.world_size, self.mesh = rank, world_size, mesh

    @property
    def data_rank(self) -> int:
        """Which part of each batch this process takes: its place along the mesh's data-parallel dimension."""
        return self.rank if self.mesh is None else self.mesh["dp"].get_local_rank()  # tensor-parallel peers share it

    @property
    def data_world_size(self) -> int:
        """Into how many parts each batch is split: world size / tensor-parallel size."""
        return self.world_size if self.mesh is None else self.mesh["dp"].size()

    @property
    def is_main(self) -> bool:
        """True on the process that logs, prints and writes the run folder's files."""
        return self.rank == 0

    @property
    def data_group(self):
        """The data-parallel process group (None: every process, or one process)."""
        return None if self.mesh is None else self.mesh["dp"].get_group()

    def all_reduce(self, value: float, op: str, group=None) -> float:
        """``value`` reduced by ``torch.distributed.ReduceOp.<op>`` over ``group`` (default all processes), a float."""
        if self.mesh is None:
            return value
        import torch.distributed as dist

        t = torch.tensor([float(value)], dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group)
        return t.item()

    def global_sum(self, value: float) -> float:
        """Sum of ``value`` over the data-parallel groups (tensor-parallel peers hold the same value)."""
        return self.all_reduce(value, "SUM", group=self.data_group)

    def gather_metrics(self, metrics: dict) -> dict:
        """Per-example metric lists of every data-parallel group, concatenated in order (tensor-parallel peers computed the same)."""
        return self.gather_per_rank(metrics, group=self.data_group)

    def gather_per_rank(self, metrics: dict, group=None) -> dict:
        """Every rank's lists (of ``group``, default all), concatenated in rank order, even when all processes see
        the same data (tensor parallelism): for per-process figures such as peak memory."""
        return metrics if self.mesh is None else concatenated_per_rank(metrics, group)

    def broadcast(self, obj):
        """``obj`` as the main process has it, on every process."""
        return obj if self.mesh is None else utils.broadcast_object(obj)

    def all_finite(self, value: torch.Tensor) -> bool:
        """True if ``value`` is finite on every process (all agree, so none hangs alone)."""
        return self.all_reduce(float(torch.isfinite(value).all()), "MIN") == 1.0

    def any_rank(self, flag: bool) -> bool:
        """True if ``flag`` is true on any process (a stop request reaches all ranks together)."""
        return self.all_reduce(float(flag), "MAX") == 1.0

    def wait_for_all(self) -> None:
        """Return once every process has got here."""
        if self.mesh is not None:
            import torch.distributed as dist

            dist.barrier()  # at the end: gloo frees collective tensors before interpreter exit, which would abort


class BasicTrainer:
    """Train ``policy`` on ``preference_datasets.load_examples`` examples with ``config.loss`` on one process;
    a ``peft.PeftModel`` policy trains its adapters and is its own reference with them off, else
    ``reference_model`` is the frozen reference (None when the objective needs none)."""

    def __init__(
        self,
        policy,
        config,
        run_dir,
        tokenizer,
        train_examples,
        eval_examples,
        reference_model=None,
        logger=None,
        *,
        reference_cache: dict | None = None,
        data_fingerprint: dict | None = None,
    ):
        """The loop over ``train_examples`` for ``policy`` against ``reference_model`` (or the precomputed
        ``reference_cache``), evaluating on ``eval_examples`` and checkpointing into ``run_dir``."""
        self.config = config
        self.dist = Dist(self.rank, self.world_size, self.mesh)  # one process here; a parallel trainer set its mesh first
        self.reference_cache = reference_cache  # example key -> (chosen, rejected) reference log-probs, or None
        self.data_fingerprint = data_fingerprint  # {split: examples_fingerprint}, kept in each checkpoint for resume
        self.run_dir = run_dir
        self.tokenizer = tokenizer
        self.stop_ids = stop_token_ids(tokenizer)  # EOS and the chat template's end-of-turn token: generation stops at either
        # LoRA: the PeftModel switches the adapters off (the reference); self.policy is the network
        # holding them, called, sharded and saved as a plain Hugging Face model
        self.peft_model = policy if models.is_lora_model(policy) else None
        self.policy = policy.get_base_model() if self.peft_model is not None else policy
        self.lora = checks.lora_settings(config.model) if self.peft_model is not None else None
        if self.peft_model is not None and reference_model is not None:
            raise ValueError("A LoRA policy is its own reference (adapters off); pass no reference_model.")
        self.reference_model = reference_model
        self.logger = logger or tracking.MetricsLogger(run_dir, config)
        self.train_examples = train_examples
        self.loss_config = config.loss
        self.objective = losses.get_objective(config.loss.name)  # what to compute; the trainer names no objective
        self.average_log_prob = self.objective.averages(config.loss)
        weights = self.objective.token_weights
        self.token_weight = weights(config.loss) if weights is not None else None  # each response token's, in the pairs' sums
        self.uses_reference = self.objective.uses_reference(config.loss)
        self.uses_nll = self.objective.uses_nll(config.loss)
        self.setup_models()
        self.setup_peak_rss_mib = tracking.peak_rss_mib()  # loading and sharding, before any step

        self.optimizer = self.build_optimizer()
        self.total_examples = config.n_examples or config.n_epochs * len(train_examples)
        n_steps = math.ceil(self.total_examples / config.batch_size)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_multiplier(step, config.warmup_steps, n_steps, config.lr_scheduler)
        )
        self.eval_batches = self.batches_for_eval(eval_examples)
        self.example_counter = 0
        self.batch_counter = 0
        self.next_eval_at = 0 if config.do_first_eval else config.eval_every
        self.stop_requested = False
        self.stop_signal: int | None = None

    def batches_for_eval(self, eval_examples: list[dict]) -> list[dict]:
        """The eval set's batches, once: the first ``n_eval_examples`` of ``eval_examples`` in a seeded order."""
        c = self.config
        n_eval = min(c.n_eval_examples or len(eval_examples), len(eval_examples))
        batches = get_batch_iterator(
            eval_examples, self.tokenizer, c.eval_batch_size, c.max_length, c.max_prompt_length, seed=c.seed, n_examples=n_eval
        )
        return list(batches)  # shuffled (the iterator's default), the same at every eval

    def setup_models(self) -> None:
        """Freeze the reference, turn on ``activation_checkpointing``, note the trainable weights (LoRA: the adapters'), then
        place the models (:meth:`prepare_models`; a parallel trainer shards them)."""
        if self.reference_model is not None:
            self.reference_model.eval()
            self.reference_model.requires_grad_(False)
        if self.config.activation_checkpointing:  # non-reentrant: LoRA's gradients flow although the frozen inputs need none
            enable = getattr(self.policy, "activation_checkpointing_enable", None)  # transformers >= 5.24's name
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.trainable_names = {n for n, p in self.policy.named_parameters() if p.requires_grad}
        self.prepare_models()

    # ------------------------------------------------------------------ setup and what a parallel trainer overrides
    # (the collectives are self.dist's)

    rank = 0
    world_size = 1
    tp_size = 1  # over how many processes each weight matrix is split (the mesh's ``tp`` dimension)
    mesh = None  # a parallel trainer's (dp, tp) torch.distributed DeviceMesh
    grad_scale = 1.0  # FSDP averages gradients over ranks; the loss is scaled to undo it

    def prepare_models(self) -> None:
        """Move the policy and reference to this process's device, except a model split by ``model.device_map``
        (``hf_device_map``); ``self.device``, where inputs go, is that of the policy's first parameter."""
        device = "cuda" if torch.cuda.is_available() else "cpu"
        for model in (self.policy, self.reference_model):
            if model is not None and getattr(model, "hf_device_map", None) is None:
                model.to(device)
        self.device = next(self.policy.parameters()).device

    def reshard_reference(self) -> None:
        """Free the reference's gathered weights after a forward (FSDP2 keeps a root module's gathered for a
        backward that a no-grad reference never runs)."""
        if self.mesh is None or self.reference_model is None:
            return
        from torch.distributed.fsdp import FSDPModule

        for module in self.reference_model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def local_batch(self, batch: dict) -> tuple[dict, float]:
        """This process's part of a global batch, and the weight of its loss (1, or 0 for a
        stand-in part when a final batch has fewer examples than processes)."""
        return batch, 1.0

    def set_grad_sync(self, enabled: bool) -> None:
        """Whether the next backward synchronises gradients across processes."""

    def clip_gradients(self) -> torch.Tensor:
        """Clip the policy's gradients to ``max_grad_norm`` by their global L2 norm and return that norm."""
        grads = [p.grad for p in self.policy.parameters() if p.grad is not None]
        if self.mesh is None or (self.tp_size == 1 and len(parameter_groups(grads)) == 1):
            norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.config.max_grad_norm)
            return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a DTensor under FSDP
        return self.clip_mixed_gradients(grads)

    def clip_mixed_gradients(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Clip ``grads`` of several meshes, or DTensors beside plain tensors, by their global L2 norm summed one by one
        (torch's foreach norm refuses them)."""
        total_sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for g in grads:
            n = torch.linalg.vector_norm(g, 2, dtype=torch.float32)
            total_sq += (n.full_tensor() if hasattr(n, "full_tensor") else n) ** 2
        total = total_sq.sqrt()
        coef = min(1.0, self.config.max_grad_norm / (total.item() + 1e-6))
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return total

    def generate_kwargs(self) -> dict:
        """Extra ``generate`` arguments (FSDP keeps all ranks stepping until all are done)."""
        return {}

    def build_optimizer(self) -> torch.optim.Optimizer:
        """``config.optimizer`` over the policy's trainable parameters (AdamW, Adam, SGD: ``config.weight_decay``;
        ``optimizer_foreach`` null: torch's default), one param group per :func:`parameter_groups` group."""
        params = [p for p in self.policy.parameters() if p.requires_grad]
        cls = getattr(torch.optim, self.config.optimizer)
        kwargs = {"lr": self.config.lr}
        if self.config.optimizer in ("AdamW", "Adam", "SGD"):
            kwargs["weight_decay"] = self.config.weight_decay
        if self.config.optimizer_foreach is not None:
            kwargs["foreach"] = bool(self.config.optimizer_foreach)
        groups = parameter_groups(params)
        # foreach kernels take one group's tensors at once
        return cls(params if len(groups) == 1 else [{"params": group} for group in groups], **kwargs)

    # ------------------------------------------------------------------ log-probs and loss

    max_forward_chunks: int | None = None
    """At most this many forward calls per ``concatenated_forward`` (None: as many as pay off)."""

    @property
    def output_layer_chunk(self) -> int | None:
        """``config.output_layer_chunk``: positions per call of the output layer wherever
        log-probs are taken (``packing.output_layer_logps``); None or 0: all at once."""
        return self.config.output_layer_chunk

    packed = True  # pairs go through modeling/packing.py's forward: the padded one's numbers, without its padding

    def concatenated_forward(self, model, batch: dict, token_statistic: Callable | None = None) -> tuple[torch.Tensor, ...]:
        """``model``'s log-probs of B pairs' chosen and rejected responses, summed (or averaged) over response tokens, in
        one forward call of chosen stacked over rejected (the reference repository's).

        Args:
            model: a causal LM (the policy, or the reference under no_grad).
            batch: ``{chosen,rejected}_{input_ids,attention_mask,labels}``, (B, T_c) and (B, T_r), right-padded;
                labels are -100 outside the responses.
            token_statistic: an objective's quantity per response token from the logits, without gradient
                (``(logits (M, V), rows (N,), targets (N,)) -> (N,)``, WPO's log weight); None: none is computed.

        Returns:
            chosen_logps (B,), rejected_logps (B,), n_tokens (2B,): float32, response tokens, chosen first; with
            ``token_statistic``, also its means per response (2B,), chosen first.
        """
        n = batch["chosen_input_ids"].shape[0]
        chunk = getattr(self, "output_layer_chunk", DEFAULT_OUTPUT_LAYER_CHUNK)  # a default for stand-ins without a config
        weight = getattr(self, "token_weight", None)  # an objective's weight per response token (LD-DPO); None: 1
        if self.packed:  # each pair one row, the prompt once (None: a batch that is not right-padded)
            args = (model, batch, self.average_log_prob, self.device, self.max_forward_chunks)
            out = packed_sequence_logps(*args, chunk=chunk, token_weight=weight, token_statistic=token_statistic)
            if out is not None:
                return out[0][:n], out[0][n:], *out[1:]
        inputs = {k: v.to(self.device) for k, v in concatenated_inputs(batch).items()}  # (2B, max(T_c, T_r))
        out = response_logps(model, inputs, self.average_log_prob, chunk, weight, token_statistic)
        logps, *rest = (t.to(self.device) for t in out)
        return logps[:n], logps[n:], *rest

    remote_reference = None  # batch -> (chosen, rejected) on other workers, e.g. ray_launcher.RemoteReference

    @torch.no_grad()
    def reference_logps(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's log-probs of B pairs, from a live module, a precomputed cache or remote workers: the one seam
        to the reference (RuntimeError when there is none).

        Args:
            batch: B pairs (:meth:`concatenated_forward`'s layout) with their ``key``s (the cache's index).

        Returns:
            (log ref(chosen | x), log ref(rejected | x)), each (B,) float32, without gradients.
        """
        if self.remote_reference is not None:
            chosen, rejected = self.remote_reference(batch)
            return chosen.to(self.device), rejected.to(self.device)
        if self.reference_cache is not None:
            pairs = [self.reference_cache[key] for key in batch["key"]]
            return (
                torch.tensor([c for c, _ in pairs], dtype=torch.float32, device=self.device),
                torch.tensor([r for _, r in pairs], dtype=torch.float32, device=self.device),
            )
        return self.live_reference_logps(batch)

    @contextlib.contextmanager
    def adapters_off(self):
        """Within: ``self.policy`` with every adapter bypassed (peft's ``disable_adapter``), in eval mode (a
        LoRA run's reference); adapters and mode are restored afterwards, also on an error."""
        training = self.policy.training
        self.policy.eval()
        try:
            with self.peft_model.disable_adapter():
                yield self.policy
        finally:
            self.policy.train(training)

    @torch.no_grad()
    def live_reference_logps(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's log-probs of ``batch`` computed here, each (B,) float32: the reference module's, or a
        LoRA policy's with its adapters off (:meth:`adapters_off`); RuntimeError when there is neither."""
        if self.peft_model is not None:
            with self.adapters_off() as base:
                chosen, rejected, _ = self.concatenated_forward(base, batch)
            return chosen, rejected
        if self.reference_model is None:
            raise RuntimeError("This loss needs a reference model but the trainer has none.")
        chosen, rejected, _ = self.concatenated_forward(self.reference_model, batch)
        self.reshard_reference()
        return chosen, rejected

    def get_batch_metrics(self, batch: dict, n_batch_examples: int, n_batch_tokens: float, split: str):
        """One micro-batch's loss, normalised over the whole batch, and its metrics.

        Args:
            batch: a micro-batch of B pairs (:meth:`train_step`'s layout).
            n_batch_examples: examples in the whole batch over all processes (the loss's denominator).
            n_batch_tokens: chosen target tokens in the whole batch (the denominator of a per-token objective, SFT).
            split: ``"train"`` or ``"eval"``, the metrics' suffix.

        Returns:
            (loss, a scalar tensor to backpropagate; metrics, name -> list of floats, one per kept pair).
        """
        objective = self.objective
        metrics: dict[str, list[float]] = {}
        n = len(batch["prompt"])
        inputs = self.objective_inputs(batch)
        overrides = {"beta": self.beta} if "beta" in objective.keys else {}
        out = objective.compute(inputs, self.loss_config, **overrides)
        per_example = out.losses
        assert n == len(per_example)
        normaliser = n_batch_tokens if objective.per_token else n_batch_examples
        loss, keep = self.batch_loss(batch, inputs, per_example, normaliser, metrics)
        if out.chosen_rewards is not None:
            if objective.reward_metric == "rewards":
                prefix = self.train_rewards if split == "train" else f"rewards_{split}"
            else:
                prefix = f"{objective.reward_metric}_{split}"
            chosen_rewards, rejected_rewards = out.chosen_rewards.detach(), out.rejected_rewards.detach()
            metrics[f"{prefix}/chosen"] = chosen_rewards[keep].tolist()
            metrics[f"{prefix}/rejected"] = rejected_rewards[keep].tolist()
            metrics[f"{prefix}/accuracies"] = (chosen_rewards > rejected_rewards)[keep].float().tolist()
            metrics[f"{prefix}/margins"] = (chosen_rewards - rejected_rewards)[keep].tolist()
        for side in ("chosen", "rejected"):
            logps = getattr(inputs, f"policy_{side}_logps")
            if logps is not None:
                metrics[f"logps_{split}/{side}"] = logps.detach()[keep].tolist()
        if objective.per_token:  # one value per micro-batch: its mean per target token
            metrics[f"loss/{split}"] = [(per_example.detach().sum() / inputs.chosen_n_tokens.sum().clamp(min=1)).item()]
        else:
            metrics[f"loss/{split}"] = per_example.detach()[keep].tolist()
        for name, value in out.metrics.items():
            value = value.detach().reshape(-1)
            metrics[f"{name}/{split}"] = (value[keep] if value.numel() == n else value).tolist()
        return loss, metrics

    def objective_inputs(self, batch: dict) -> losses.ObjectiveInputs:
        """What the objective learns from, computed on this micro-batch of B examples by the builder it declares
        (:meth:`pair_inputs` unless it names another; see ``losses.ObjectiveInputs`` for the fields and shapes)."""
        inputs = (self.objective.inputs or BasicTrainer.pair_inputs)(self, batch)
        if self.uses_nll:  # -log pi(y_w | x) per token, from the same forward
            chosen, n_chosen = inputs.policy_chosen_logps, inputs.chosen_n_tokens
            per_token = chosen if self.average_log_prob else chosen / n_chosen.clamp(min=1)
            inputs.policy_chosen_nll = -per_token
        return inputs

    def pair_inputs(self, batch: dict) -> losses.ObjectiveInputs:
        """The pairs' log-probs under the policy (:meth:`concatenated_forward`) and the reference
        (:meth:`reference_logps`; zeros for a reference-free objective), (B,) each, and their target tokens."""
        if "label" in batch:  # unpaired rows {prompt, completion, label}: an objective that takes them names its builder
            raise ValueError(f"loss={self.objective.name} trains on pairs; this batch holds unpaired rows.")
        n = len(batch["prompt"])
        policy_chosen, policy_rejected, n_tokens = self.concatenated_forward(self.policy, batch)
        if self.uses_reference:
            ref_chosen, ref_rejected = self.reference_logps(batch)
        else:  # a uniform reference (reference_free), never computed
            ref_chosen, ref_rejected = torch.zeros_like(policy_chosen), torch.zeros_like(policy_rejected)
        return losses.ObjectiveInputs(
            policy_chosen_logps=policy_chosen,
            policy_rejected_logps=policy_rejected,
            reference_chosen_logps=ref_chosen,
            reference_rejected_logps=ref_rejected,
            chosen_n_tokens=n_tokens[:n],
            rejected_n_tokens=n_tokens[n:],
        )

    def one_side_logps(self, model, rows: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`single_logps` of ``model`` on ``rows`` with this trainer's settings."""
        chunk = getattr(self, "output_layer_chunk", DEFAULT_OUTPUT_LAYER_CHUNK)
        return single_logps(model, rows, self.average_log_prob, self.device, self.max_forward_chunks, chunk)

    @property
    def beta(self) -> float | None:
        """``loss.beta`` for the current epoch (see :func:`beta_for_epoch`); None for an
        objective without one."""
        if "beta" not in self.objective.keys:
            return None
        epoch = self.example_counter // max(len(self.train_examples), 1)
        return beta_for_epoch(self.loss_config.get("beta", self.objective.keys["beta"].default), epoch)

    # ------------------------------------------------------------------ what a trainer that extends this one overrides
    # (online/trainer.py: online DPO samples and labels each step's pairs, weighs them and stops on a failing judge)

    train_rewards = "rewards_train"  # the train rewards' metric prefix (online DPO: TRL's "rewards")

    def step_pairs(self, batch: dict, weight: float, collected: dict, n_examples: float) -> tuple[dict, float]:
        """The pairs this step trains on and how many count over all ranks: the batch as it is."""
        return batch, n_examples

    def batch_loss(self, batch: dict, inputs, per_example: torch.Tensor, normaliser: float, metrics: dict):
        """(the micro-batch's loss, which pairs its metrics keep): every pair counts, (B,) ``per_example`` summed."""
        return per_example.sum() / normaliser, slice(None)

    def after_eval(self) -> Callable[[str], None] | None:
        """After each eval, before its checkpoint: None, or a function of the checkpoint's path that raises RunStoppedError."""
        return None

    # ------------------------------------------------------------------ eval and samples

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Mean metrics over the eval set (``n_eval_examples``), logged as ``*_eval/*``."""
        self.policy.eval()
        collected = defaultdict(list)
        bar = tqdm.tqdm(self.eval_batches, desc="eval", leave=False, disable=not (self.config.progress_bar and self.dist.is_main))
        for global_batch in bar:
            batch, _ = self.local_batch(global_batch)
            n_tokens = self.dist.global_sum(float((batch["chosen_labels"] != losses.IGNORE_INDEX).sum()))
            _, metrics = self.get_batch_metrics(batch, len(global_batch["prompt"]), n_tokens, "eval")
            for k, v in metrics.items():
                collected[k].extend(v)
        collected = self.dist.gather_metrics(collected)
        means = {k: float(np.mean(v)) for k, v in collected.items()}
        for extend in EVAL_EXTENSIONS:  # evaluation/: the greedy answers scored, samples written
            means |= extend(self)
        if self.dist.is_main:
            self.logger.log(means, step=self.example_counter)
            print(f"[eval] after {self.example_counter} examples: {tracking.formatted_dict(means)}")
        self.policy.train()
        return means

    # ------------------------------------------------------------------ training

    def train_step(self, batch: dict) -> dict:
        """One optimizer step on one batch, its gradient accumulated over ``gradient_accumulation_steps`` micro-batches.

        Args:
            batch: B pairs from ``preference_datasets.get_batch_iterator``: ``prompt`` (B strings), ``key``, and
                ``{chosen,rejected}_{input_ids,attention_mask,labels}``, (B, T_c) and (B, T_r) right-padded tensors.

        Returns:
            The step's metrics, name -> list of floats (one per example for the per-pair ones), over every process.
            NonFiniteLossError comes before the step when a loss or the gradient norm is NaN or inf.
        """
        n_examples = len(batch["prompt"])
        self.step_tokens = count_tokens(batch)
        batch, weight = self.local_batch(batch)
        collected = defaultdict(list)
        batch, n_examples = self.step_pairs(batch, weight, collected, n_examples)
        n_tokens = self.dist.global_sum(float((batch["chosen_labels"] != losses.IGNORE_INDEX).sum()))
        chunks = split_batch(batch, self.config.gradient_accumulation_steps)
        for i, chunk in enumerate(chunks):
            self.set_grad_sync(i == len(chunks) - 1)  # one gradient reduction per step
            loss, metrics = self.get_batch_metrics(chunk, n_examples, n_tokens, "train")
            if not self.dist.all_finite(loss):
                self.raise_non_finite(f"loss is {loss.item()}")
            (loss * (weight * self.grad_scale)).backward()
            if weight:
                for k, v in metrics.items():
                    collected[k].extend(v)
        grad_norm = self.clip_gradients()
        if not torch.isfinite(grad_norm):
            self.raise_non_finite(f"gradient norm is {grad_norm.item()}")
        collected = defaultdict(list, self.dist.gather_metrics(collected))
        collected["lr"].append(self.optimizer.param_groups[0]["lr"])  # the lr of this step
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        collected["grad_norm"].append(grad_norm.item())
        if (self.config.get("reference_update") or {}).get("mode"):  # TR-DPO
            self.reference_update_step(collected)
        return collected

    def reference_update_step(self, collected: dict) -> None:
        """TR-DPO (Gorbatovski et al. 2024): move the reference every ``reference_update.every`` steps, counting the updates."""
        update = self.config.reference_update
        if (self.batch_counter + 1) % update.get("every", 1) == 0:
            self.update_reference(update["mode"], float(update.get("alpha", 1.0)))
        collected["reference_updates"].append(
            float((self.batch_counter + 1) // update.get("every", 1))
        )  # a resumed run counts on

    @torch.no_grad()
    def update_reference(self, mode: str, alpha: float) -> None:
        """TR-DPO's reference update (Gorbatovski et al. 2024, Sec. 3; every tau = ``reference_update.every`` steps):
        ``soft`` theta_ref <- alpha * theta + (1 - alpha) * theta_ref, ``hard`` theta_ref <- theta."""
        if self.reference_model is None:
            raise RuntimeError("reference_update needs the reference model in this process; none is loaded.")
        for model in (self.policy, self.reference_model):
            for module in model.modules():
                if hasattr(module, "reshard"):  # FSDP2 keeps a root's weights gathered after a no-grad forward
                    module.reshard()
        policy = dict(self.policy.named_parameters())  # sharded alike (FSDP, TP): nothing is gathered
        for name, ref in self.reference_model.named_parameters():
            theta = policy[name].detach()
            theta = theta.to(ref.dtype) if theta.dtype != ref.dtype else theta
            if mode == "hard":
                ref.copy_(theta)
            else:
                ref.mul_(1.0 - alpha).add_(theta, alpha=alpha)

    def raise_non_finite(self, what: str):
        """Raise NonFiniteLossError: one sentence naming the step, the last good checkpoint and
        what to change (train.py prints it as one ``Error:`` line)."""
        latest = os.path.join(self.run_dir, "LATEST")
        where = (
            f"the last good checkpoint is {os.path.realpath(latest)}"
            if os.path.exists(latest)
            else "no checkpoint was written yet"
            + (
                " and its run folder, holding only its config, is removed"  # by train.main, as any setup fault's
                if checkpoints.holds_only_setup(self.run_dir)
                else f" (its run folder {self.run_dir} holds only logs: delete it once read)"
            )
        )
        fix = "lower lr or max_grad_norm, or check the data"
        if self.config.model.policy_dtype == "float16":
            fix += ", or train with model.policy_dtype=bfloat16 (float16 weights overflow and underflow easily)"
        raise NonFiniteLossError(
            f"Training stopped: {what} at step {self.batch_counter + 1} (after {self.example_counter} examples), "
            f"before its optimizer step; nothing was saved and {where}: {fix}."
        )

    def train(self) -> int | None:
        """Train to ``n_examples`` / ``n_epochs`` with an eval and a checkpoint every ``eval_every`` examples and at the
        end (then ``FINISHED``, which ``resume=auto`` skips); returns None, or the :data:`STOP_SIGNALS` signal that stopped it."""
        if self.example_counter >= self.total_examples:
            self.say_already_complete()
            self.logger.finish()
            return None
        iterator = self.train_batches()
        main_thread = threading.current_thread() is threading.main_thread()  # Ray Train runs this in a thread
        previous = {s: signal.signal(s, self._request_stop) for s in STOP_SIGNALS} if main_thread else {}
        bar = tqdm.tqdm(
            total=self.total_examples,
            initial=self.example_counter,
            unit="ex",
            desc="train",
            disable=not (self.config.progress_bar and self.dist.is_main),
        )
        try:
            self.run_batches(iterator, bar)
            bar.close()
            if self.stop_requested:
                return self.stop_with_checkpoint()
            return self.finish_run()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.logger.finish()

    def say_already_complete(self) -> None:
        """On rank 0: say the run has nothing left to train, writing ``FINISHED`` if it is missing."""
        if self.dist.is_main:
            print(f"Nothing to do: this run is complete ({self.example_counter}/{self.total_examples} examples).")
            if not os.path.exists(os.path.join(self.run_dir, checkpoints.FINISHED)):  # finished before FINISHED existed
                checkpoints.mark_finished(self.run_dir, self.example_counter)

    def train_batches(self):
        """The shuffled training batches from ``example_counter`` on (a resumed run continues its order)."""
        config = self.config
        return get_batch_iterator(
            self.train_examples,
            self.tokenizer,
            config.batch_size,
            config.max_length,
            config.max_prompt_length,
            shuffle=True,
            seed=config.seed,
            n_epochs=config.n_epochs,
            n_examples=config.n_examples,
            start_example=self.example_counter,
            length_grouped=config.length_grouped,
        )

    def run_batches(self, iterator, bar) -> None:
        """Train on ``iterator``'s batches until they end or a stop is requested, evaluating when due and logging
        at most every ``minimum_log_interval_secs`` seconds (the last steps always)."""
        pending = defaultdict(list)
        tokens = 0  # non-padding tokens since the last log
        last_log = time.time()
        last_log_examples = self.example_counter
        self.policy.train()
        for batch in iterator:
            if self.example_counter >= self.next_eval_at:
                self.evaluate_and_save(final=False)
            metrics = self.train_step(batch)
            tokens += self.step_tokens
            self.batch_counter += 1
            self.example_counter += len(batch["prompt"])
            bar.update(len(batch["prompt"]))
            for k, v in metrics.items():
                pending[k].extend(v)
            self.stop_requested = self.dist.any_rank(self.stop_requested)
            now = time.time()
            if self.dist.is_main and (now - last_log >= self.config.minimum_log_interval_secs or self.stop_requested):
                self.log_train(pending, self.example_counter - last_log_examples, tokens, now - last_log, bar)
                last_log, last_log_examples, tokens = now, self.example_counter, 0
            if self.stop_requested:
                break
        if pending and self.dist.is_main:  # the last steps are always logged
            self.log_train(pending, self.example_counter - last_log_examples, tokens, max(time.time() - last_log, 1e-9), bar)

    def evaluate_and_save(self, final: bool) -> str | None:
        """Evaluate, schedule the next eval past this point, and checkpoint (before any training only when ``final``);
        returns the checkpoint's path; :meth:`after_eval`'s RunStoppedError comes after it."""
        self.evaluate()
        while self.next_eval_at <= self.example_counter:  # before saving: a resume or an extension does not evaluate again
            self.next_eval_at += self.config.eval_every
        stop = self.after_eval()  # None, or (an extending trainer) a function that raises RunStoppedError naming the checkpoint
        if not (final or self.example_counter > 0):
            return None
        path = self.save()
        if stop is not None:
            stop(path)
        return path

    def stop_with_checkpoint(self) -> int:
        """After a stop signal: checkpoint, report and say how to resume; returns the signal's number."""
        path = self.save()
        memory = tracking.log_peak_memory(self.dist, self.logger, self.setup_peak_rss_mib, self.example_counter)
        if self.dist.is_main and self.config.get("plot_curves", True):  # .get: a config saved before the key existed
            tracking.plot_curves(self.run_dir)
        if self.dist.is_main:
            print(f"Interrupted after {self.example_counter} examples; checkpoint saved to {path}.")
            tracking.say_peak_memory(memory)
            how = "the same torchrun command on every node, with" if "TORCHELASTIC_RUN_ID" in os.environ else "python train.py"
            print(f"Resume with: {how} resume={self.run_dir}")
        self.dist.wait_for_all()
        return self.stop_signal or signal.SIGTERM

    def finish_run(self) -> None:
        """At the end of training: the last eval and checkpoint, the report, then ``FINISHED`` once every rank is done."""
        path = self.evaluate_and_save(final=True)
        memory = tracking.log_peak_memory(self.dist, self.logger, self.setup_peak_rss_mib, self.example_counter)
        if self.dist.is_main:
            written = tracking.plot_curves(self.run_dir) if self.config.get("plot_curves", True) else []
            export = ""
            if self.config.save_hf_export:
                failed = self.hf_export_failure
                export = f" (no Hugging Face export: {failed})" if failed else f" (Hugging Face export in {path}/hf)"
            print(f"Done: {self.example_counter} examples. Checkpoint: {path}{export}.")
            tracking.say_peak_memory(memory)
            if written:
                print(f"Training curves: {os.path.dirname(written[0])}/")
        self.dist.wait_for_all()
        if self.dist.is_main:  # every rank's part of the last checkpoint is written
            checkpoints.mark_finished(self.run_dir, self.example_counter)

    def log_train(self, pending: dict, n_examples: int, n_tokens: int, seconds: float, bar) -> None:
        """Log the means of the train metrics gathered since the last log, then clear them;
        throughput counts examples and non-padding tokens (prompt + responses) per second."""
        means = {k: float(np.mean(v)) for k, v in pending.items() if len(v)}  # none when every pair tied
        means["examples_per_second"] = n_examples / seconds
        means["tokens_per_second"] = n_tokens / seconds
        means["counters/examples"] = self.example_counter
        means["counters/updates"] = self.batch_counter
        self.logger.log(means, step=self.example_counter)
        bar.set_postfix(_postfix(means))
        pending.clear()

    def _request_stop(self, signum, frame):
        """Handler of :data:`STOP_SIGNALS`: stop after this step with a checkpoint; a second SIGINT raises
        KeyboardInterrupt, another repeated signal is ignored."""
        if self.stop_requested:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return  # schedulers deliver these more than once (scancel, then torchrun); keep the checkpoint under way
        print(f"\nReceived {signal.Signals(signum).name}: saving a checkpoint after this step, then stopping.")
        self.stop_requested = True
        self.stop_signal = signum

    # ------------------------------------------------------------------ checkpoints

    def save(self) -> str:
        """Write ``step-<examples>/`` (:meth:`write_checkpoint`) atomically, point ``LATEST`` at it and return its path;
        checkpoints.CheckpointError on every process if it cannot be written."""
        step = self.example_counter
        self.hf_export_failure = None
        path = self.save_checkpoint_dir(f"step-{step}", lambda folder: self.write_checkpoint(folder, step))
        if self.dist.is_main:
            self.warn_export_failure(path)
            checkpoints.prune_checkpoints(self.run_dir, self.config.keep_checkpoints)
        return path

    def save_checkpoint_dir(self, name: str, write) -> str:
        """checkpoints.save_checkpoint_dir of ``<run_dir>/<name>`` on the main process, with ``write(folder)`` run
        inside it on every process; checkpoints.CheckpointError on every process if it cannot be written."""
        if self.mesh is None:
            return checkpoints.save_checkpoint_dir(self.run_dir, name, write)
        sent = []  # the folder, once the main process has made it and sent it to the others

        def write_all(folder: str) -> None:
            sent.append(self.dist.broadcast(folder))
            write(folder)

        message = None
        if self.dist.is_main:
            try:
                checkpoints.save_checkpoint_dir(self.run_dir, name, write_all)
            except checkpoints.CheckpointError as e:
                message = str(e)
                if not sent:
                    self.dist.broadcast(None)  # no folder: the others write nothing
        else:
            folder = self.dist.broadcast(None)
            if folder is not None:
                write(folder)
        message = self.dist.broadcast(message)  # every process waits here for the main one's files
        if message is not None:
            raise checkpoints.CheckpointError(message)
        return os.path.join(self.run_dir, name)

    def write_checkpoint(self, folder: str, step: int) -> None:
        """policy.pt, optimizer.pt, scheduler.pt, trainer_state.pt, reference.pt (TR-DPO) and ``hf/`` (unless
        its export fails) into ``folder``."""
        torch.save(self.policy_checkpoint(step, self.policy.state_dict()), os.path.join(folder, "policy.pt"))
        torch.save({"step_idx": step, "state": self.optimizer.state_dict()}, os.path.join(folder, "optimizer.pt"))
        torch.save({"step_idx": step, "state": self.scheduler.state_dict()}, os.path.join(folder, "scheduler.pt"))
        torch.save(self.trainer_state(), os.path.join(folder, "trainer_state.pt"))
        if self.updates_reference:  # TR-DPO: the reference has moved; resume needs it
            torch.save({"step_idx": step, "state": self.reference_model.state_dict()}, os.path.join(folder, "reference.pt"))
        for write in CHECKPOINT_EXTENSIONS:  # export/: the Hugging Face folder hf/ when save_hf_export
            self.hf_export_failure = write(self, folder, None) or self.hf_export_failure

    hf_export_failure: str | None = None
    """Why the last checkpoint has no ``hf/`` export (None: it has one, or none was asked for)."""

    def policy_checkpoint(self, step: int, state: dict) -> dict:
        """What policy.pt holds: ``{step_idx, state}`` with the policy's weights ``state``; for a
        LoRA policy only the adapters' entries of it (the trainable weights) and ``lora``, the
        ``model.lora`` settings (so ``model.archive`` can tell it from a whole model)."""
        if self.peft_model is None:
            return {"step_idx": step, "state": state}
        from omegaconf import OmegaConf

        adapters = {k: v for k, v in state.items() if k in self.trainable_names}
        return {"step_idx": step, "state": adapters, "lora": OmegaConf.to_container(self.lora, resolve=True)}

    def load_policy_state(self, state: dict) -> None:
        """Load policy.pt's ``state`` (a LoRA policy's: its adapters alone) into the policy; RuntimeError if it does not fit."""
        if self.peft_model is None:
            self.policy.load_state_dict(state)
            return
        missing, unexpected = self.policy.load_state_dict(state, strict=False)
        lost = sorted(self.trainable_names & set(missing))
        if unexpected or lost:
            raise RuntimeError(f"policy.pt does not hold this LoRA policy's adapters (e.g. {(unexpected or lost)[0]!r}).")

    def warn_export_failure(self, path: str) -> None:
        """Print one sentence when checkpoint ``path`` was published without its ``hf/`` export."""
        if self.hf_export_failure and self.dist.is_main:
            print(
                f"Warning: the Hugging Face export {path}/hf could not be written ({self.hf_export_failure}); "
                f"the checkpoint is complete without it: resume= continues from it and "
                f"model.archive={path}/policy.pt loads its weights.",
                flush=True,
            )

    def trainer_state(self) -> dict:
        """Counters, RNG states, the W&B run id and the data's fingerprint: what resume needs besides the weights."""
        state = {
            "example_counter": self.example_counter,
            "batch_counter": self.batch_counter,
            "next_eval_at": self.next_eval_at,
            "rng": {
                "python": random.getstate(),
                "numpy": numpy_rng_state(),
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            },
            "wandb_id": self.logger.run_id,
        }
        if self.data_fingerprint is not None:
            state["data"] = self.data_fingerprint
        return state

    @classmethod
    def made_before_models(cls, config) -> dict:
        """Keyword arguments an extending trainer builds from ``config`` before the models load, failing fast (none)."""
        return {}

    @staticmethod
    def read(checkpoint_dir: str, name: str):
        """Load ``name`` (a torch.save file) from ``checkpoint_dir`` onto the CPU (:func:`read_checkpoint_file`)."""
        return read_checkpoint_file(checkpoint_dir, name)

    def load(self, checkpoint_dir: str) -> None:
        """Restore policy, optimizer, scheduler, counters and RNG from a checkpoint folder."""
        self.load_policy_state(self.read(checkpoint_dir, "policy.pt")["state"])
        self.optimizer.load_state_dict(self.read(checkpoint_dir, "optimizer.pt")["state"])
        self.scheduler.load_state_dict(self.read(checkpoint_dir, "scheduler.pt")["state"])
        if self.updates_reference:
            self.reference_model.load_state_dict(self.read(checkpoint_dir, "reference.pt")["state"])
        self.restore_trainer_state(self.read(checkpoint_dir, "trainer_state.pt"))

    @property
    def updates_reference(self) -> bool:
        """True if TR-DPO's ``reference_update`` moves the reference during training (so checkpoints hold it)."""
        return bool((self.config.get("reference_update") or {}).get("mode")) and self.reference_model is not None

    def restore_trainer_state(self, state: dict) -> None:
        """Restore counters and Python/NumPy/torch RNG states saved by :meth:`trainer_state`."""
        self.example_counter = state["example_counter"]
        self.batch_counter = state["batch_counter"]
        self.next_eval_at = state["next_eval_at"]
        random.setstate(state["rng"]["python"])
        set_numpy_rng_state(state["rng"]["numpy"])
        torch.set_rng_state(state["rng"]["torch"])
        if state["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        dropped = self.rewind_logs(self.example_counter)
        if dropped:
            print(f"metrics.jsonl: removed {dropped} records logged after this checkpoint; training logs those steps again.")

    def rewind_logs(self, step: int) -> int:
        """On rank 0, drop what was logged after ``step`` examples (metrics.jsonl and the resumed
        W&B run, samples.jsonl and samples.md, completions.jsonl), since training logs those
        steps again; ``step=-1`` drops all. Returns how many metrics.jsonl records were dropped."""
        if not self.dist.is_main:
            return 0
        dropped = self.logger.rewind(step)
        for name in ("samples.jsonl", "completions.jsonl"):
            tracking.rewind_jsonl(os.path.join(self.run_dir, name), step)
        for rewound in REWIND_EXTENSIONS:  # evaluation/: samples.md, its view of samples.jsonl, rewound with it
            rewound(self.run_dir)
        return dropped


def count_tokens(batch: dict) -> int:
    """Non-padding tokens of a batch: prompt + responses of every sequence (prompts alone for a
    batch of prompts)."""
    keys = [k for k in ("chosen_attention_mask", "rejected_attention_mask") if k in batch] or ["prompt_attention_mask"]
    return sum(int(batch[k].sum()) for k in keys)


def _postfix(means: dict) -> dict:
    names = {
        "loss/train": "loss",
        "rewards_train/accuracies": "acc",
        "rewards_train/margins": "margin",
        "examples_per_second": "ex/s",
    }
    return {short: f"{means[k]:.3g}" for k, short in names.items() if k in means}


# ============================================================================ precomputed reference


# ============================================================================ distributed trainers


class _DistributedTrainer(BasicTrainer):
    """What FSDP and tensor parallelism share: a process group and device mesh for BasicTrainer's
    collectives, and sharded checkpoints with torch.distributed.checkpoint (DCP)."""

    def __init__(self, *args, **kwargs):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs torch.distributed; start it with train.py or torchrun.")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if torch.cuda.is_available():
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local_rank)
            self.device = torch.device("cuda", local_rank)
        else:
            self.device = torch.device("cpu")
        from torch.distributed.device_mesh import init_device_mesh

        config = args[1] if len(args) > 1 else kwargs["config"]
        self.tp_size = self.tensor_parallel_size(config)
        dp_size = self.world_size // self.tp_size
        self.mesh = init_device_mesh(self.device.type, (dp_size, self.tp_size), mesh_dim_names=("dp", "tp"))
        super().__init__(*args, **kwargs)

    def tensor_parallel_size(self, config) -> int:
        """Over how many processes each weight matrix is split (the mesh's ``tp`` dimension)."""
        return 1

    def shard_from_rank0(self, model: torch.nn.Module, shard) -> None:
        """Shard ``model`` over ``self.mesh`` with ``shard`` (FSDP or a TP plan), its weights sent from rank 0:
        no rank holds the full model on its device, and only rank 0 reads the checkpoint."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        state = model.state_dict()
        full = state if self.rank == 0 else {}
        unsaved = {n: b.detach().clone() for n, b in model.named_buffers() if n not in state}
        # rank 0 holds the weights, the others meta tensors (models.rank0_model)
        models.keeping_ties(model, lambda model: model.to("meta"))
        shard(model)
        models.keeping_ties(model, lambda model: model.to_empty(device=self.device))
        # each rank allocates and receives only its slice
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        for name, buffer in model.named_buffers():
            if name in unsaved:
                if self.rank == 0:
                    buffer.copy_(unsaved[name])
                dist.broadcast(buffer, src=0)

    def write_checkpoint(self, folder: str, step: int) -> None:
        """Each rank its DCP shard into ``folder``/sharded, then rank 0 the gathered policy.pt, scheduler.pt,
        trainer_state.pt and ``hf/`` (:meth:`write_rank0_files`)."""
        import shutil

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

        error = None
        try:
            model_sd, optim_sd = get_state_dict(self.policy, self.optimizer, options=self.sharded_options())
            state = {"model": model_sd, "optimizer": optim_sd}
            if self.updates_reference:  # TR-DPO: the moved reference, sharded like the policy
                state["reference"] = get_model_state_dict(self.reference_model)
            dcp.save(state, checkpoint_id=os.path.join(folder, "sharded"))
        except Exception as e:  # DCP raises on every rank when any rank's write fails
            error = e
        if self.dist.any_rank(error is not None):
            if not self.dist.is_main:
                return  # rank 0 raises, and save_checkpoint_dir tells every rank
            if error is not None:
                raise error
            shutil.rmtree(folder, ignore_errors=True)  # before the message, which reports the free space
            reason = "another rank could not write its shard"
            raise checkpoints.CheckpointError(checkpoints.checkpoint_error_message(self.run_dir, f"step-{step}", reason))
        # LoRA: the adapters alone, unless the merged export needs the frozen base too
        adapters_only = self.lora is not None and not (self.config.save_hf_export and self.lora.get("export_merged"))
        full_options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=adapters_only)
        full = get_model_state_dict(self.policy, options=full_options)
        if self.dist.is_main:
            self.write_rank0_files(folder, step, full)

    def sharded_options(self):
        """The ``StateDictOptions`` of the sharded checkpoint (DCP): a LoRA policy's holds the
        adapters (the trainable weights) and their optimizer state alone, not the frozen base."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        if self.lora is None:
            return None
        return StateDictOptions(ignore_frozen_params=True, strict=False)

    def write_rank0_files(self, folder: str, step: int, full_state: dict) -> None:
        """policy.pt (full weights), scheduler.pt, trainer_state.pt and hf/ into ``folder``;
        a tensor-parallel GPT-2's weights go back to its own Conv1D layout first."""
        if self.tp_size > 1 and self.policy.config.model_type == "gpt2":
            from transformers import AutoModelForCausalLM

            full_state = _gpt2_state_to_conv1d(full_state, self.policy.config, self.tp_size)
            exporter = AutoModelForCausalLM.from_config(self.policy.config)
            exporter.load_state_dict(full_state)
            self.policy, policy = exporter, self.policy
            try:
                self._write_rank0_files(folder, step, full_state)
            finally:
                self.policy = policy
            return
        self._write_rank0_files(folder, step, full_state)

    def _write_rank0_files(self, folder: str, step: int, full_state: dict) -> None:
        torch.save(self.policy_checkpoint(step, full_state), os.path.join(folder, "policy.pt"))
        torch.save({"step_idx": step, "state": self.scheduler.state_dict()}, os.path.join(folder, "scheduler.pt"))
        torch.save(self.trainer_state(), os.path.join(folder, "trainer_state.pt"))
        for write in CHECKPOINT_EXTENSIONS:  # export/: the Hugging Face folder hf/ when save_hf_export
            self.hf_export_failure = write(self, folder, full_state) or self.hf_export_failure

    def load(self, checkpoint_dir: str) -> None:
        """Resume from a checkpoint's ``sharded/`` folder (each rank reads its shard; LoRA: the
        adapters and their optimizer state, :meth:`sharded_options`)."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_state_dict,
            set_model_state_dict,
            set_state_dict,
        )

        options = self.sharded_options()
        model_sd, optim_sd = get_state_dict(self.policy, self.optimizer, options=options)
        state = {"model": model_sd, "optimizer": optim_sd}
        if self.updates_reference:
            state["reference"] = get_model_state_dict(self.reference_model)
        read_sharded_checkpoint(state, os.path.join(checkpoint_dir, "sharded"))
        set_state_dict(
            self.policy, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=options
        )
        if self.updates_reference:
            set_model_state_dict(self.reference_model, state["reference"])
        self.scheduler.load_state_dict(self.read(checkpoint_dir, "scheduler.pt")["state"])
        self.restore_trainer_state(self.read(checkpoint_dir, "trainer_state.pt"))


class FSDPTrainer(_DistributedTrainer):
    """Fully sharded data parallel training with PyTorch FSDP2 (``fully_shard``) of every transformer block
    (``model.block_name``, or ``_no_split_modules``) and the root, policy and reference alike; each rank
    takes its slice of every global batch."""

    max_forward_chunks = 1  # every rank must make the same FSDP calls (all-gathers), whatever its data

    @property
    def grad_scale(self) -> float:
        return float(self.dist.data_world_size)  # FSDP averages gradients over its ranks; losses are global sums

    def tensor_parallel_size(self, config) -> int:
        """``tensor_parallel_size`` (default 1: plain FSDP over every rank)."""
        return config.tensor_parallel_size or 1

    def prepare_models(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kwargs = {}
        if self.config.model.fsdp_policy_mp:
            dtype = utils.get_dtype(self.config.model.fsdp_policy_mp)
            # float32 gradient reduction
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        kwargs["mesh"] = self.mesh["dp"]
        if self.tp_size > 1:  # DTensor's hint that 2-D norms and full-state gathers take two collectives: known, rare
            logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        for model in (self.policy, self.reference_model):
            if model is None:
                continue
            blocks = find_block_classes(model, self.config.model.block_name)
            plan = tensor_parallel_plan(model, self.tp_size) if self.tp_size > 1 else None

            def shard(model, blocks=blocks, plan=plan):
                if plan is not None:  # 2-D: tensor parallel within each group of tp_size ranks, then FSDP across groups
                    from torch.distributed.tensor.parallel import parallelize_module

                    parallelize_module(model, self.mesh["tp"], plan)
                fully_shard_blocks(model, blocks, **kwargs)

            self.shard_from_rank0(model, shard)

    def local_batch(self, batch: dict) -> tuple[dict, float]:
        """This rank's contiguous slice of a global batch (weight 0 for a stand-in when there are fewer examples than ranks)."""
        parts = split_batch(batch, self.dist.data_world_size)
        if self.dist.data_rank < len(parts):
            return parts[self.dist.data_rank], 1.0
        return parts[0], 0.0  # fewer examples than ranks: run a stand-in so collectives match

    def set_grad_sync(self, enabled: bool) -> None:
        """FSDP2: reduce gradients on the next backward only when ``enabled`` (the last micro-batch)."""
        self.policy.set_requires_gradient_sync(enabled)

    def generate_kwargs(self) -> dict:
        """``synced_gpus``: every rank keeps stepping ``generate`` until all ranks' samples are done."""
        return {"synced_gpus": True}


class TensorParallelTrainer(_DistributedTrainer):
    """Tensor parallelism with PyTorch's DTensor (``parallelize_module``) for Llama, GPT-NeoX (Pythia) and
    GPT-2: each process holds a slice of every block (:func:`tensor_parallel_plan`) and sees the whole batch."""

    def prepare_models(self) -> None:
        from torch.distributed.tensor.parallel import parallelize_module

        for model in (self.policy, self.reference_model):
            if model is None:
                continue
            plan = tensor_parallel_plan(model, self.world_size)  # GPT-2: Conv1D -> Linear first, on every rank
            self.shard_from_rank0(model, lambda model, plan=plan: parallelize_module(model, self.mesh["tp"], plan))

    def tensor_parallel_size(self, config) -> int:
        """Every process holds a slice of every block: the whole world is one tensor-parallel group."""
        import torch.distributed as dist

        return dist.get_world_size()


CHECKPOINT_EXTENSIONS: list[Callable[[BasicTrainer, str, dict | None], str | None]] = []
"""A plugin's ``fn(trainer, folder, full_state_dict or None)`` that writes beside a checkpoint's weights (export/: the
Hugging Face folder ``hf/``); returns None, or why it failed (the checkpoint is kept without it)."""

EVAL_EXTENSIONS: list[Callable[[BasicTrainer], dict]] = []
"""A plugin's ``fn(trainer) -> dict`` of more eval means, run after the eval set's (evaluation/: answers_eval, samples)."""

REWIND_EXTENSIONS: list[Callable[[str], None]] = []
"""A plugin's ``fn(run_dir)`` run after a resume rewinds the run folder's logs (evaluation/: samples.md rewritten)."""

TRAINER_EXTENSIONS: list[Callable] = []
"""A plugin's ``fn(config, cls) -> cls`` that may give another trainer class for ``config`` (online/: online DPO's)."""


def trainer_class(config) -> type:
    """``config.trainer``'s class (BasicTrainer, FSDPTrainer, TensorParallelTrainer), as the plugins extend it."""
    cls = {"BasicTrainer": BasicTrainer, "FSDPTrainer": FSDPTrainer, "TensorParallelTrainer": TensorParallelTrainer}[
        config.trainer
    ]
    for extend in TRAINER_EXTENSIONS:
        cls = extend(config, cls)
    return cls
