"""Image-text-to-text models on FSDPTrainer and with LoRA (vision/): 2 gloo ranks under torchrun equal one BasicTrainer
process on image pairs; the FSDP units cover the vision tower's and the language model's blocks; LoRA's adapters land on
the language model (and the vision tower with model.lora.vision=true), a step trains only them, and the adapters-off
reference is the base model's forward with the images."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, compose_config, needs_shared, run_torchrun

import utils

pytest.importorskip("transformers")
pytest.importorskip("PIL.Image")

SHORT = [
    "model=tiny_vlm",
    "sft_first.n_examples=null",
    "+data.shapes.n_train=32",
    "+data.shapes.n_test=8",
    "n_eval_examples=8",
    "batch_size=8",
    "eval_batch_size=8",
    "n_examples=24",  # 3 optimizer steps
    "eval_every=24",
    "optimizer=SGD",  # Adam divides by sqrt(v): a 1e-7 reduction-order difference in a near-zero gradient moves a weight by ~lr
    "lr=1.0",
    "lr_scheduler=constant",
    "warmup_steps=1",
    "sample_during_eval=false",
    "eval_reward_functions=null",
    "progress_bar=false",
    "minimum_log_interval_secs=0",
    "keep_checkpoints=0",
    "plot_curves=false",
]


def train_py(args: list[str], out: Path) -> Path:
    """The run folder of ``python train.py args output_root=out`` (one process), which must succeed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "train.py", *args, f"output_root={out}"], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return next(p for p in out.iterdir() if p.is_dir())


def evals(run_dir: Path) -> list[dict]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "loss/eval" in r]


def test_fsdp_on_two_ranks_equals_one_process_on_image_pairs(tmp_path):
    needs_shared("tokenizers", "smollm2-135m-instruct")
    basic = train_py([*SHORT, "output_layer_chunk=null"], tmp_path / "basic")
    # each rank takes 4 of the 8 pairs with their images, in 2 micro-batches of 2; the output layer 5 positions at a time
    fsdp_args = [*SHORT, "trainer=FSDPTrainer", "gradient_accumulation_steps=2", "output_layer_chunk=5"]
    code, text = run_torchrun(["train.py", *fsdp_args, f"output_root={tmp_path / 'fsdp'}"], timeout=300)
    assert code == 0, text[-4000:]
    fsdp = next(p for p in (tmp_path / "fsdp").iterdir() if p.is_dir())
    ea, eb = evals(basic), evals(fsdp)
    assert [r["step"] for r in ea] == [r["step"] for r in eb] == [0, 24]
    assert ea[-1]["logps_eval/chosen"] - ea[0]["logps_eval/chosen"] > 0.1  # the steps moved the policy
    for ra, rb in zip(ea, eb):
        for key in ("loss/eval", "logps_eval/chosen", "logps_eval/rejected"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-5), key
    wa = torch.load(basic / "LATEST" / "policy.pt", weights_only=True)["state"]
    wb = torch.load(fsdp / "LATEST" / "policy.pt", weights_only=True)["state"]
    assert set(wa) == set(wb) and any("vision_tower" in k for k in wa)
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=0, atol=1e-5, msg=name)


def tiny_vlm():
    from modeling import models

    config = compose_config(["model=tiny_vlm"])
    needs_shared("tokenizers", "smollm2-135m-instruct")
    tokenizer = models.load_tokenizer(config.model)
    return config, tokenizer, models.load_model(config.model, tokenizer, torch.float32, 0)


def test_the_fsdp_units_cover_the_vision_tower_and_the_language_model():
    from parallel.fsdp import find_block_classes

    config, _, model = tiny_vlm()
    names = {c.__name__ for c in find_block_classes(model, config.model.block_name)}
    assert names == {"LlamaDecoderLayer", "CLIPEncoderLayer"}
    # null: the _no_split_modules of the LLaVA's sub-models (its own names none)
    assert {"LlamaDecoderLayer", "CLIPEncoderLayer"} <= {c.__name__ for c in find_block_classes(model, None)}
    with pytest.raises(utils.ConfigError, match=r"^model.block_name=SiglipEncoderLayer is not a module of Llava"):
        find_block_classes(model, ["LlamaDecoderLayer", "SiglipEncoderLayer"])


