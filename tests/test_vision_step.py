"""Vision-language DPO's step (vision/): a pair's log-probs with images equal a per-example forward of the same Hugging
Face model, for the policy and the reference, the chosen and the rejected sequence, on LLaVA and Idefics3 (SmolVLM)
built tiny from configs with processors made in code; a prompt cut through its image tokens is refused with the exact
count; the precomputed reference and the chunked output layer equal the live and unchunked forwards."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from conftest import needs_shared

import trainers
import vision  # noqa: F401  (registers the image tokenizer, the model hook and shapes)
from preference_datasets import get_batch_iterator
from utils import DataError
from vision import models as vision_models
from vision import tokenize as vision_tokenize

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

IDEFICS3_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] | capitalize + ':' }}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{{ '<end_of_utterance>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>Assistant:' }}{% endif %}"
)
TEXT = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 2}  # fmt: skip
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 32,
          "patch_size": 8}  # fmt: skip


def smollm2_tokenizer():
    path = needs_shared("tokenizers", "smollm2-135m-instruct")
    return transformers.AutoTokenizer.from_pretrained(str(path))


def llava(seed: int):
    """(processor, a random LLaVA of ``seed``): CLIP tower 32x32 in 8x8 patches (16 image tokens), Llama text model."""
    from omegaconf import OmegaConf

    config = {"model_type": "llava", "vision_config": {"model_type": "clip_vision_model", **VISION}, "text_config": TEXT,
              "vision_feature_select_strategy": "default"}  # fmt: skip
    processor = vision_models.tiny_llava_processor(OmegaConf.create({"config": config}), smollm2_tokenizer())
    config["text_config"] = {**TEXT, "vocab_size": len(processor.tokenizer)}
    config["image_token_index"] = processor.tokenizer.convert_tokens_to_ids("<image>")
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(transformers.AutoConfig.for_model(**config))
    return processor, model.eval()


def idefics3(seed: int):
    """(processor, a random Idefics3 of ``seed``): one 32x32 image (no splitting) as 4 image tokens, Llama text model."""
    tokenizer = smollm2_tokenizer()
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]},
        replace_extra_special_tokens=False,
    )
    image_processor = transformers.Idefics3ImageProcessor(
        size={"longest_edge": 32}, max_image_size={"longest_edge": 32}, do_image_splitting=False
    )
    processor = transformers.Idefics3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4, chat_template=IDEFICS3_TEMPLATE
    )
    config = transformers.Idefics3Config(
        vision_config=VISION, text_config={**TEXT, "vocab_size": len(tokenizer)}, scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
    )  # fmt: skip
    torch.manual_seed(seed)
    return processor, transformers.AutoModelForImageTextToText.from_config(config).eval()


FAMILIES = {"llava": llava, "idefics3": idefics3}


def image(seed: int, size=(40, 30)):
    rng = np.random.default_rng(seed)
    return PIL.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def examples(n_images=(1, 2, 1)) -> list[dict]:
    """Pairs whose prompts hold ``n_images[i]`` images each (another image per pair), answers of different lengths."""
    out = []
    for i, k in enumerate(n_images):
        parts = [{"type": "image"}] * k + [{"type": "text", "text": f"What colour is shape {i}?"}]
        out.append({
            "prompt": [{"role": "user", "content": parts}], "images": [image(10 * i + j) for j in range(k)],
            "chosen": ["Red", "A blue one", "green"][i], "rejected": ["Blue, surely", "red", "It is yellow"][i],
            "truncation_mode": "keep_end", "row": f"pair {i}",
        })  # fmt: skip
    return out


def one_batch(tokenizer, exs, max_length=128, max_prompt_length=96) -> dict:
    return next(get_batch_iterator(exs, tokenizer, len(exs), max_length, max_prompt_length, shuffle=False, n_examples=len(exs)))


def by_hand(model, processor, ex: dict, side: str) -> float:
    """log p(answer | prompt, images): the processor on the whole rendered text, the model's logits log-softmaxed."""
    prompt = vision_tokenize.render(processor, ex["prompt"])
    whole = vision_tokenize.render(processor, ex["prompt"], ex[side])
    eot = vision_tokenize.end_of_turn(processor)
    whole = whole[: whole.index(eot, len(prompt)) + len(eot)]  # the answer's turn up to its end of turn
    n_prompt = processor(text=[prompt], images=[ex["images"]], return_tensors="pt")["input_ids"].shape[1]
    inputs = processor(text=[whole], images=[ex["images"]], return_tensors="pt")
    with torch.no_grad():
        logps = model(**inputs).logits[0].double().log_softmax(-1)
    ids = inputs["input_ids"][0]
    return sum(logps[t - 1, ids[t]].item() for t in range(n_prompt, len(ids)))


