"""What an image-text-to-text model does not train with yet, refused in one sentence before anything loads (a row of
``runs.checks.RULES``)."""

from __future__ import annotations

from omegaconf import DictConfig

from runs import checks
from vision.models import is_vision_model


def vision_problem(c: DictConfig, _) -> str | None:
    """One sentence when ``c`` asks an image-text-to-text model for what it does not support here, else None."""
    lora = checks.lora_settings(c.model)
    if not is_vision_model(c.model):
        if lora is not None and lora.get("vision"):
            return "model.lora.vision=true adapts an image model's vision tower, but this model is a text model; remove it."
        return None
    name = c.model.name_or_path or c.model.config.model_type
    refused = [
        (c.online.enabled, "online DPO (sampling with images)", "online.enabled=false"),
        # parallel/tensor_parallel.py's plans split Llama, GPT-NeoX and GPT-2 blocks, not a vision tower or its projector
        (c.trainer == "TensorParallelTrainer", "trainer=TensorParallelTrainer", "trainer=FSDPTrainer"),
        # its reference actors get the token ids only (ray_launcher.REFERENCE_KEYS): the images would not reach them
        (c.launcher == "ray", "launcher=ray", "launcher=local"),
        # parallel/sequence_parallel.py's forward takes the token rows only: the pixel values would not reach the model
        ((c.get("sequence_parallel_size") or 1) > 1, "sequence_parallel_size > 1", "sequence_parallel_size=1"),
        # the merged export is written with AutoModelForCausalLM (export/hf.py), which holds no vision tower
        (lora is not None and lora.export_merged, "model.lora.export_merged=true", "model.lora.export_merged=false"),
    ]
    for asked, what, fix in refused:
        if asked:
            return f"{name} is an image-text-to-text model, which does not train with {what} yet; set {fix}."
    if c.trainer == "FSDPTrainer" and (c.get("tensor_parallel_size") or 1) > 1:
        return (
            f"{name} is an image-text-to-text model, whose vision tower tensor parallelism cannot split yet; set "
            "tensor_parallel_size=1 (plain FSDP over every rank)."
        )
    return None


checks.RULES.append(("model", vision_problem))
