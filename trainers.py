"""The training loop: BasicTrainer (one process) and its FSDP and tensor-parallel subclasses, computing what the
objective of ``config.loss.name`` (losses.py) declares, the reference's side through :meth:`BasicTrainer.reference_logps`."""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import torch
import tqdm

import losses
from data.chat import stop_token_ids
from modeling import forward, models, optimization
from modeling.packing import DEFAULT_OUTPUT_LAYER_CHUNK, packed_sequence_logps
from parallel import fsdp, tensor_parallel
from parallel.dist import Dist, shard_from_rank0, split_batch
from preference_datasets import concatenated_inputs, get_batch_iterator
from runs import checks, ending, tracking, trainer_checkpoint


class NonFiniteLossError(RuntimeError):
    """The loss or gradient became NaN or inf; the message names the step."""


class RunStoppedError(RuntimeError):
    """A trainer that extends BasicTrainer stopped the run after a checkpoint (online DPO: its judge failed too often);
    the message names the checkpoint kept."""


class BasicTrainer:
    """Train ``policy`` on ``data.loading.load_examples`` examples with ``config.loss`` on one process;
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
        self.output_layer_chunk = config.output_layer_chunk  # positions per output-layer call; None or 0: all at once
        self.objective = losses.get_objective(config.loss.name)  # what to compute; the trainer names no objective
        self.average_log_prob = self.objective.averages(config.loss)
        weights = self.objective.token_weights
        self.token_weight = weights(config.loss) if weights is not None else None  # each response token's, in the pairs' sums
        self.uses_reference = self.objective.uses_reference(config.loss)
        self.uses_nll = self.objective.uses_nll(config.loss)
        self.setup_models()
        mode = (config.get("reference_update") or {}).get("mode")  # .get: a config saved before the key existed
        self.reference_update = losses.REFERENCE_UPDATES[mode](self) if mode else None  # moves the reference
        self.setup_peak_rss_mib = tracking.peak_rss_mib()  # loading and sharding, before any step

        self.optimizer = optimization.build_optimizer(self.policy, config)
        self.total_examples = config.n_examples or config.n_epochs * len(train_examples)
        self.scheduler = optimization.build_scheduler(self.optimizer, config, math.ceil(self.total_examples / config.batch_size))
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
        if self.config.activation_checkpointing:
            models.enable_activation_checkpointing(self.policy)
        self.trainable_names = {n for n, p in self.policy.named_parameters() if p.requires_grad}
        self.prepare_models()

    # ------------------------------------------------------------------ what a parallel trainer sets

    dist = Dist()  # the processes and their collectives: one process here; a parallel trainer's its (dp, tp) mesh's
    grad_scale = 1.0  # FSDP averages gradients over ranks; the loss is scaled to undo it
    generate_kwargs: dict = {}  # extra ``generate`` arguments (FSDP keeps all ranks stepping until all are done)

    def prepare_models(self) -> None:
        """Move the policy and reference to this process's device, except a model split by ``model.device_map``
        (``hf_device_map``); ``self.device``, where inputs go, is that of the policy's first parameter."""
        device = "cuda" if torch.cuda.is_available() else "cpu"
        for model in (self.policy, self.reference_model):
            if model is not None and getattr(model, "hf_device_map", None) is None:
                model.to(device)
        self.device = next(self.policy.parameters()).device

    # ------------------------------------------------------------------ log-probs and loss

    max_forward_chunks: int | None = None
    """At most this many forward calls per ``concatenated_forward`` (None: as many as pay off)."""

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
        if self.packed and "model_inputs" not in batch:  # each pair one row, the prompt once (None: not right-padded)
            args = (model, batch, self.average_log_prob, self.device, self.max_forward_chunks)
            out = packed_sequence_logps(*args, chunk=chunk, token_weight=weight, token_statistic=token_statistic)
            if out is not None:
                return out[0][:n], out[0][n:], *out[1:]
        inputs = {k: v.to(self.device) for k, v in concatenated_inputs(batch).items()}  # (2B, max(T_c, T_r))
        out = forward.response_logps(model, inputs, self.average_log_prob, chunk, weight, token_statistic)
        logps, *rest = (t.to(self.device) for t in out)
        return logps[:n], logps[n:], *rest

    remote_reference = None  # batch -> (chosen, rejected) on other workers, e.g. ray_launcher.RemoteReference

    @torch.no_grad()
    def reference_logps(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's log-probs of B pairs, from remote workers, a precomputed cache, or computed here (the reference
        module, or a LoRA policy with its adapters off): the one seam to the reference (RuntimeError when there is none).

        Args:
            batch: B pairs (:meth:`concatenated_forward`'s layout) with their ``key``s (the cache's index).

        Returns:
            (log ref(chosen | x), log ref(rejected | x)), each (B,) float32, without gradients.
        """
        if self.remote_reference is not None:
            chosen, rejected = self.remote_reference(batch)
            return chosen.to(self.device), rejected.to(self.device)
        if self.reference_cache is not None:  # the precomputed pass's (chosen, rejected) by example key
            pairs = torch.tensor([self.reference_cache[key] for key in batch["key"]], dtype=torch.float32, device=self.device)
            return pairs[:, 0], pairs[:, 1]
        if self.peft_model is not None:  # LoRA: the policy with its adapters off
            with models.adapters_off(self.peft_model) as base:
                chosen, rejected, _ = self.concatenated_forward(base, batch)
            return chosen, rejected
        if self.reference_model is None:
            raise RuntimeError("This loss needs a reference model but the trainer has none.")
        chosen, rejected, _ = self.concatenated_forward(self.reference_model, batch)
        self.dist.reshard(self.reference_model)
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
            named = objective.reward_metric != "rewards"  # e.g. a reward model's scores
            prefix = f"{objective.reward_metric}_{split}" if named or split != "train" else self.train_rewards
            chosen_rewards, rejected_rewards = out.chosen_rewards.detach()[keep], out.rejected_rewards.detach()[keep]
            metrics[f"{prefix}/chosen"] = chosen_rewards.tolist()
            metrics[f"{prefix}/rejected"] = rejected_rewards.tolist()
            metrics[f"{prefix}/accuracies"] = (chosen_rewards > rejected_rewards).float().tolist()
            metrics[f"{prefix}/margins"] = (chosen_rewards - rejected_rewards).tolist()
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
        """What the objective learns from, computed by the builder it declares (:meth:`pair_inputs` unless it names
        another), with the chosen NLL per token when the objective uses it: ``losses.ObjectiveInputs``, (B,) each.

        Args:
            batch: a micro-batch of B examples (pairs: :meth:`train_step`'s layout).
        """
        inputs = (self.objective.inputs or BasicTrainer.pair_inputs)(self, batch)
        if self.uses_nll:  # -log pi(y_w | x) per token, from the same forward
            chosen, n_chosen = inputs.policy_chosen_logps, inputs.chosen_n_tokens
            per_token = chosen if self.average_log_prob else chosen / n_chosen.clamp(min=1)
            inputs.policy_chosen_nll = -per_token
        return inputs

    def pair_inputs(self, batch: dict, token_statistic: Callable | None = None) -> losses.ObjectiveInputs:
        """The pairs' log-probs under the policy (:meth:`concatenated_forward`) and the reference
        (:meth:`reference_logps`; zeros for a reference-free objective), and their response tokens, (B,) each.

        Args:
            batch: B pairs (:meth:`concatenated_forward`'s layout) with their ``key``s.
            token_statistic: :meth:`concatenated_forward`'s; its means per response fill ``policy_*_statistic`` (WPO).
        """
        if "label" in batch:  # unpaired rows {prompt, completion, label}: an objective that takes them names its builder
            raise ValueError(f"loss={self.objective.name} trains on pairs; this batch holds unpaired rows.")
        n = len(batch["prompt"])
        args = (self.policy, batch) if token_statistic is None else (self.policy, batch, token_statistic)
        policy_chosen, policy_rejected, n_tokens, *statistic = self.concatenated_forward(*args)
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
            policy_chosen_statistic=statistic[0][:n] if statistic else None,
            policy_rejected_statistic=statistic[0][n:] if statistic else None,
        )

    def one_side_logps(self, model, rows: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward.single_logps`` of ``model`` on ``rows`` with this trainer's settings."""
        chunk = getattr(self, "output_layer_chunk", DEFAULT_OUTPUT_LAYER_CHUNK)
        return forward.single_logps(model, rows, self.average_log_prob, self.device, self.max_forward_chunks, chunk)

    @property
    def beta(self) -> float | None:
        """``loss.beta`` for the current epoch (``optimization.beta_for_epoch``); None for an objective without one."""
        if "beta" not in self.objective.keys:
            return None
        epoch = self.example_counter // max(len(self.train_examples), 1)
        return optimization.beta_for_epoch(self.loss_config.get("beta", self.objective.keys["beta"].default), epoch)

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
            batch, _ = self.dist.local_batch(global_batch)
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
        self.step_tokens = tracking.count_tokens(batch)  # for tokens/s
        batch, weight = self.dist.local_batch(batch)
        collected = defaultdict(list)
        batch, n_examples = self.step_pairs(batch, weight, collected, n_examples)
        n_tokens = self.dist.global_sum(float((batch["chosen_labels"] != losses.IGNORE_INDEX).sum()))
        chunks = split_batch(batch, self.config.gradient_accumulation_steps)
        for i, chunk in enumerate(chunks):
            self.dist.sync_gradients(self.policy, i == len(chunks) - 1)  # one gradient reduction per step
            loss, metrics = self.get_batch_metrics(chunk, n_examples, n_tokens, "train")
            if not self.dist.all_finite(loss):
                raise NonFiniteLossError(ending.non_finite_message(self, f"loss is {loss.item()}"))
            (loss * (weight * self.grad_scale)).backward()
            if weight:
                for k, v in metrics.items():
                    collected[k].extend(v)
        grad_norm = optimization.clip_gradients(self.policy, self.config.max_grad_norm, self.dist, self.device)
        if not torch.isfinite(grad_norm):
            raise NonFiniteLossError(ending.non_finite_message(self, f"gradient norm is {grad_norm.item()}"))
        collected = defaultdict(list, self.dist.gather_metrics(collected))
        collected["lr"].append(self.optimizer.param_groups[0]["lr"])  # the lr of this step
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        collected["grad_norm"].append(grad_norm.item())
        if self.reference_update is not None:  # TR-DPO, BEMA: objectives/
            for k, v in self.reference_update.step(self.batch_counter + 1).items():
                collected[k].append(v)
        return collected

    def train(self) -> int | None:
        """Train to ``n_examples`` / ``n_epochs`` with an eval and a checkpoint every ``eval_every`` examples and at the
        end (then ``FINISHED``, which ``resume=auto`` skips); returns None, or the ``ending.STOP_SIGNALS`` signal that stopped it."""
        try:
            if self.example_counter >= self.total_examples:
                return ending.say_already_complete(self)
            c = self.config
            iterator = get_batch_iterator(  # shuffled, from example_counter on: a resumed run continues its order
                self.train_examples, self.tokenizer, c.batch_size, c.max_length, c.max_prompt_length, shuffle=True,
                seed=c.seed, n_epochs=c.n_epochs, n_examples=c.n_examples, start_example=self.example_counter,
                length_grouped=c.length_grouped,
            )  # fmt: skip
            shown = c.progress_bar and self.dist.is_main
            bar = tqdm.tqdm(total=self.total_examples, initial=self.example_counter, unit="ex", desc="train", disable=not shown)
            with ending.stop_signals(self):  # a stop signal: a checkpoint after this step, then stop
                self.run_batches(iterator, bar)
            bar.close()
            if self.stop_requested:
                return ending.stop_with_checkpoint(self)
            return ending.finish_run(self)
        finally:
            self.logger.finish()

    def run_batches(self, iterator, bar) -> None:
        """Train on ``iterator``'s batches until they end or a stop is requested, evaluating when due and logging
        at most every ``minimum_log_interval_secs`` seconds (the last steps always).

        Args:
            iterator: batches of B pairs (:meth:`train_step`'s layout) from ``preference_datasets.get_batch_iterator``.
            bar: the tqdm bar, advanced by each batch's B examples.
        """
        pending = defaultdict(list)
        tokens, last_log, last_log_examples = 0, time.time(), self.example_counter  # non-padding tokens since the last log
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

    def log_train(self, pending: dict, n_examples: int, n_tokens: int, seconds: float, bar) -> None:
        """Log the means of the train metrics gathered since the last log (a ``counters/`` metric: its last value; none
        when every pair tied), then clear them; throughput counts examples and non-padding tokens per second."""
        means = {k: float(v[-1] if k.startswith("counters/") else np.mean(v)) for k, v in pending.items() if len(v)}
        means["examples_per_second"] = n_examples / seconds
        means["tokens_per_second"] = n_tokens / seconds
        means["counters/examples"] = self.example_counter
        means["counters/updates"] = self.batch_counter
        self.logger.log(means, step=self.example_counter)
        bar.set_postfix(tracking.progress_postfix(means))
        pending.clear()

    # ------------------------------------------------------------------ checkpoints (runs/trainer_checkpoint.py)

    hf_export_failure: str | None = None
    """Why the last checkpoint has no ``hf/`` export (None: it has one, or none was asked for)."""

    def save(self) -> str:
        """Write ``step-<examples>/`` atomically, point ``LATEST`` at it and return its path."""
        return trainer_checkpoint.save(self)

    def trainer_state(self) -> dict:
        """What trainer_state.pt holds: counters, RNG states, the W&B run id, the data's fingerprint."""
        return trainer_checkpoint.trainer_state(self)

    def restore_trainer_state(self, state: dict) -> None:
        """Restore what :meth:`trainer_state` saved."""
        trainer_checkpoint.restore_trainer_state(self, state)

    @classmethod
    def made_before_models(cls, config) -> dict:
        """Keyword arguments an extending trainer builds from ``config`` before the models load, failing fast (none)."""
        return {}


# ============================================================================ distributed trainers


class _DistributedTrainer(BasicTrainer):
    """What FSDP and tensor parallelism share: a process group and device mesh for BasicTrainer's
    collectives, and sharded checkpoints with torch.distributed.checkpoint (DCP)."""

    def __init__(self, *args, **kwargs):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs torch.distributed; start it with train.py or torchrun.")
        rank, world_size = dist.get_rank(), dist.get_world_size()
        if torch.cuda.is_available():
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local_rank)
            self.device = torch.device("cuda", local_rank)
        else:
            self.device = torch.device("cpu")
        config = args[1] if len(args) > 1 else kwargs["config"]
        self.dist = self.make_dist(config, rank, world_size)
        super().__init__(*args, **kwargs)

    def make_dist(self, config, rank: int, world_size: int) -> Dist:
        """The processes' collectives over a (dp, tp) device mesh (a plugin's trainer may lay out another)."""
        from torch.distributed.device_mesh import init_device_mesh

        tp_size = self.tensor_parallel_size(config)
        mesh = init_device_mesh(self.device.type, (world_size // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
        return Dist(rank, world_size, mesh)

    def tensor_parallel_size(self, config) -> int:
        """Over how many processes each weight matrix is split (the mesh's ``tp`` dimension)."""
        return 1

    def shard_from_rank0(self, model: torch.nn.Module, shard) -> None:
        """Shard ``model`` over the mesh with ``shard`` (FSDP or a TP plan), its weights sent from rank 0."""
        shard_from_rank0(model, shard, self.dist.rank, self.device)


class FSDPTrainer(_DistributedTrainer):
    """Fully sharded data parallel training with PyTorch FSDP2 (``fully_shard``) of every transformer block
    (``model.block_name``, or ``_no_split_modules``) and the root, policy and reference alike; each rank
    takes its slice of every global batch."""

    max_forward_chunks = 1  # every rank must make the same FSDP calls (all-gathers), whatever its data
    generate_kwargs = {"synced_gpus": True}  # every rank keeps stepping ``generate`` until all ranks' samples are done

    @property
    def grad_scale(self) -> float:
        return float(self.dist.data_world_size)  # FSDP averages gradients over its ranks; losses are global sums

    def tensor_parallel_size(self, config) -> int:
        """``tensor_parallel_size`` (default 1: plain FSDP over every rank)."""
        return config.tensor_parallel_size or 1

    def prepare_models(self) -> None:
        """FSDP2 over the mesh's ``dp`` dimension (2-D: a tensor-parallel plan within each ``tp`` group first)."""
        fsdp.shard_models(self)


class TensorParallelTrainer(_DistributedTrainer):
    """Tensor parallelism with PyTorch's DTensor (``parallelize_module``) for Llama, GPT-NeoX (Pythia) and
    GPT-2: each process holds a slice of every block (:func:`tensor_parallel_plan`) and sees the whole batch."""

    def prepare_models(self) -> None:
        """Each weight matrix split over every process (:func:`parallel.tensor_parallel.tensor_parallel_plan`)."""
        tensor_parallel.shard_models(self)

    def tensor_parallel_size(self, config) -> int:
        """Every process holds a slice of every block: the whole world is one tensor-parallel group."""
        import torch.distributed as dist

        return dist.get_world_size()


EVAL_EXTENSIONS: list[Callable[[BasicTrainer], dict]] = []
"""A plugin's ``fn(trainer) -> dict`` of more eval means, run after the eval set's (evaluation/: answers_eval, samples)."""

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