def stand_in(policy, reference, chunk=None):
    """The trainer's state that ``concatenated_forward`` and ``reference_logps`` read, on the CPU."""
    t = types.SimpleNamespace(
        packed=True, average_log_prob=False, device=torch.device("cpu"), max_forward_chunks=None, output_layer_chunk=chunk,
        remote_reference=None, reference_cache=None, peft_model=None, reference_model=reference,
        dist=types.SimpleNamespace(reshard=lambda model: None), policy=policy,
    )  # fmt: skip
    t.concatenated_forward = lambda model, batch: trainers.BasicTrainer.concatenated_forward(t, model, batch)
    return t


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_pair_logps_with_images_equal_a_per_example_forward(family):
    processor, policy = FAMILIES[family](0)
    _, reference = FAMILIES[family](1)
    tokenizer = vision_models.attach(processor)
    exs = examples()
    batch = one_batch(tokenizer, exs)
    trainer = stand_in(policy, reference)
    with torch.no_grad():
        chosen, rejected, _ = trainer.concatenated_forward(policy, batch)
    ref_chosen, ref_rejected = trainers.BasicTrainer.reference_logps(trainer, batch)
    for model, got in ((policy, (chosen, rejected)), (reference, (ref_chosen, ref_rejected))):
        for side, values in zip(("chosen", "rejected"), got):
            expected = [by_hand(model, processor, ex, side) for ex in exs]
            np.testing.assert_allclose(values.double().numpy(), expected, atol=1e-5, rtol=0)
    assert not torch.allclose(chosen, ref_chosen)  # two models: the reference is not the policy again


def test_sft_rows_with_images_equal_a_per_example_forward():
    # SFT's one-sided forward (losses.sft_inputs -> forward.single_logps) takes each row's images too, unpacked
    import losses

    processor, policy = llava(0)
    tokenizer = vision_models.attach(processor)
    exs = [{k: v for k, v in ex.items() if k != "rejected"} for ex in examples()]
    batch = one_batch(tokenizer, exs)
    trainer = stand_in(policy, None)
    trainer.one_side_logps = lambda model, rows: trainers.BasicTrainer.one_side_logps(trainer, model, rows)
    with torch.no_grad():
        got = losses.sft_inputs(trainer, batch).policy_chosen_logps
    np.testing.assert_allclose(got.double().numpy(), [by_hand(policy, processor, ex, "chosen") for ex in exs], atol=1e-5)


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
def test_a_prompt_cut_through_its_image_tokens_is_refused_with_the_exact_count(mode):
    # LLaVA's prompt: <|im_start|> user \n, then (32 / 8)^2 = 16 <image> tokens (CLIP's class token dropped) at
    # positions 3..18, then the question; a cut that keeps them all passes, one token less is refused in one sentence.
    processor, policy = llava(0)
    tokenizer = vision_models.attach(processor)
    ex = {**examples()[0], "chosen": "red " * 30, "truncation_mode": mode}
    prompt = vision_tokenize.render(processor, ex["prompt"])
    n_prompt = processor(text=[prompt], images=[ex["images"]], return_tensors="pt")["input_ids"].shape[1]
    head = int(mode == "keep_end" and tokenizer.bos_token_id == tokenizer.convert_tokens_to_ids("<|im_start|>"))
    need = 19 if mode == "keep_start" else n_prompt - 3 + head  # keep_end keeps the BOS, then the prompt from token 3
    with pytest.raises(DataError) as refused:
        one_batch(tokenizer, [ex], max_length=need + 3, max_prompt_length=need - 1)
    assert str(refused.value) == (
        f"pair 0: its prompt is {n_prompt} tokens, 16 of them its images' (tokens 3 to 18), and cutting it to "
        f"max_prompt_length={need - 1} ({mode}) would cut through them, which the model cannot take; raise "
        f"max_prompt_length to at least {need} (and max_length above it), or leave the row out."
    )
    batch = one_batch(tokenizer, [ex], max_length=need + 3, max_prompt_length=need)
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    assert (batch["chosen_input_ids"][0] == image_id).sum() == 16 and batch["chosen_input_ids"].shape[1] == need + 3
    with torch.no_grad():  # the model takes the cut row: its image tokens match the image's features
        stand_in(policy, None).concatenated_forward(policy, {**batch, "rejected_input_ids": batch["chosen_input_ids"],
            "rejected_attention_mask": batch["chosen_attention_mask"], "rejected_labels": batch["chosen_labels"]})  # fmt: skip


