"""What each eval adds while training (registered with trainers.py on import; train.py imports it): the policy's greedy answers
to the eval prompts scored by ``eval_reward_functions`` (``answers_eval/*``), and completions sampled from the policy and
the reference (samples.jsonl, samples.md, W&B tables)."""

from __future__ import annotations

import contextlib
import math
import os
import weakref

import numpy as np
import torch

import trainers
import utils
from evaluation import reward_functions, rewards, sampling
from modeling import models
from preference_datasets import declared_reward_functions, left_pad, stacked_model_inputs
from runs import checkpoints, tracking, trainer_checkpoint
from trainers import split_batch


def eval_means(trainer) -> dict:
    """``answers_eval/*`` when ``eval_reward_functions`` names any, after writing samples when ``sample_during_eval``;
    nothing for a reward model, which does not generate."""
    if trainer.objective.score_head:
        return {}
    config = trainer.config
    if trainer not in ANSWER_SCORERS:  # built at the first eval, kept for the trainer's life
        ANSWER_SCORERS[trainer] = answer_scorers(config)
    functions = ANSWER_SCORERS[trainer]
    means = score_answers(trainer, functions) if functions else {}
    if config.sample_during_eval:
        sample(trainer)
    return means


ANSWER_SCORERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # trainer -> its answer_scorers


def answer_scorers(config) -> list:
    """(name, scorer) for each function ``config.eval_reward_functions`` names: one scorer per function, each reported
    on its own."""
    declared = declared_reward_functions(config.datasets)
    functions = reward_functions.eval_functions(config.eval_reward_functions, declared)
    return [(name, rewards.RewardFunctionScorer([name], [fn], [1.0])) for name, fn in functions]


def eval_prompts(trainer, n: int | None = None, images: list | None = None) -> tuple[list[str], list[list[int]], list[dict]]:
    """The first ``n`` (all: None) eval prompts, their unpadded ids (eval batches are padded to different widths) and
    their rows' other columns; ``images``, if given, gets each prompt's ``model_inputs`` (None for a text prompt)."""
    prompts, ids, fields = [], [], []
    for batch in trainer.eval_batches:
        prompts.extend(batch["prompt"])
        ids.extend(row[m.bool()].tolist() for row, m in zip(batch["prompt_input_ids"], batch["prompt_attention_mask"]))
        fields.extend(batch.get("fields") or [{}] * len(batch["prompt"]))
        if images is not None:
            images.extend(batch.get("model_inputs") or [None] * len(batch["prompt"]))
        if n is not None and len(prompts) >= n:
            break
    if images is not None:
        del images[len(prompts[:n]) :]
    return prompts[:n], ids[:n], fields[:n]


def with_images(generate_kwargs: dict, model_inputs: list, device) -> dict:
    """``generate_kwargs`` with the prompts' images (their ``model_inputs``, vision/) batched in row order, if any."""
    if not model_inputs or model_inputs[0] is None:
        return dict(generate_kwargs)
    return dict(generate_kwargs) | {k: v.to(device) for k, v in stacked_model_inputs(model_inputs).items()}


@torch.no_grad()
def score_answers(trainer, answer_functions: list) -> dict:
    """The policy's greedy answers to the eval prompts, scored by each ``(name, scorer)`` of ``answer_functions``:
    ``answers_eval/<name>`` (mean score over the prompts it scored), ``answers_eval/<name>_failed`` (share
    not scorable), ``answers_eval/ended`` (share stopped at EOS within ``max_length - max_prompt_length`` tokens)."""
    images: list = []
    prompts, ids, fields = eval_prompts(trainer, images=images)
    world, size = trainer.dist.data_world_size, trainer.config.eval_batch_size
    part = split_batch({"prompt": prompts, "ids": ids, "fields": fields, "images": images}, world)
    empty = {"prompt": [], "ids": [], "fields": [], "images": []}
    mine = part[trainer.dist.data_rank] if trainer.dist.data_rank < len(part) else empty
    n_calls = math.ceil(math.ceil(len(prompts) / world) / size)  # the same on every rank: FSDP's generate is collective
    pad_id = trainer.tokenizer.pad_token_id
    rows = []
    for call in range(n_calls):
        chunk_prompts, chunk_ids = (
            mine["prompt"][call * size : (call + 1) * size],
            mine["ids"][call * size : (call + 1) * size],
        )
        stand_in = not chunk_prompts  # this rank has no prompts left: generate for one, keep nothing
        batch_ids, masks = left_pad(chunk_ids or ids[:1], pad_id)
        chunk_images = mine["images"][call * size : (call + 1) * size] if chunk_prompts else images[:1]
        completions, mask = sampling.generate(
            trainer.policy,
            batch_ids,
            masks,
            trainer.stop_ids,
            pad_id,
            device=trainer.device,
            generate_kwargs=with_images(trainer.generate_kwargs, chunk_images, trainer.device),
            max_new_tokens=max(1, trainer.config.max_length - trainer.config.max_prompt_length),  # the same for every prompt
            do_sample=False,
        )
        if stand_in:
            continue
        texts = sampling.completion_texts(trainer.tokenizer, chunk_ids, completions, mask, trainer.stop_ids)
        ended = [bool(torch.isin(c[m], torch.tensor(trainer.stop_ids)).any()) for c, m in zip(completions, mask)]
        # the eval rows' other columns, as fields
        columns = rewards.field_columns(mine["fields"][call * size : (call + 1) * size])
        for name, scorer in answer_functions:
            scores = scorer.score(chunk_prompts, texts, **columns).tolist()  # NaN: not scorable
            rows.extend({"function": name, "score": score} for score in scores)
        rows.extend({"function": None, "ended": e} for e in ended)
    rows = trainer.dist.gather_metrics({"rows": rows})["rows"]
    means = {}
    for name, _ in answer_functions:
        scores = [r["score"] for r in rows if r["function"] == name]
        scored = [s for s in scores if math.isfinite(s)]
        means[f"answers_eval/{name}"] = float(np.mean(scored)) if scored else float("nan")
        if len(scored) < len(scores):
            means[f"answers_eval/{name}_failed"] = 1 - len(scored) / len(scores)
    ended = [r["ended"] for r in rows if r["function"] is None]
    means["answers_eval/ended"] = float(np.mean(ended)) if ended else float("nan")
    means["answers_eval/n"] = len(ended)  # the prompts answered (the means' sample size)
    return means