def test_tensor_parallel_ray_and_2d_fsdp_stay_refused_for_image_models_in_one_sentence(tmp_path):
    import parallel.sequence_parallel  # noqa: F401  (its config rules, as train.py registers them)
    from runs import checks

    for override, message in (
        ("trainer=TensorParallelTrainer", "which does not train with trainer=TensorParallelTrainer yet; set trainer=FSDPTrainer."),
        ("launcher=ray", "which does not train with launcher=ray yet; set launcher=local."),
        ("trainer=FSDPTrainer sequence_parallel_size=2", "which does not train with sequence_parallel_size > 1 yet; set "
         "sequence_parallel_size=1."),
        ("trainer=FSDPTrainer world_size=4 tensor_parallel_size=2", "whose vision tower tensor parallelism cannot split yet; set "
         "tensor_parallel_size=1 (plain FSDP over every rank)."),
    ):  # fmt: skip
        config = compose_config(["model=tiny_vlm", f"output_root={tmp_path}", *override.split()])
        with pytest.raises(utils.ConfigError) as refused:
            checks.validate_config(config, world_size=4)
        assert str(refused.value) == f"llava is an image-text-to-text model, {message}"
    checks.validate_config(compose_config(["model=tiny_vlm", f"output_root={tmp_path}", "trainer=FSDPTrainer"]))


def image_inputs(tokenizer):
    """One shapes prompt with its image through the tiny LLaVA's processor: input_ids, attention_mask, pixel_values."""
    import random

    from vision import models as vision_models
    from vision import shapes

    processor = vision_models.processor_for(tokenizer)
    text = "<|im_start|>user\n<image>What colour is the square?<|im_end|>\n"
    return processor(text=[text], images=[[shapes.draw(random.Random(0), "red", None)]], return_tensors="pt")


@pytest.mark.parametrize("vision", [False, True])
def test_lora_adapters_land_where_the_key_says_a_step_trains_only_them_and_adapters_off_is_the_base(vision):
    import copy

    from omegaconf import OmegaConf

    from modeling import models

    _, tokenizer, base = tiny_vlm()
    lora = OmegaConf.create({"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear", "vision": vision})
    policy = models.apply_lora(copy.deepcopy(base), lora)
    adapted = {n.split(".lora_A")[0] for n, _ in policy.named_parameters() if ".lora_A." in n}
    language = {n for n in adapted if ".language_model." in n}
    assert language and all(n.endswith(("_proj",)) for n in language)
    others = adapted - language
    if vision:  # the vision tower and its projector, by module name
        assert any(".vision_tower." in n for n in others) and any(".multi_modal_projector." in n for n in others)
    else:
        assert not others
    assert not any("lm_head" in n for n in adapted)
    # a step: only the adapters have gradients and move
    inputs = image_inputs(tokenizer)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=1.0)
    policy(**inputs).logits.log_softmax(-1)[0, -1, :8].sum().backward()
    optimizer.step()
    changed = {n for n, p in policy.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".lora_" in n for n in changed)
    assert any(".lora_B." in n for n in changed)  # B moved off zero: the adapters now change the forward
    # the reference is the policy with its adapters off: the base model's forward with the image
    with torch.no_grad():
        expected = base(**inputs).logits
        with policy.disable_adapter():
            off = policy(**inputs).logits
        on = policy(**inputs).logits
    torch.testing.assert_close(off, expected, rtol=0, atol=1e-6)
    assert (on - expected).abs().max() > 1e-4


def test_lora_vision_for_a_text_model_and_a_merged_image_export_are_refused_in_one_sentence(tmp_path):
    from runs import checks

    text = compose_config([f"output_root={tmp_path}", "model.lora.r=4", "model.lora.vision=true"])
    with pytest.raises(utils.ConfigError, match=r"^model.lora.vision=true adapts an image model's vision tower, but"):
        checks.validate_config(text)
    merged = compose_config(["model=tiny_vlm", f"output_root={tmp_path}", "model.lora.r=4", "model.lora.export_merged=true"])
    with pytest.raises(utils.ConfigError) as refused:
        checks.validate_config(merged)
    assert str(refused.value) == (
        "llava is an image-text-to-text model, which does not train with model.lora.export_merged=true yet; set "
        "model.lora.export_merged=false."
    )
    checks.validate_config(
        compose_config(["model=tiny_vlm", f"output_root={tmp_path}", "model.lora.r=4", "model.lora.vision=true"])
    )
