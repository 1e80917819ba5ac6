"""bench_memory.py's workers (in subprocesses): bench_dpo.py's, with the trainer checked first; TRL's SFTTrainer; the SFT collator check."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import dpo_prepare
import our_worker
import trl_worker

REPO = dpo_prepare.REPO


def checkpointing_on(model) -> bool:
    """Whether activation checkpointing is on in ``model`` (a transformers model, maybe wrapped
    by peft): ``is_activation_checkpointing`` (transformers 5.24), else ``is_gradient_checkpointing``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    on = getattr(base, "is_activation_checkpointing", None)
    return bool(getattr(base, "is_gradient_checkpointing", False) if on is None else on)


def check_our_trainer(trainer, spec: dict) -> dict:
    """Assert that our BasicTrainer runs what ``spec`` asks (activation checkpointing on the
    policy, LoRA or full training, a live reference for full DPO and no second model with LoRA
    or for SFT); return its parameter counts and its malloc_mmap_threshold_mib."""
    policy = trainer.policy
    ac = spec["activation_checkpointing"]
    assert checkpointing_on(policy) == ac, "activation checkpointing not as asked"
    named = dict(policy.named_parameters())
    trainable = sum(p.numel() for p in named.values() if p.requires_grad)
    total = sum(p.numel() for p in named.values())
    if spec["lora"]:
        assert hasattr(policy, "peft_config"), f"LoRA asked, but the policy is a {type(policy).__name__}, not a peft model"
        frozen_base = all(("lora_" in n) == p.requires_grad for n, p in named.items())
        assert frozen_base and trainable, "LoRA asked, but what trains is not exactly the adapters"
        assert trainer.reference_model is None or trainer.reference_model is policy, "LoRA: a second model was loaded"
    else:
        assert trainable == total, "full fine-tuning asked, but some parameters are frozen"
        assert (trainer.reference_model is not None) == (spec["task"] == "dpo"), "full DPO needs its live reference"
    assert trainer.config.loss.name == spec["task"]
    malloc = trainer.config.get("malloc_mmap_threshold_mib")
    return {"n_params": total, "n_trainable": trainable, "malloc_mmap_threshold_mib": malloc}


def worker_ours(spec: dict) -> dict:
    """our_worker.worker_ours (collate + BasicTrainer.train_step, timed per step), with the trainer
    checked by :func:`check_our_trainer` first."""
    built = {}
    make = our_worker._our_trainer

    def checked(spec_, run_dir):
        trainer, elements, precompute_s = make(spec_, run_dir)
        built.update(check_our_trainer(trainer, spec_))
        return trainer, elements, precompute_s

    preload = spec.get("env", {}).get("LD_PRELOAD")
    if preload:  # --ours-preload: the allocator is in this process, not only in its environment
        maps = Path("/proc/self/maps").read_text()
        assert Path(preload).name in maps, f"LD_PRELOAD={preload} is not loaded in the worker"
    our_worker._our_trainer = checked
    try:
        out = our_worker.worker_ours(spec)
    finally:
        our_worker._our_trainer = make
    return {**out, **built}


