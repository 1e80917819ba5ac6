"""What an image-text-to-text model does not train with yet, refused in one sentence before anything loads (a row of
``runs.checks.RULES``)."""

from __future__ import annotations

from omegaconf import DictConfig

from runs import checks
from vision.models import is_vision_model


def vision_problem(c: DictConfig, _) -> str | None:
    """One sentence when ``c`` asks an image-text-to-text model for what it does not support here, else None."""
    if not is_vision_model(c.model):
        return None
    name = c.model.name_or_path or c.model.config.model_type
    refused = [
        (c.online.enabled, "online DPO (sampling with images)", "online.enabled=false"),
        (c.trainer != "BasicTrainer", f"trainer={c.trainer}", "trainer=BasicTrainer"),
        (c.launcher == "ray", "launcher=ray", "launcher=local"),
        (checks.lora_settings(c.model) is not None, "LoRA (model.lora.r)", "model.lora.r=null"),
    ]
    for asked, what, fix in refused:
        if asked:
            return f"{name} is an image-text-to-text model, which does not train with {what} yet; set {fix}."
    return None


checks.RULES.append(("model", vision_problem))
