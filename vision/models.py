"""Image-text-to-text models (``AutoModelForImageTextToText``) and their processors, registered with
``modeling.models.MODEL_HOOKS``: a folder or hub id whose config is such a model loads with its ``AutoProcessor``, and
``model.config`` of model_type ``llava`` builds a random one whose processor is made in code (the tiny preset)."""

from __future__ import annotations

import os
import weakref

from omegaconf import DictConfig, OmegaConf

import utils
from modeling import models
from runs import trainer_checkpoint

PROCESSORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""tokenizer -> the processor it belongs to (the run's tokenizer is the processor's own)."""


def attach(processor):
    """``processor``'s tokenizer, remembered as belonging to it (:func:`processor_for`), its chat template the
    processor's when it has none (so that generation stops at the template's end of turn)."""
    tokenizer = processor.tokenizer
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(processor, "chat_template", None) and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = processor.chat_template
    PROCESSORS[tokenizer] = processor
    return tokenizer


def processor_for(tokenizer, where: str = "an image example"):
    """The processor ``tokenizer`` belongs to; DataError when the model is a text model, which cannot take images."""
    processor = PROCESSORS.get(tokenizer)
    if processor is None:
        name = getattr(tokenizer, "name_or_path", "") or f"model.config, its tokenizer {type(tokenizer).__name__}"
        raise utils.DataError(
            f"{where} holds images, but the model ({name}) is a text model; give an image-text-to-text model "
            "(model=blank_model model.name_or_path=<folder or hub id>) or leave the image rows out."
        )
    return processor


def _image_text_types() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


model_type = models.model_type  # the transformers model_type model.* names (modeling.models)


def is_vision_model(model_config: DictConfig) -> bool:
    """True if ``model.*`` is an image-text-to-text model (LLaVA, Idefics3/SmolVLM, Qwen2-VL, ...)."""
    return model_type(model_config) in _image_text_types()


def tiny_llava_processor(model_config: DictConfig, tokenizer):
    """The processor of a LLaVA built from ``model.config``: a CLIP image processor at the vision tower's image size and
    ``tokenizer`` with an ``<image>`` token (one per patch), the chat template :data:`CHAT_TEMPLATE`."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    fields = OmegaConf.to_container(model_config.config, resolve=True)
    vision = fields.get("vision_config") or {}
    size = int(vision.get("image_size", 224))
    strategy = fields.get("vision_feature_select_strategy", "default")
    if "<image>" not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]}, replace_extra_special_tokens=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    image_processor = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=int(vision.get("patch_size", 14)),
        vision_feature_select_strategy=strategy,
        num_additional_image_tokens=1,  # CLIP's class token; "default" drops it again
        chat_template=CHAT_TEMPLATE,
    )


# ChatML (SmolLM2's turns) whose contents may be a string or a list of {"type": "text" | "image"} parts
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

BUILDERS = {"llava": tiny_llava_processor}
"""model_type -> the processor of a model built from ``model.config`` (``fn(model_config, tokenizer)``)."""


class ImageTextToText:
    """``modeling.models.MODEL_HOOKS``' entry for image-text-to-text models."""

    @staticmethod
    def auto_class(model_config: DictConfig):
        """``AutoModelForImageTextToText`` for an image-text-to-text ``model.*``, else None."""
        if not is_vision_model(model_config):
            return None
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText

    @staticmethod
    def config_auto_class(hf_config):
        """``AutoModelForImageTextToText`` for an image-text-to-text model's config (LoRA's export rebuilds it), else None."""
        if getattr(hf_config, "model_type", None) not in _image_text_types():
            return None
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText

    @staticmethod
    def lora_targets(model, lora: DictConfig) -> list[str] | None:
        """:func:`lora_targets`: the language model's linear layers (and the vision tower's with ``model.lora.vision``)."""
        return lora_targets(model, lora)

    @staticmethod
    def tokenizer(model_config: DictConfig, tokenizer):
        """The processor's tokenizer (:func:`attach`): built in code for ``model.config``, else ``AutoProcessor`` of the
        folder or hub id (custom code refused, as for the model)."""
        if model_config.get("config") is not None:
            kind = model_config.config.get("model_type")
            if kind not in BUILDERS:
                raise utils.ConfigError(
                    f"model.config builds a {kind!r} model, whose processor this project cannot make in code (it can for "
                    f"{', '.join(sorted(BUILDERS))}); give a saved model folder with its processor as model.name_or_path."
                )
            return attach(BUILDERS[kind](model_config, tokenizer))
        from transformers import AutoProcessor

        path = model_config.get("tokenizer_name_or_path") or model_config.name_or_path
        models._refuse_custom_code(path, "model.name_or_path")
        try:
            processor = AutoProcessor.from_pretrained(path, trust_remote_code=False)
        except (OSError, ValueError) as e:
            raise utils.ConfigError(
                f"Could not load the processor of {path!r} (an image-text-to-text model needs one): {models._sentence(e)} "
                f"{models._LOAD_HINT}"
            ) from e
        if model_config.get("chat_template"):
            processor.chat_template = models.read_chat_template(model_config.chat_template)
            processor.tokenizer.chat_template = processor.chat_template
        return attach(processor)


def lora_targets(model, lora: DictConfig) -> list[str] | None:
    """The full names of the linear layers LoRA adapts in an image-text-to-text ``model``: those of its language model
    that ``model.lora.target_modules`` names (``all-linear``: every one), and with ``model.lora.vision`` those outside
    it too (the vision tower and its projector); never the output layer. None for a text model."""
    import torch

    if getattr(model.config, "model_type", None) not in _image_text_types():
        return None
    language = model.get_decoder()  # LLaVA's language_model, Idefics3's text_model
    inside = {id(m) for m in language.modules()}
    output = model.get_output_embeddings()
    targets = lora.target_modules
    names = None if targets == "all-linear" else set(OmegaConf.to_container(targets) if OmegaConf.is_list(targets) else [targets])
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
        and m is not output
        and (id(m) in inside or lora.get("vision"))
        and (names is None or name.rpartition(".")[2] in names)
    ]


def write_processor(trainer, checkpoint: str, state_dict=None) -> str | None:
    """Beside the Hugging Face export (``hf/``, export/) of an image-text-to-text run, its processor, so that
    ``model.name_or_path=<checkpoint>/hf`` loads it as any saved model folder; returns None, or why it failed."""
    folder = os.path.join(checkpoint, "hf")
    processor = PROCESSORS.get(trainer.tokenizer)
    if processor is None or not os.path.isdir(folder):  # a text model, or no export (save_hf_export=false, or it failed)
        return None
    try:
        processor.save_pretrained(folder)
    except OSError as e:
        return utils.failure_reason(e)
    return None


models.MODEL_HOOKS.append(ImageTextToText)
trainer_checkpoint.CHECKPOINT_EXTENSIONS.append(write_processor)  # after export/'s hf/ (train.py imports it first)
