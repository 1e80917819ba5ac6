"""bench_dpo.py's worker for TRL's side: TRL 1.16's DPOTrainer fed our token ids, timed per step."""

from __future__ import annotations

import json
import tempfile
import time

from measure import _mark, _opt_desc, _rss_now_mib, _set_threads, _steady


def trl_common_args(config_class, spec: dict, out_dir: str) -> dict:
    """The TRL config arguments every benchmark's TRL side shares (DPOConfig, SFTConfig): the
    spec's batch, steps, lr, clipping, optimizer, dtype and activation checkpointing, a constant
    schedule without warm-up or weight decay, sequential batches, and nothing saved, evaluated
    or reported."""
    dtype = spec.get("dtype", "float32")
    return dict(
        output_dir=out_dir,
        per_device_train_batch_size=spec["batch_size"],
        gradient_accumulation_steps=1,
        max_steps=spec["warmup"] + spec["steps"],
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=spec["max_grad_norm"],
        optim=spec["trl_optim"],
        bf16=dtype == "bfloat16",
        fp16=False,
        **trl_checkpointing_args(config_class, spec.get("activation_checkpointing", False)),
        max_length=spec["max_length"],
        train_sampling_strategy="sequential",
        seed=spec["seed"],
        use_cpu=not spec.get("cuda", False),
        model_init_kwargs={"dtype": dtype},  # TRL's default float32; bench_gpu_dpo.py: bfloat16 like ours
        dataloader_pin_memory=False,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        logging_steps=10,  # TRL's default
    )


def trl_checkpointing_args(config_cls, on: bool) -> dict:
    """The TrainingArguments keys that turn activation checkpointing of the policy on or off,
    explicitly: TRL's configs default to ``gradient_checkpointing=True``, and transformers 5.24
    renamed the field to ``activation_checkpointing`` (the old name a deprecated alias). When on,
    non-reentrant, as ours (trainers.BasicTrainer: ``use_reentrant=False``)."""
    import dataclasses

    name = "activation_checkpointing" if "activation_checkpointing" in {f.name for f in dataclasses.fields(config_cls)} else None
    name = name or "gradient_checkpointing"
    return {name: on, f"{name}_kwargs": {"use_reentrant": False} if on else None}


def trl_lora_config(spec: dict):
    """peft's LoraConfig from ``spec["lora"]`` ({r, alpha, dropout, target_modules}), or None."""
    lora = spec.get("lora")
    if not lora:
        return None
    from peft import LoraConfig

    return LoraConfig(
        r=lora["r"],
        lora_alpha=lora["alpha"],
        lora_dropout=lora["dropout"],
        target_modules=lora["target_modules"],
        bias="none",
        task_type="CAUSAL_LM",
    )


def _trl_trainer(spec: dict, out_dir: str, callbacks=()):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    class BenchDPOTrainer(DPOTrainer):
        """DPOTrainer, fed our token ids: a dataset that already holds prompt_ids /
        chosen_ids / rejected_ids (what DataCollatorForPreference reads) is used as is."""

        precompute_s = 0.0

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            if {"prompt_ids", "chosen_ids", "rejected_ids"} <= set(dataset.column_names):
                return dataset
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

        def _precompute_ref_logps(self, dataset, name, batch_size):
            t0 = time.perf_counter()
            out = super()._precompute_ref_logps(dataset, name, batch_size)
            self.precompute_s += time.perf_counter() - t0
            return out

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if model.training:
                self.bench_losses.append((loss[0] if return_outputs else loss).detach())
            return loss

    with open(spec["pairs_file"]) as f:
        pairs = json.load(f)
    dataset = Dataset.from_dict({k: [p[k] for p in pairs] for k in ("prompt_ids", "chosen_ids", "rejected_ids")})
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"], trust_remote_code=False)
    args = DPOConfig(
        **trl_common_args(DPOConfig, spec, out_dir),
        beta=spec["beta"],
        loss_type=["sigmoid"],
        precompute_ref_log_probs=spec["mode"] == "precomputed",
    )
    trainer = BenchDPOTrainer(
        model=spec["model_dir"],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=list(callbacks),
        peft_config=trl_lora_config(spec),  # with LoRA, TRL's reference is the policy with its adapters disabled
    )
    trainer.bench_losses = []
    check_trl_trainer(trainer, spec)
    return trainer


def check_trl_trainer(trainer, spec: dict) -> None:
    """Assert that a built TRL trainer runs what ``spec`` asks: the dtype, bf16 or not,
    activation checkpointing on the model itself, and LoRA (a peft model) or full training."""
    import torch

    model = trainer.model
    assert model.dtype == getattr(torch, spec.get("dtype", "float32")), model.dtype
    assert trainer.args.bf16 == (spec.get("dtype", "float32") == "bfloat16")
    checkpointing = spec.get("activation_checkpointing", False)
    assert bool(trainer.args.gradient_checkpointing) == checkpointing, trainer.args.gradient_checkpointing
    assert hasattr(model, "peft_config") == bool(spec.get("lora")), type(model)


def worker_trl(spec: dict, build=None) -> dict:
    """A TRL trainer (``build(spec, out_dir, callbacks)``, default :func:`_trl_trainer`) trained
    for warmup + steps steps; the step times from its on_step_end callbacks."""
    _set_threads(spec["threads"])
    import torch
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.marks: list[float] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.marks.append(_mark())
            self.rss_setup = _rss_now_mib()

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append(_mark())

    clock = Clock()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = (build or _trl_trainer)(spec, tmp, callbacks=[clock])
        trainer.train()
        timing = _steady(clock.marks, spec["warmup"])
        threads = torch.get_num_threads()
    return {
        **timing,
        "losses": [float(x) for x in trainer.bench_losses],
        "precompute_s": trainer.precompute_s if spec["mode"] == "precomputed" else None,
        "rss_setup": clock.rss_setup,
        "threads": threads,
        "optimizer": _opt_desc(trainer.optimizer),
    }