@torch.no_grad()
def sample(trainer) -> list[dict]:
    """Sample completions from the policy (and the reference, if any) for the first
    ``n_eval_model_samples`` eval prompts; append them to ``samples.jsonl`` and
    ``samples.md`` in the run folder and log them as W&B tables."""
    images: list = []
    prompts, ids, _ = eval_prompts(trainer, trainer.config.n_eval_model_samples, images)
    part = split_batch({"prompt": prompts, "ids": ids, "images": images}, trainer.dist.data_world_size)
    stand_in = {"prompt": prompts[:1], "ids": ids[:1], "images": images[:1]}
    mine = part[trainer.dist.data_rank] if trainer.dist.data_rank < len(part) else stand_in
    pad_id = trainer.tokenizer.pad_token_id
    prompts, (ids, masks) = mine["prompt"], left_pad(mine["ids"], pad_id)  # to the longest prompt here
    samplers = {"policy": trainer.policy}
    if trainer.reference_model is not None or (trainer.peft_model is not None and trainer.uses_reference):
        samplers["reference"] = trainer.reference_model  # None: the LoRA policy with its adapters off
    completions = {}
    for name, model in samplers.items():
        with models.adapters_off(trainer.peft_model) if model is None else contextlib.nullcontext(model) as model:
            out, _ = sampling.generate(
                model,
                ids,
                masks,
                trainer.stop_ids,
                pad_id,
                device=trainer.device,
                generate_kwargs=with_images(trainer.generate_kwargs, mine["images"], trainer.device),
                max_new_tokens=trainer.config.max_length - ids.shape[1],
                do_sample=True,
                top_p=trainer.config.sample_top_p,
            )
        completions[name] = sampling.decode_completions(trainer.tokenizer, out, trainer.stop_ids)
        if name == "reference":
            trainer.dist.reshard(trainer.reference_model)
    rows = [
        {"step": trainer.example_counter, "prompt": p, **{k: v[i] for k, v in completions.items()}} for i, p in enumerate(prompts)
    ]
    if trainer.dist.data_rank >= len(part):
        rows = []  # a stand-in: more processes than samples
    rows = trainer.dist.gather_metrics({"rows": rows})["rows"]
    if not trainer.dist.is_main:
        return rows
    sampling.append_rows(os.path.join(trainer.run_dir, "samples.jsonl"), rows, checkpoints.resume_hint(trainer.run_dir))
    write_samples_md(trainer.run_dir)
    for name in completions:
        trainer.logger.log_table(
            f"{name}_samples",
            ["step", "prompt", "sample"],
            [[r["step"], r["prompt"], r[name]] for r in rows],
            trainer.example_counter,
        )
    return rows


def write_samples_md(run_dir: str) -> None:
    """Rewrite ``samples.md`` from ``samples.jsonl`` (atomically; a full disk: utils.DiskFullError):
    a table per eval, its prompts and each model's sample; nothing when there are no samples."""
    path = os.path.join(run_dir, "samples.jsonl")
    if not os.path.exists(path):
        return
    sections: dict[int, list[dict]] = {}
    for row in tracking.jsonl_records(path):
        sections.setdefault(row["step"], []).append(row)
    tmp = os.path.join(run_dir, f".samples.md.tmp-{os.getpid()}")
    then = checkpoints.resume_hint(run_dir)
    with utils.replacing(os.path.join(run_dir, "samples.md"), then, tmp), open(tmp, "w") as f:
        for step, rows in sections.items():
            cols = ["prompt", *(k for k in rows[0] if k not in ("step", "prompt"))]
            f.write(f"\n## after {step} examples\n\n| {' | '.join(cols)} |\n|{'---|' * len(cols)}\n")
            for row in rows:
                f.write("| " + " | ".join(_md_cell(row.get(c, "")) for c in cols) + " |\n")


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", "<br>")


trainers.EVAL_EXTENSIONS.append(eval_means)
trainer_checkpoint.REWIND_EXTENSIONS.append(write_samples_md)