def _checkpointing_check(spec: dict):
    """A TrainerCallback asserting, at the first step, that the model being trained has activation
    checkpointing on exactly when ``spec`` asks (transformers turns it on inside train())."""
    from transformers import TrainerCallback

    class Check(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 1:
                on = checkpointing_on(model)
                assert on == spec["activation_checkpointing"], f"TRL's activation checkpointing is {on}"

    return Check()


def worker_trl(spec: dict) -> dict:
    """trl_worker.worker_trl: TRL's DPOTrainer (with spec's LoRA and checkpointing), timed per step."""
    return trl_worker.worker_trl(
        spec, build=lambda s, out_dir, callbacks: _with_check(trl_worker._trl_trainer, s, out_dir, callbacks)
    )


def worker_trl_sft(spec: dict) -> dict:
    """trl_worker.worker_trl on TRL's SFTTrainer (:func:`_trl_sft_trainer`)."""
    return trl_worker.worker_trl(spec, build=lambda s, out_dir, callbacks: _with_check(_trl_sft_trainer, s, out_dir, callbacks))


def _with_check(build, spec: dict, out_dir: str, callbacks):
    return build(spec, out_dir, callbacks=[*callbacks, _checkpointing_check(spec)])


def _sft_rows(pairs: list[dict]) -> dict:
    """TRL SFT columns from our ids: input_ids = prompt + chosen, labels -100 on the prompt."""
    return {
        "input_ids": [p["prompt_ids"] + p["chosen_ids"] for p in pairs],
        "labels": [[-100] * len(p["prompt_ids"]) + p["chosen_ids"] for p in pairs],
    }


def _trl_sft_trainer(spec: dict, out_dir: str, callbacks=()):
    """TRL 1.16's SFTTrainer on the chosen responses, fed our token ids, with bench_dpo's
    settings (optimizer, schedule, clipping, fp32, sequential batches, TRL's default logging);
    its dataset preparation keeps a tokenized dataset with labels as it is (checked)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    class BenchSFTTrainer(SFTTrainer):
        """SFTTrainer recording each training loss (as bench_dpo's BenchDPOTrainer does)."""

        precompute_s = 0.0

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if model.training:
                self.bench_losses.append((loss[0] if return_outputs else loss).detach())
            return loss

    with open(spec["pairs_file"]) as f:
        pairs = json.load(f)
    rows = _sft_rows(pairs)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"], trust_remote_code=False)
    args = SFTConfig(
        **trl_worker.trl_common_args(SFTConfig, spec, out_dir),
        packing=False,
        padding_free=False,
        shuffle_dataset=False,
    )
    trainer = BenchSFTTrainer(
        model=spec["model_dir"],
        args=args,
        train_dataset=Dataset.from_dict(rows),
        processing_class=tokenizer,
        callbacks=list(callbacks),
        peft_config=trl_worker.trl_lora_config(spec),
    )
    trainer.bench_losses = []
    trl_worker.check_trl_trainer(trainer, spec)
    prepared = trainer.train_dataset
    assert prepared["input_ids"] == rows["input_ids"] and prepared["labels"] == rows["labels"], "TRL changed the SFT rows"
    collator = trainer.data_collator
    assert not collator.padding_free and collator.pad_to_multiple_of is None and collator.pad_token_id == tokenizer.pad_token_id
    return trainer


def worker_prepare(spec: dict) -> dict:
    """dpo_prepare.worker_prepare (the pairs, tokenized by our code, TRL's preference collator checked
    against our DPO batches), then the same for SFT: TRL's DataCollatorForLanguageModeling on
    :func:`_sft_rows` gives exactly the chosen side of our batches (ids, mask, labels)."""
    out = dpo_prepare.worker_prepare(spec)
    sys.path.insert(0, str(REPO))
    import torch
    from transformers import AutoTokenizer
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    import preference_datasets as pdata

    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer_dir"], trust_remote_code=False)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    with open(spec["pairs_file"]) as f:
        pairs = json.load(f)
    rows = _sft_rows(pairs)
    collate_trl = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id)
    bs, sft_tokens = spec["batch_size"], []
    for k in range(0, len(pairs), bs):
        els = [
            pdata.tokenize_element(
                p["prompt"],
                p["chosen"],
                p["rejected"],
                p["truncation_mode"],
                tokenizer,
                spec["max_length"],
                spec["max_prompt_length"],
            )
            for p in pairs[k : k + bs]
        ]
        ours = pdata.collate(els, tokenizer.pad_token_id)
        theirs = collate_trl([{key: rows[key][i] for key in rows} for i in range(k, min(k + bs, len(pairs)))])
        mask = ours["chosen_attention_mask"]
        assert torch.equal(mask, theirs["attention_mask"]), f"SFT batch {k // bs}: attention_mask differs"
        assert torch.equal(ours["chosen_input_ids"][mask.bool()], theirs["input_ids"][mask.bool()]), f"SFT batch {k // bs}: ids"
        assert torch.equal(ours["chosen_labels"], theirs["labels"]), f"SFT batch {k // bs}: labels differ"
        sft_tokens.append(int(mask.sum()))
    return {**out, "sft_tokens_per_batch": sft_tokens}