def test_precomputed_reference_and_chunked_output_layer_equal_the_live_and_unchunked_forwards(tmp_path):
    # two pairs with the same texts and other images: their keys differ, so the cache keeps both
    from runs import reference_cache

    processor, policy = llava(0)
    _, reference = llava(1)
    tokenizer = vision_models.attach(processor)
    twins = [examples()[0], {**examples()[0], "images": [image(99)]}, examples()[1]]
    trainer = stand_in(policy, reference)
    trainer.tokenizer, trainer.reference_logps = tokenizer, lambda b: trainers.BasicTrainer.reference_logps(trainer, b)
    trainer.config = types.SimpleNamespace(eval_batch_size=2, max_length=128, max_prompt_length=96, progress_bar=False)
    trainer.dist = types.SimpleNamespace(data_world_size=1, data_rank=0, is_main=True, reshard=lambda m: None,
                                         gather_metrics=lambda d: d)  # fmt: skip
    cache = reference_cache.precompute_reference(trainer, twins, str(tmp_path / "ref.pt"))
    assert len(cache) == 3
    batch = one_batch(tokenizer, twins[::-1])
    live = trainer.reference_logps(batch)
    trainer.reference_cache = cache
    cached = trainer.reference_logps(batch)
    assert not torch.allclose(live[0][1], live[0][2])  # the other image changes the log-probs
    for a, b in zip(live, cached):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    policy.double()  # float64: the two forwards sum the output layer's terms in other orders
    batch["model_inputs"] = [{k: v.double() if v.is_floating_point() else v for k, v in m.items()} for m in batch["model_inputs"]]
    unchunked = trainer.concatenated_forward(policy, batch)
    chunked = stand_in(policy, reference, chunk=3).concatenated_forward(policy, batch)
    grads = []
    for out in (unchunked, chunked):
        policy.zero_grad()
        (out[0] - out[1]).sum().backward()
        grads.append([p.grad.clone() for p in policy.parameters() if p.grad is not None])
    for a, b in zip(unchunked, chunked):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def test_what_an_image_model_does_not_train_with_is_refused_in_one_sentence(tmp_path):
    from conftest import compose_config

    from runs import checks
    from utils import ConfigError

    for override, what, fix in (
        ("online.enabled=true online.scorer=reward_function reward_functions=[shapes]", "online DPO (sampling with images)",
         "online.enabled=false"),
    ):  # fmt: skip
        config = compose_config(["model=tiny_vlm", f"output_root={tmp_path}", *override.split()])
        with pytest.raises(ConfigError) as refused:
            checks.validate_config(config)
        assert str(refused.value) == f"llava is an image-text-to-text model, which does not train with {what} yet; set {fix}."
    checks.validate_config(compose_config(["model=tiny_vlm", f"output_root={tmp_path}"]))  # the preset itself passes


def test_image_rows_for_a_text_model_are_one_sentence():
    tokenizer = smollm2_tokenizer()
    with pytest.raises(DataError, match=r"^pair 0 holds images, but the model .* is a text model; give an image-text-to-text"):
        one_batch(tokenizer, examples()[:1])


