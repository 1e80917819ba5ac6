"""Image examples tokenized by the model's processor (``preference_datasets.EXAMPLE_TOKENIZERS["images"]``) and checked
before training (``data.splits.SPLIT_PREPARERS["images"]``): the chat template renders the prompt, the processor expands
its image tokens, chosen and rejected follow with the template's end of turn, labels on the answers only; a prompt cut
to ``max_prompt_length`` keeps its image tokens whole or the row is refused."""

from __future__ import annotations

import hashlib
import io
import json

import losses
import preference_datasets
from data import screening, splits
from data.screening import TruncatedIds
from losses import IGNORE_INDEX
from preference_datasets import _encode, example_key, truncate_pair_ids
from utils import DataError
from vision.images import count_image_parts, open_image
from vision.models import processor_for

_PROBE = "Probe1234"  # an assistant's answer, to find what the chat template writes after it


def end_of_turn(processor) -> str | None:
    """The special token the processor's chat template writes right after an assistant's answer, or None (EOS ends it)."""
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "text", "text": _PROBE}]},
    ]
    text = processor.apply_chat_template(messages, tokenize=False)
    after = text[text.find(_PROBE) + len(_PROBE) :].lstrip(" \t\n")
    tokenizer = processor.tokenizer
    ids = _encode(tokenizer, after, rendered=True)
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return tokenizer.convert_ids_to_tokens(ids[0]) if ids and ids[0] in special else None


def render(processor, messages: list[dict], answer: str | None = None) -> str:
    """``messages`` rendered by the processor's chat template: with the generation prompt, or with ``answer`` as the
    assistant's turn."""
    if answer is None:
        return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    turn = {"role": "assistant", "content": [{"type": "text", "text": answer}]}
    return processor.apply_chat_template([*messages, turn], tokenize=False)


def response_text(processor, messages: list[dict], prompt_text: str, answer: str, eot: str | None) -> str:
    """What the template writes after ``prompt_text`` for ``answer``, up to and including its end of turn (EOS without)."""
    whole = render(processor, messages, answer)
    rest = whole[len(prompt_text) :] if whole.startswith(prompt_text) else answer
    k = rest.find(eot, rest.find(answer) + len(answer)) if eot else -1
    return rest[: k + len(eot)] if k >= 0 else rest.rstrip("\n") + (eot or processor.tokenizer.eos_token)


def image_span(ids: list[int], processor) -> tuple[int, int] | None:
    """[first, last] positions of ``ids`` that are the images': the image tokens, widened over the special tokens right
    around them (e.g. Qwen2-VL's ``<|vision_start|>``, Idefics3's ``<fake_token_around_image>``); None without images."""
    tokenizer = processor.tokenizer
    image_id = getattr(processor, "image_token_id", None)
    if image_id is None:
        image_id = tokenizer.convert_tokens_to_ids(processor.image_token)
    at = [i for i, t in enumerate(ids) if t == image_id]
    if not at:
        return None
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    first, last = at[0], at[-1]
    while first > 0 and ids[first - 1] in special and ids[first - 1] != tokenizer.bos_token_id:
        first -= 1
    while last + 1 < len(ids) and ids[last + 1] in special:
        last += 1
    return first, last


def _cut_problem(prompt_ids, span, cut, mode, max_prompt_length, bos, row) -> str | None:
    """The sentence refusing ``row`` when the cut prompt ``cut`` lost tokens of its images' ``span``, else None."""
    first, last = span
    head = int(bos is not None and mode == "keep_end")  # keep_end keeps the BOS in front of the prompt's end
    kept = len(cut) > last if mode == "keep_start" else len(prompt_ids) - (len(cut) - head) <= first
    if kept:
        return None
    need = last + 1 if mode == "keep_start" else len(prompt_ids) - first + head
    return (
        f"{row}: its prompt is {len(prompt_ids)} tokens, {last - first + 1} of them its images' (tokens {first} to {last}), "
        f"and cutting it to max_prompt_length={max_prompt_length} ({mode}) would cut through them, which the model cannot "
        f"take; raise max_prompt_length to at least {need} (and max_length above it), or leave the row out."
    )


def images_digest(entries) -> str:
    """A digest of an example's ``images`` entries (paths by name, bytes and PIL images by content)."""
    from PIL import Image

    digest = hashlib.sha256()
    for entry in entries:
        if isinstance(entry, Image.Image):
            buffer = io.BytesIO()
            entry.save(buffer, format="PNG")
            digest.update(buffer.getvalue())
        elif isinstance(entry, dict):
            digest.update(entry.get("bytes") or str(entry.get("path")).encode())
        elif isinstance(entry, (bytes, bytearray)):
            digest.update(entry)
        else:
            digest.update(str(entry).encode())
    return digest.hexdigest()[:16]


