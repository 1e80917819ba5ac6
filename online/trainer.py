"""Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback", Algorithm 1): a trainer that
extends BasicTrainer (and its FSDP and tensor-parallel subclasses) to sample completions from the policy each step, label
them with a scorer or judge, train on the labelled pairs and log TRL's metrics."""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Callable

import numpy as np
import torch

import losses
import trainers
import utils
from evaluation import rewards
from evaluation.sampling import append_rows, completion_mask, completion_texts, generate
from runs import checkpoints, checks, tracking


class JudgeFailureError(trainers.RunStoppedError):
    """Too many of online DPO's judgements failed since the last eval; the message names the checkpoint kept."""


class OnlineSampling:
    """Online DPO's sampling, labelling and evaluation over a trainer of trainers.py (its ``policy``, ``tokenizer``,
    ``config``, ``stop_ids`` and parallel hooks): :class:`OnlineDPOTrainer` and its FSDP and tensor-parallel kin."""

    train_rewards = "rewards"  # TRL's OnlineDPOTrainer's metric names

    # ---- BasicTrainer's hooks

    def step_pairs(self, batch: dict, weight: float, collected: dict, n_examples: float) -> tuple[dict, float]:
        """This step's sampled and labelled pairs (:meth:`labelled_batch`); only labelled pairs count."""
        batch, n_examples = self.labelled_batch(batch, weight, collected)
        self.step_tokens = int(self.dist.global_sum(tracking.count_tokens(batch) * weight))
        return batch, n_examples

    def batch_loss(self, batch: dict, inputs, per_example: torch.Tensor, normaliser: float, metrics: dict):
        """Ties (with ties=skip) and failed judgements weigh 0 (:meth:`weighted_loss`); pairs without weights all count."""
        if "weight" not in batch:  # pairs read from a file, not sampled and labelled here
            return super().batch_loss(batch, inputs, per_example, normaliser, metrics)
        return self.weighted_loss(batch, inputs, per_example, normaliser, metrics)

    def train_step(self, batch: dict) -> dict:
        """BasicTrainer's step on this step's sampled pairs, its failed judgements counted toward the next eval's report."""
        collected = super().train_step(batch)
        self.count_judgements(collected)
        return collected

    def evaluate(self) -> dict:
        """:meth:`evaluate_online`: the eval prompts' sampled completions scored, not eval pairs."""
        return self.evaluate_online()

    def after_eval(self) -> Callable[[str], None] | None:
        """:meth:`judge_report`, whose stop sentence is raised as JudgeFailureError once the checkpoint is written."""
        report = self.judge_report()
        if report is None:
            return None

        def stop(checkpoint: str) -> None:
            raise JudgeFailureError(report(checkpoint))

        return stop

    def save(self) -> str:
        """Every rank's judge and sampling RNG gathered (:meth:`collect_rank_states`), then BasicTrainer's save."""
        self.collect_rank_states()  # a collective, before trainer_state.pt is written
        return super().save()

    def trainer_state(self) -> dict:
        """BasicTrainer's state and ``online``: each rank's judge (RNG, failures) and sampling RNG."""
        return {**super().trainer_state(), "online": self.online_state()}

    def restore_trainer_state(self, state: dict) -> None:
        """BasicTrainer's restore, then :meth:`restore_online_state`."""
        super().restore_trainer_state(state)
        self.restore_online_state(state.get("online"))

    # ---- online DPO's own

    scorer = None  # a rewards scorer (.score) or pairwise judge (.judge), local, or on Ray actors (set by ray_launcher)

    def __init__(self, *args, scorer=None, **kwargs):
        """BasicTrainer's arguments, and ``scorer``: what labels the sampled pairs (None: Ray's actors, attached later)."""
        super().__init__(*args, **kwargs)
        self.scorer = scorer

    @classmethod
    def made_before_models(cls, config) -> dict:
        """The scorer or judge ``config.online`` names, built before the run folder so that a bad one fails fast (none
        when Ray's reward actors label the pairs: ray_launcher attaches them)."""
        if config.launcher == "ray" and config.ray.reward_workers > 0:
            return {"scorer": None}
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        return {"scorer": rewards.build_scorer(config, device=device)}

    judged_since_eval = 0  # pairs sent to the scorer or judge since the last eval, over all ranks
    failed_since_eval = 0  # of those, failed judgements (an error, an answer neither 0 nor 1, a NaN score)
    judge_error: str | None = None  # why this rank's latest judgement failed (an example for the stop sentence)
    rank_states: list | None = None  # every rank's rank_state in rank order (collect_rank_states), for trainer_state.pt

    def rank_state(self) -> dict:
        """This rank's resume state: ``judge`` (the judge's ``state_dict`` or None) and ``torch_rng`` /
        ``cuda_rng`` (ranks' sampling RNGs drift apart, so each is kept)."""
        state_dict = getattr(self.scorer, "state_dict", None)
        return {
            "judge": state_dict() if callable(state_dict) else None,
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        }

    def collect_rank_states(self) -> None:
        """Gather every rank's :meth:`rank_state` into :attr:`rank_states` (a collective: every rank calls it when saving)."""
        self.rank_states = self.dist.gather_per_rank({"ranks": [self.rank_state()]})["ranks"]

    def online_state(self) -> dict | None:
        """What trainer_state.pt keeps of online DPO: every rank's :meth:`rank_state`, the failure counts."""
        return {
            "ranks": self.rank_states,
            "judged_since_eval": self.judged_since_eval,
            "failed_since_eval": self.failed_since_eval,
        }

    def restore_online_state(self, state: dict | None) -> None:
        """Restore :meth:`online_state`'s saving: this rank's judge and sampling RNG, and the counts."""
        if not state:
            return
        self.judged_since_eval, self.failed_since_eval = int(state["judged_since_eval"]), int(state["failed_since_eval"])
        ranks = state.get("ranks") or []
        if self.dist.rank >= len(ranks):  # resumed on more ranks than saved: the shared RNG state stays
            return
        mine = ranks[self.dist.rank]
        if mine["judge"] is not None and callable(getattr(self.scorer, "load_state_dict", None)):
            self.scorer.load_state_dict(mine["judge"])
        torch.set_rng_state(mine["torch_rng"])
        if mine["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(mine["cuda_rng"])

    def count_judgements(self, metrics: dict) -> None:
        """Add a step's gathered ``online/failed_judgements`` (one 0/1 per pair) to the counts since the last eval."""
        failed = metrics.get("online/failed_judgements", [])
        self.judged_since_eval += len(failed)
        self.failed_since_eval += int(sum(failed))

    def judge_report(self) -> Callable[[str], str] | None:
        """At an eval: print the share of failed judgements since the last one, reset the counts, and return
        the stop sentence for a checkpoint path when none was labelled or the share exceeds ``online.max_failure_rate``."""
        failed, judged = self.failed_since_eval, self.judged_since_eval
        self.failed_since_eval = self.judged_since_eval = 0
        if not judged:
            return None
        limit = float(self.config.online.max_failure_rate)
        share = failed / judged
        if self.dist.is_main:
            print(
                f"[judge] after {self.example_counter} examples: {failed} of {judged} judgements failed since the last eval "
                f"({share:.0%}; online.max_failure_rate={limit:g})"
            )
        if failed < judged and share <= limit:
            return None
        example = f"; e.g. {self.judge_error}" if self.judge_error else ""
        what = (
            f"no pair could be labelled since the last eval (all {judged} judgements failed{example})"
            if failed == judged
            else f"{failed} of {judged} judgements since the last eval failed ({share:.0%} > online.max_failure_rate={limit:g}{example})"
        )
        scorer, run_dir = self.config.online.scorer, self.run_dir
        return lambda checkpoint: (  # not str.format: the judge's reason may hold braces (JSON, code)
            f"Training stopped: {what}; the checkpoint {checkpoint} is kept: fix the judge, reward model or reward function "
            f"(online.scorer={scorer}), then continue with resume={run_dir}."
        )

    @torch.no_grad()
    def sample_completions(self, batch: dict, n_per_prompt: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample ``n_per_prompt`` completions per left-padded prompt with ``online.*`` in eval mode: returns
        (prompt_ids (B, P), prompt_mask (B, P), completions (B * n_per_prompt, T) on the CPU), row i * n_per_prompt + j
        answering prompt i."""
        cfg = self.config.online
        ids, mask = batch["prompt_input_ids"], batch["prompt_attention_mask"]
        width = int(mask.sum(1).max())
        ids, mask = ids[:, ids.shape[1] - width :], mask[:, mask.shape[1] - width :]
        completions, _ = generate(
            self.policy,
            ids,
            mask,
            self.stop_ids,
            self.tokenizer.pad_token_id,
            device=self.device,
            as_config=True,
            generate_kwargs=dict(self.generate_kwargs),
            do_sample=True,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            max_new_tokens=cfg.max_new_tokens,
            num_return_sequences=n_per_prompt,
        )
        return ids, mask, completions

    def online_pairs(self, batch: dict) -> tuple[dict, dict]:
        """Two completions per prompt labelled by the scorer (Guo et al. 2024, Algorithm 1): returns a collated
        batch of B pairs with ``weight`` (B,) (0 for a failed judgement or a skipped tie; none dropped, so FSDP ranks match)
        and metric lists."""
        from preference_datasets import collate

        cfg = self.config.online
        eos, pad = self.stop_ids, self.tokenizer.pad_token_id
        prompts = list(batch["prompt"])
        ids, mask, completions = self.sample_completions(batch, 2)
        cmask = completion_mask(completions, eos)
        has_eos = (torch.isin(completions, torch.tensor(eos, device=completions.device)) & cmask).any(1)  # on its device (GPU)
        texts = completion_texts(self.tokenizer, row_prompts(ids, mask, 2), completions, cmask, eos)
        preferences, scores = label_pairs(
            self.scorer, prompts, texts, completions, cmask, eos, cfg.missing_eos_penalty, batch.get("fields")
        )
        errors = getattr(self.scorer, "last_errors", None)
        if errors:
            self.judge_error = errors[-1]
        elif scores is not None and None in preferences:
            self.judge_error = "a NaN score"

        coin = random.Random(f"{self.config.seed}-{self.batch_counter}-{self.dist.rank}")  # reproducible on resume
        elements, weights, ties, failed, order = [], [], [], [], []
        for i, preference in enumerate(preferences):
            ties.append(float(preference == rewards.TIE))
            failed.append(float(preference is None))
            weight = 1.0
            if preference is None or (preference == rewards.TIE and cfg.ties == "skip"):
                preference, weight = 0, 0.0
            elif preference == rewards.TIE:
                preference = int(coin.random() < 0.5)
            weights.append(weight)
            first, second = 2 * i + preference, 2 * i + 1 - preference  # chosen, rejected rows
            order.append((first, second))
            prompt_ids = ids[i][mask[i].bool()].tolist()
            element = {"prompt": prompts[i], "prompt_input_ids": prompt_ids}
            for side, row in (("chosen", first), ("rejected", second)):
                response = completions[row][cmask[row]].tolist()
                element[f"{side}_input_ids"] = prompt_ids + response
                element[f"{side}_attention_mask"] = [1] * (len(prompt_ids) + len(response))
                element[f"{side}_labels"] = [losses.IGNORE_INDEX] * len(prompt_ids) + response
            elements.append(element)
        pairs = collate(elements, pad)
        pairs["weight"] = torch.tensor(weights)
        metrics = {
            "val/contain_eos_token": has_eos.float().tolist(),
            "online/ties": ties,
            "online/failed_judgements": failed,
            "online/labelled_pairs": weights,
            "online/completion_length": cmask.sum(1).float().tolist(),
        }
        if scores is not None:
            flat = scores.view(-1)
            pairs["chosen_scores"] = flat[[c for c, _ in order]]
            pairs["rejected_scores"] = flat[[r for _, r in order]]
            metrics["objective/scores"] = flat.tolist()
            metrics["objective/scores_margin"] = (pairs["chosen_scores"] - pairs["rejected_scores"]).tolist()
        return pairs, metrics

    def labelled_batch(self, batch: dict, weight: float, collected: dict) -> tuple[dict, float]:
        """This step's sampled and labelled pairs, and how many count over all ranks (at least 1); sampling metrics into ``collected``."""
        batch, sampled = self.online_pairs(batch)
        n_examples = max(self.dist.global_sum(float(batch["weight"].sum()) * weight), 1.0)
        if weight:
            for k, v in sampled.items():
                collected[k].extend(v)
        return batch, n_examples

    def weighted_loss(self, batch: dict, inputs, per_example: torch.Tensor, normaliser: float, metrics: dict):
        """The loss of online pairs, each weighted by ``batch["weight"]`` (0: a tie or failed judgement), and which pairs count."""
        weight = batch["weight"].to(per_example.device)
        n_tokens = torch.cat([inputs.chosen_n_tokens, inputs.rejected_n_tokens])
        metrics.update(
            self.online_metrics(
                batch, inputs.policy_chosen_logps, inputs.policy_rejected_logps, inputs.reference_chosen_logps,
                inputs.reference_rejected_logps, n_tokens, self.beta,
            )
        )  # fmt: skip
        return (per_example * weight).sum() / normaliser, weight > 0

    def online_metrics(self, batch, policy_chosen, policy_rejected, ref_chosen, ref_rejected, n_tokens, beta: float) -> dict:
        """TRL's OnlineDPOTrainer statistics, one value per completion (chosen, then rejected):
        ``objective/kl``, ``objective/entropy``, ``objective/non_score_reward`` (-beta kl), ``objective/rlhf_reward``, in nats
        on summed log-probs."""
        policy = torch.cat([policy_chosen, policy_rejected]).detach().float()
        reference = torch.cat([ref_chosen, ref_rejected]).float()
        if self.average_log_prob:
            policy, reference = policy * n_tokens, reference * n_tokens
        kl = (policy - reference).cpu()
        metrics = {
            "objective/kl": kl.tolist(),
            "objective/entropy": (-policy).cpu().tolist(),
            "objective/non_score_reward": (-beta * kl).tolist(),
            "beta": [beta],
        }
        if "chosen_scores" in batch:
            scores = torch.cat([batch["chosen_scores"], batch["rejected_scores"]]).float()
            metrics["objective/rlhf_reward"] = (scores - beta * kl).tolist()
        return metrics

    @torch.no_grad()
    def evaluate_online(self) -> dict:
        """Sample one completion per eval prompt (seeded, training RNG untouched), log ``eval/scores``,
        ``eval/contain_eos_token`` and ``eval/completion_length``, and write the first ``online.n_log_completions``."""
        scorer = self.scorer if hasattr(self.scorer, "score") else getattr(self.scorer, "scorer", None)
        eos = self.stop_ids
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        rows, start = [], 0
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.config.seed + 1 + self.dist.data_rank)  # tensor-parallel peers sample alike
            for global_batch in self.eval_batches:
                n = len(global_batch["prompt"])
                batch, weight = self.dist.local_batch({**global_batch, "index": list(range(start, start + n))})
                start += n
                ids, mask, completions = self.sample_completions(batch, 1)
                cmask = completion_mask(completions, eos)
                texts = completion_texts(self.tokenizer, row_prompts(ids, mask, 1), completions, cmask, eos)
                fields = rewards.field_columns(batch.get("fields") or [])
                scores = (
                    scorer.score(list(batch["prompt"]), texts, **fields).float().tolist()
                    if scorer is not None
                    else [None] * len(texts)
                )
                if not weight:
                    continue
                for i, text in enumerate(texts):
                    rows.append(
                        {
                            "index": batch["index"][i],
                            "prompt": batch["prompt"][i],
                            "completion": text,
                            "score": None if scores[i] != scores[i] else scores[i],  # NaN: a failed score
                            "contain_eos": bool(
                                (torch.isin(completions[i], torch.tensor(eos, device=completions.device)) & cmask[i]).any()
                            ),
                            "length": int(cmask[i].sum()),
                        }
                    )
        rows = sorted(self.dist.gather_metrics({"rows": rows})["rows"], key=lambda r: r["index"])
        means = {
            "eval/contain_eos_token": float(np.mean([r["contain_eos"] for r in rows])),
            "eval/completion_length": float(np.mean([r["length"] for r in rows])),
        }
        if scorer is not None:
            scored = [r["score"] for r in rows if r["score"] is not None]
            means["eval/scores"] = float(np.mean(scored)) if scored else float("nan")  # over the completions that were scored
        if self.dist.is_main:
            self.logger.log(means, step=self.example_counter)
            table = [
                {"step": self.example_counter, "prompt": r["prompt"], "completion": r["completion"], "score": r["score"]}
                for r in rows[: self.config.online.n_log_completions]
            ]
            write_completions(self.run_dir, table)
            cols = ["step", "prompt", "completion", "score"]
            self.logger.log_table("completions", cols, [[r[c] for c in cols] for r in table], self.example_counter)
            print(f"[eval] after {self.example_counter} examples: {tracking.formatted_dict(means)}")
        return means


def row_prompts(ids: torch.Tensor, mask: torch.Tensor, n: int) -> list[list[int]]:
    """The unpadded prompt ids of each completion row when the (B, P) ``ids`` / ``mask`` were sampled ``n`` times each
    (row j answers prompt j // n)."""
    return [row[m.bool()].tolist() for row, m in zip(ids, mask) for _ in range(n)]


def label_pairs(
    scorer,
    prompts: list[str],
    texts: list[str],
    completions: torch.Tensor,
    mask: torch.Tensor,
    eos_token_id: int | list[int],
    missing_eos_penalty: float | None,
    fields: list[dict] | None = None,
) -> tuple[list[int | None], torch.Tensor | None]:
    """Per pair of ``texts`` (rows 2i, 2i+1 answer prompt i) 0, 1, ``rewards.TIE`` or None (failed), by a judge or by
    scores after ``missing_eos_penalty``; returns (preferences, scores (B, 2) float32 or None for a judge)."""
    pairs = [(texts[2 * i], texts[2 * i + 1]) for i in range(len(prompts))]
    if not hasattr(scorer, "score"):
        return list(scorer.judge(prompts, pairs)), None
    columns = rewards.field_columns([f for f in fields or [] for _ in range(2)])
    scores = scorer.score([p for p in prompts for _ in range(2)], texts, **columns).float().cpu()
    scores = rewards.apply_missing_eos_penalty(scores, completions, eos_token_id, missing_eos_penalty, mask).view(-1, 2)
    preferences = [
        None if math.isnan(a) or math.isnan(b) else 0 if a > b else 1 if b > a else rewards.TIE for a, b in scores.tolist()
    ]
    return preferences, scores


def write_completions(run_dir: str, rows: list[dict]) -> None:
    """Append (step, prompt, completion, score) rows to the run's ``completions.jsonl`` and rewrite ``completions.html``."""
    import html

    path = os.path.join(run_dir, "completions.jsonl")
    then = checkpoints.resume_hint(run_dir)
    append_rows(path, rows, then)
    with open(path) as f:
        everything = [json.loads(line) for line in f if line.strip()]
    cols = ["step", "prompt", "completion", "score"]
    cells = lambda row: "".join(f"<td>{html.escape(str(row.get(c, '')))}</td>" for c in cols)  # noqa: E731
    body = "\n".join(f"<tr>{cells(r)}</tr>" for r in everything)
    page = (
        "<!doctype html><meta charset='utf-8'><title>completions</title>"
        "<style>td{vertical-align:top;white-space:pre-wrap;border:1px solid #ccc;padding:4px}</style>"
        f"<table><tr>{''.join(f'<th>{c}</th>' for c in cols)}</tr>\n{body}</table>\n"
    )
    with utils.replacing(os.path.join(run_dir, "completions.html"), then) as tmp, open(tmp, "w") as f:
        f.write(page)


class OnlineDPOTrainer(OnlineSampling, trainers.BasicTrainer):
    """Online DPO on one process (``online.enabled=true`` with ``trainer=BasicTrainer``)."""


class OnlineFSDPTrainer(OnlineSampling, trainers.FSDPTrainer):
    """Online DPO under FSDP (``trainer=FSDPTrainer``)."""


class OnlineTensorParallelTrainer(OnlineSampling, trainers.TensorParallelTrainer):
    """Online DPO under tensor parallelism (``trainer=TensorParallelTrainer``)."""


ONLINE_TRAINERS = {
    "BasicTrainer": OnlineDPOTrainer,
    "FSDPTrainer": OnlineFSDPTrainer,
    "TensorParallelTrainer": OnlineTensorParallelTrainer,
}


def online_trainer(config, cls: type) -> type:
    """``cls`` (config.trainer's class) as online DPO's trainer on the same parallelism when ``online.enabled``."""
    return ONLINE_TRAINERS[cls.__name__] if checks.online_enabled(config) else cls