def test_the_tiny_vlm_preset_trains_and_its_answers_rise(tmp_path):
    # model=tiny_vlm on shapes: SFT from the random model (answers 0: it has never said a colour), then DPO from its policy
    import json

    from conftest import run_train

    short = ["model=tiny_vlm", "+data.shapes.n_train=1024", "+data.shapes.n_test=32", "n_eval_examples=32", "batch_size=32",
             "eval_batch_size=32", "eval_reward_functions=auto", "warmup_steps=5", "n_eval_model_samples=2"]  # fmt: skip
    sft = run_train(
        [*short, "loss=sft", "lr=3e-3", "lr_scheduler=constant", "n_examples=3072", "eval_every=3072"], tmp_path / "sft"
    )
    dpo = run_train([*short, "lr=3e-4", "n_examples=256", "eval_every=256", "sample_during_eval=true",
                     f"model.archive={sft / 'LATEST' / 'policy.pt'}"], tmp_path / "dpo")  # fmt: skip

    def evals(run):
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if "answers_eval/shapes" in r]

    (start, *_, after_sft), (*_, after_dpo) = evals(sft), evals(dpo)
    assert start["answers_eval/shapes"] == 0 and after_sft["answers_eval/shapes"] >= 0.75
    assert after_dpo["rewards_eval/accuracies"] > 0.5 and after_dpo["answers_eval/shapes"] >= 0.75
    assert "|" in (dpo / "samples.md").read_text()  # samples with images: policy and reference generate from them
    # the export hf/ holds the processor too: it loads as any saved image-text-to-text folder, with the trained weights
    from conftest import compose_config

    from modeling import models

    saved = compose_config(["model=blank_model", f"model.name_or_path={sft / 'LATEST' / 'hf'}"]).model
    tokenizer = models.load_tokenizer(saved)
    assert vision_models.processor_for(tokenizer).image_token == "<image>"
    reloaded = models.load_model(saved, tokenizer, torch.float32, 0)
    trained = torch.load(sft / "LATEST" / "policy.pt", weights_only=True)["state"]
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in trained.items())


def test_a_split_mixing_image_and_text_examples_is_one_sentence():
    from data import splits

    text = {"prompt": "Q: 1+1=\nA:", "chosen": " 2", "rejected": " 3", "truncation_mode": "keep_start"}
    with pytest.raises(DataError) as refused:
        splits._set_apart([*examples()[:2], text], "train")
    assert str(refused.value) == (
        "The train split mixes 2 examples holding 'images' and 1 examples holding none of those fields, which cannot "
        "share a batch; give them to separate runs."
    )


def test_the_data_fingerprint_of_image_examples_follows_their_pixels_not_their_objects():
    # resume compares the examples' fingerprint: PIL images drawn again (new objects) are the same data; a pixel is not
    import collections

    from data.loading import flatten
    from runs.checkpoints import examples_fingerprint
    from vision import shapes

    def prepared(**options):
        exs = flatten("shapes", shapes.get_shapes("train", collections.Counter(), n_train=4, **options), False)
        return [{**ex, "key": vision_tokenize.image_example_key(ex)} for ex in exs]

    first, again, other = prepared(), prepared(), prepared(seed=1)
    assert first[0]["images"][0] is not again[0]["images"][0]
    assert examples_fingerprint(first) == examples_fingerprint(again) != examples_fingerprint(other)
    first[3]["images"][0].putpixel((0, 0), (1, 2, 3))
    assert examples_fingerprint(prepared()) != examples_fingerprint(
        [{**ex, "key": vision_tokenize.image_example_key(ex)} for ex in first]
    )


def test_an_objective_on_unpaired_rows_refuses_image_examples_in_one_sentence(tmp_path):
    from conftest import compose_config

    config = compose_config(["model=tiny_vlm", f"output_root={tmp_path}", "loss=kto"])
    with pytest.raises(DataError) as refused:
        vision_tokenize.prepare_image_examples(examples()[:1], None, config, "train", silent=True)
    assert str(refused.value) == (
        "loss=kto does not train on image examples (only objectives on pairs, and SFT, do); choose one of those or leave "
        "the image rows out."
    )