def image_example_key(ex: dict) -> str:
    """The example's key (``preference_datasets.example_key``) with its images' digest: the same question about another
    image is another example (e.g. for the precomputed reference)."""
    prompt = json.dumps(ex["prompt"], sort_keys=True) + images_digest(ex["images"])
    return example_key(prompt, ex["chosen"], ex.get("rejected"))


def tokenize_image_example(ex: dict, tokenizer, max_length: int, max_prompt_length: int, cuts: list | None = None) -> dict:
    """One image example as ``preference_datasets.tokenize_element`` gives a text one, plus ``model_inputs`` (the
    processor's tensors beside the ids: pixel values, image sizes or grids, pixel masks); DataError for a row whose
    image tokens truncation would cut. ``cuts``: a list that gets its ``data.screening.TruncatedIds``."""
    row = ex.get("row") or "an image example"
    processor = processor_for(tokenizer, row)
    images = [open_image(entry, row) for entry in ex["images"]]
    if len(images) != count_image_parts(ex["prompt"]):
        raise DataError(
            f"{row}: its prompt has {count_image_parts(ex['prompt'])} image parts but {len(images)} images; give one image "
            "per {'type': 'image'} part."
        )
    prompt_text = render(processor, ex["prompt"])
    encoded = processor(text=[prompt_text], images=[images] if images else None, return_tensors="pt")
    prompt_ids = encoded["input_ids"][0].tolist()
    model_inputs = {k: v for k, v in encoded.items() if k not in ("input_ids", "attention_mask")}
    eot = end_of_turn(processor)
    end_id = tokenizer.convert_tokens_to_ids(eot) if eot else tokenizer.eos_token_id
    sides = [s for s in ("chosen", "rejected") if ex.get(s) is not None]
    texts = {s: response_text(processor, ex["prompt"], prompt_text, ex[s], eot) for s in sides}
    full = [_encode(tokenizer, texts[s], rendered=True) for s in sides]
    bos = tokenizer.bos_token_id if prompt_ids[:1] == [tokenizer.bos_token_id] else None
    cut_prompt, cut = truncate_pair_ids(
        prompt_ids, full, ex["truncation_mode"], tokenizer, max_length, max_prompt_length, end_id=end_id, bos_id=bos
    )
    span = image_span(prompt_ids, processor)
    if span is not None and cut_prompt != prompt_ids:
        problem = _cut_problem(prompt_ids, span, cut_prompt, ex["truncation_mode"], max_prompt_length, bos, row)
        if problem is not None:
            raise DataError(problem)
    if cuts is not None:
        differ = full[0] != full[1] if len(full) == 2 else None
        cuts.append(TruncatedIds(cut_prompt, cut, cut_prompt != prompt_ids, [c != f for c, f in zip(cut, full)], differ))
    key = ex.get("key") or image_example_key(ex)
    element = {"prompt": prompt_text, "prompt_input_ids": cut_prompt, "key": key, "model_inputs": model_inputs}
    for side, ids in zip(sides, cut):
        seq = cut_prompt + ids
        element[f"{side}_input_ids"] = seq
        element[f"{side}_attention_mask"] = [1] * len(seq)
        element[f"{side}_labels"] = [IGNORE_INDEX] * len(cut_prompt) + ids  # the answer and its end of turn only
        element[side] = ex[side]
    return element


SUPPORTED_INPUTS = (None, losses.sft_inputs)  # the pair builder and SFT's; others (KTO's unpaired rows) are refused


def prepare_image_examples(examples: list[dict], tokenizer, config, split: str, silent: bool) -> list[dict]:
    """The image examples of ``split``, each tokenized once now (a missing image or a prompt cut through its image tokens
    is one sentence before training) and given its key; says how many there are."""
    objective = losses.get_objective(config.loss.name)
    if objective.inputs not in SUPPORTED_INPUTS:
        raise DataError(
            f"loss={config.loss.name} does not train on image examples (only objectives on pairs, and SFT, do); choose one "
            "of those or leave the image rows out."
        )
    label = "eval" if split == "test" else split
    out, cuts = [], []
    for i, ex in enumerate(examples):
        ex = {**ex, "row": ex.get("row") or f"{label} image example {i + 1}"}
        ex["key"] = image_example_key(ex)
        tokenize_image_example(ex, tokenizer, config.max_length, config.max_prompt_length, cuts)  # refused rows: now
        out.append(ex)
    # what truncation cuts, said as for text examples; pairs the same once cut are skipped
    out = screening.screen_truncated(out, cuts, split, config.max_length, config.max_prompt_length, silent)
    if not silent:
        packing = "; packing is off for image batches (each row's images go with it)" if split == "train" else ""  # once
        print(
            f"[data] {label}: {len(out)} image examples tokenized with the model's processor (image tokens kept whole){packing}"
        )
    return out


preference_datasets.EXAMPLE_TOKENIZERS["images"] = tokenize_image_example
splits.SPLIT_PREPARERS["images"] = prepare_image_examples
