"""The models of a run: the policy (or reward model) and the frozen reference, with ``model.archive``'s weights."""

from __future__ import annotations

import functools
import os

import torch
from omegaconf import DictConfig

import losses
import utils
from modeling import models
from modeling.models import load_reference
from runs import checkpoints, checks
from runs.config_text import override_text


def load_archive(model: torch.nn.Module, state: dict, path: str) -> None:
    """Load ``state`` (a policy.pt's weights) into ``model``; utils.ConfigError naming the first mismatch for another model's."""
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        lines = [line.strip() for line in str(e).splitlines()[1:] if line.strip()]
        detail = (lines[0] if lines else str(e))[:200]
        raise utils.ConfigError(
            f"model.archive={path} holds another model's weights ({detail}); give the policy.pt of a run of this model."
        ) from e


def check_archive_model(config: DictConfig, model: torch.nn.Module, tokenizer) -> None:
    """Refuse (utils.ConfigError) a ``model`` whose transformers config computes otherwise than that of the run
    ``model.archive`` comes from (its config.yaml beside the step), and note harmless differences."""
    run_dir = os.path.dirname(os.path.dirname(os.path.realpath(config.model.archive)))
    saved_path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(saved_path):  # a policy.pt outside a run folder: nothing to compare with
        return
    saved = checkpoints.load_run_config(saved_path).model
    if saved.get("config") == config.model.get("config") and saved.get("name_or_path") == config.model.get("name_or_path"):
        return  # the same model settings
    try:
        theirs = models.transformers_config(saved, tokenizer)
    except (utils.ConfigError, OSError, ValueError):  # e.g. a hub id this machine cannot reach: nothing to compare with
        return
    changed, harmless = models.config_field_differences(theirs, model.config)

    def listed(fields: list, which: int) -> str:
        return ", ".join(f"{field}={override_text(values[which - 1])}" for field, *values in fields)

    if changed:
        raise utils.ConfigError(
            f"model.archive={config.model.archive} holds the weights of a model with {listed(changed, 1)} ({saved_path}), "
            f"and this run builds one with {listed(changed, 2)}, in which the same weights compute something else; give "
            "this run the archive's model settings, or the policy.pt of a run of this model."
        )
    if harmless:
        print(
            f"Note: model.archive={config.model.archive} comes from a model with {listed(harmless, 1)}, and this run's "
            f"has {listed(harmless, 2)}; the weights mean the same in both."
        )


def read_archive(config: DictConfig) -> dict:
    """``model.archive``'s policy.pt: a ``state`` dict of a whole model's weights, else utils.ConfigError."""
    state = models.load_weights_file(
        config.model.archive, f"model.archive={config.model.archive}", "give the policy.pt of an earlier run"
    )
    if not isinstance(state, dict) or not isinstance(state.get("state"), dict):
        raise utils.ConfigError(
            f"model.archive={config.model.archive} holds no 'state' dict of weights; give the policy.pt of an earlier run."
        )
    if state.get("lora") is not None or any(".lora_" in k for k in state["state"]):
        raise utils.ConfigError(
            f"model.archive={config.model.archive} holds only the LoRA adapters of a run with model.lora.r set, not a "
            "whole model; give the policy.pt of a full fine-tuning run, or train from that run's merged export "
            "(model.lora.export_merged=true: model.name_or_path=<its checkpoint>/hf/merged)."
        )
    return state


def load_models(config: DictConfig, tokenizer, rank: int, distributed: bool) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The policy (or reward model) and frozen reference (None without one or with LoRA), with ``model.archive``'s weights."""
    objective = losses.get_objective(config.loss.name)
    reward_head = objective.score_head
    lora = checks.lora_settings(config.model)
    needs_reference = objective.uses_reference(config.loss) and lora is None  # LoRA: the base is the reference
    remote_reference = config.launcher == "ray" and config.ray.reference_workers > 0  # on Ray actors
    local_reference = needs_reference and not remote_reference

    archive = functools.cache(lambda: read_archive(config))  # read once, for the policy and the reference

    def build_policy() -> torch.nn.Module:
        policy = models.load_model(config.model, tokenizer, utils.get_dtype(config.model.policy_dtype), config.seed, reward_head)
        if config.model.archive is None:
            return policy
        state = archive()
        into = "the policy and reference" if local_reference else "the policy"
        into = "the policy's base (LoRA: also the reference)" if lora is not None else into
        print(f"Loading {config.model.archive} (after {state.get('step_idx')} examples) into {into}.")
        if reward_head:  # a causal LM's weights under a score head: all but the heads must match
            missing, unexpected = policy.load_state_dict(state["state"], strict=False)
            body = [k for k in missing + unexpected if k.split(".")[0] not in ("score", "lm_head")]
            if body:
                raise utils.ConfigError(f"model.archive={config.model.archive} does not fit this model (e.g. {body[0]!r}).")
        else:
            load_archive(policy, state["state"], config.model.archive)
        check_archive_model(config, policy, tokenizer)  # the shapes fit: do the settings that are not shapes?
        return policy

    def build_reference() -> torch.nn.Module:
        reference = load_reference(config, tokenizer, apply_archive=False)
        if config.model.archive is not None:
            load_archive(reference, archive()["state"], config.model.archive)
        return reference

    if config.model.device_map is None and config.trainer == "BasicTrainer" and torch.cuda.device_count() > 1:
        config.model.device_map = "balanced"  # one process, the model split over the local GPUs
    if not distributed:
        policy = build_policy()
        reference = build_reference() if local_reference else None
    else:
        policy = models.rank0_model(build_policy, rank)
        reference = models.rank0_model(build_reference, rank) if local_reference else None
    if lora is not None:  # after the archive: LoRA on top of its weights (rank 0's; the others' arrive when sharded)
        policy = models.apply_lora(policy, lora)
    return policy, reference
