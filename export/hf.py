"""The Hugging Face folder a checkpoint carries (``hf/``: weights, tokenizer, model card), registered with trainers.py on
import (train.py imports it): ``from_pretrained`` loads it, ``push_to_hub`` publishes it."""

from __future__ import annotations

import os
import shutil

import utils
from export import modelcard
from modeling import models
from runs import trainer_checkpoint


def write_hf_export(trainer, checkpoint: str, state_dict: dict | None = None) -> str | None:
    """With ``save_hf_export``, write the Hugging Face export (LoRA: the adapter folder, and ``merged/`` with
    ``model.lora.export_merged``) of the policy or its full ``state_dict`` into ``checkpoint``/hf; returns None, or why
    it failed (``hf/`` removed)."""
    if not trainer.config.save_hf_export:
        return None
    folder = os.path.join(checkpoint, "hf")
    try:
        if trainer.peft_model is not None:
            state = trainer.policy.state_dict() if state_dict is None else state_dict
            exporter = models.lora_export_model(trainer.policy.config, trainer.lora, state, models.lora_base_path(trainer.config))
            exporter.save_pretrained(folder, save_embedding_layers=False)
            trainer.tokenizer.save_pretrained(folder)
            if trainer.lora.get("export_merged"):
                # peft (0.22) merges into the base layers in place, and those share the live policy's storage: merge copies
                own = {k: v.clone() if ".base_layer." in k else v for k, v in state.items()}
                lora_base = models.lora_base_path(trainer.config)
                merged = models.lora_export_model(trainer.policy.config, trainer.lora, own, lora_base).merge_and_unload(
                    safe_merge=True
                )
                merged.generation_config = trainer.policy.generation_config
                merged.save_pretrained(os.path.join(folder, "merged"))
                trainer.tokenizer.save_pretrained(os.path.join(folder, "merged"))
        else:
            trainer.policy.save_pretrained(folder, **({} if state_dict is None else {"state_dict": state_dict}))
            trainer.tokenizer.save_pretrained(folder)
        modelcard.write_cards(
            folder,
            trainer.config,
            trainer.run_dir,
            trainer.example_counter,
            trainer.batch_counter,
            adapter=trainer.peft_model is not None,
        )
    except Exception as e:
        shutil.rmtree(folder, ignore_errors=True)
        return utils.failure_reason(e)
    return None


trainer_checkpoint.CHECKPOINT_EXTENSIONS.append(write_hf_export)