def test_a_saved_image_model_folder_loads_with_its_processor_and_custom_code_is_refused(tmp_path):
    # model=blank_model model.name_or_path=<folder>: AutoModelForImageTextToText and AutoProcessor, as from the hub
    import json

    from conftest import compose_config

    from modeling import models
    from utils import ConfigError

    processor, model = idefics3(0)
    model.save_pretrained(tmp_path / "vlm")
    processor.save_pretrained(tmp_path / "vlm")
    config = compose_config(["model=blank_model", f"model.name_or_path={tmp_path / 'vlm'}"]).model
    tokenizer = models.load_tokenizer(config)
    loaded = models.load_model(config, tokenizer, torch.float32, 0).eval()
    assert type(loaded).__name__ == "Idefics3ForConditionalGeneration"
    batch = one_batch(tokenizer, examples())
    with torch.no_grad():
        got = stand_in(loaded, None).concatenated_forward(loaded, batch)[0]
    np.testing.assert_allclose(got.double().numpy(), [by_hand(model, processor, ex, "chosen") for ex in examples()], atol=1e-5)
    fields = json.loads((tmp_path / "vlm" / "processor_config.json").read_text())
    fields["auto_map"] = {"AutoProcessor": "processing_mine.MyProcessor"}
    (tmp_path / "vlm" / "processor_config.json").write_text(json.dumps(fields))
    with pytest.raises(ConfigError, match=r"names custom code \(processor_config.json's auto_map: processing_mine.MyProcessor\)"):
        models.load_tokenizer(config)


def test_the_shapes_test_images_are_held_out():
    # a new user's trial: 29 of the 128 test images were pixel-identical to train images (2,000 draws from ~9,500)
    import collections

    from vision import shapes

    options = {"n_train": 400, "n_test": 64, "seed": 3, "image_size": 16}  # a small image space: draws repeat often
    train = shapes.get_shapes("train", collections.Counter(), **options)
    test = shapes.get_shapes("test", collections.Counter(), **options)
    seen = {e["images"][0].tobytes() for e in train.values()}
    assert len(test) == 64 and not [k for k, e in test.items() if e["images"][0].tobytes() in seen]
    assert len(seen) < 400  # the train draws do repeat here, so the test's exclusion is exercised


def test_what_truncation_cuts_from_image_examples_is_said_and_pairs_the_same_once_cut_are_skipped(capsys):
    # image examples skipped the text screening: their cut answers were said nowhere, and a pair that differed only past
    # the cut trained on identical sequences. Three pairs, one image each; room for 6 answer tokens after the prompt.
    from omegaconf import OmegaConf

    processor, _ = llava(0)
    tokenizer = vision_models.attach(processor)
    exs = examples(n_images=(1, 1, 1))
    exs[1] = {**exs[1], "chosen": "red " * 20 + "square", "rejected": "red " * 20 + "circle"}  # the same once cut
    exs[2] = {**exs[2], "chosen": "green " * 20}  # chosen cut, rejected ("It is yellow") whole
    prompts = [processor(text=[vision_tokenize.render(processor, e["prompt"])], images=[e["images"]])["input_ids"] for e in exs]
    longest = max(len(p[0]) for p in prompts)
    config = OmegaConf.create({"loss": {"name": "dpo"}, "max_length": longest + 6, "max_prompt_length": longest})
    kept = vision_tokenize.prepare_image_examples(exs, tokenizer, config, "train", silent=False)
    assert [e["row"] for e in kept] == ["pair 0", "pair 2"]
    out = capsys.readouterr().out
    lengths = f"max_length={longest + 6} / max_prompt_length={longest}"
    assert f"[data] train: truncation to {lengths} cuts 0.0% (0 of 3) of prompts and 50.0% (3 of 6) of responses" in out
    assert f"skipped 1 of 3 pairs whose chosen and rejected are the same tokens once cut to {lengths}" in out
