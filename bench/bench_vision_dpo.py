"""This project's image DPO step vs TRL 1.16's DPOTrainer on the same tiny VLM, on CPU: peak RSS and pairs/s.

The model is model=tiny_vlm's (vision/models.py: a random tiny LLaVA, a 2-layer CLIP tower on 32x32 images, a 2-layer
Llama with SmolLM2's vocabulary plus <image>), built once from the preset's config with --seed and saved with its
processor (made in code) to a temporary folder; both sides load that folder (ours: model=blank_model
model.name_or_path=<folder>, which loads the processor with AutoProcessor; TRL: model=<folder>, processing_class =
AutoProcessor of the folder). The pairs are vision/shapes.py's (a coloured square, "What colour is the square?", the
right colour chosen over a wrong one), drawn from --seed and written as PNG files; ours gets them as image examples
(vision/tokenize.py's tokenize_image_example, collated by preference_datasets.collate, timed as
BasicTrainer.train_step), TRL in its vision format: prompt messages with an image part, the images, and chosen /
rejected as assistant messages (its DataCollatorForVisionPreference tokenizes them each step, counted in its time).

Both sides: the same batch (8 pairs), max_length (48, nothing truncated on either side: checked), fp32, AdamW (the same
lr, no weight decay, unfused: TRL optim=adamw_torch), constant schedule without warmup, clipping 1.0, sigmoid DPO
(beta 0.1), live reference, batch k = pairs [8k, 8k+8) (TRL train_sampling_strategy=sequential), the same torch
thread count. Each side runs in its own subprocess (peak RSS = its getrusage ru_maxrss), after waiting for a quiet
machine, rerun when other processes used more than --max-others CPUs during its timed steps; step time is the median
over --steps steps after --warmup (bench_dpo.py's machinery: its spawn, run_side, print_table and print_checks).

What the two sides tokenize differs by what each chat-template split writes: TRL renders prompt + answer as one
conversation and tokenizes the completion as the text after the prompt (the answer, <|im_end|> and the newline after
it); ours ends the answer at the template's end of turn (<|im_end|>). The prompt ids and pixel values are the same
(checked on every batch); the completion-token counts of both are printed. The step-0 loss is ln 2 on both sides
(policy = reference); later losses differ by the newline's log-prob.

    python bench/bench_vision_dpo.py [--steps 20] [--warmup 3] [--rounds 2] [--batch-size 8] [--threads N] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_dpo  # noqa: E402
from dpo_report import _code_hash, _mean  # noqa: E402
from our_worker import _our_overrides, worker_ours  # noqa: E402
from trl_worker import check_trl_trainer, trl_common_args, worker_trl  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny_vlm"
sys.path.insert(1, str(REPO))  # the project's packages, for the workers (the parent imports no torch)
MAX_PROMPT_LENGTH = 40  # the preset's; the shapes prompt is 33 tokens (16 of them the image's)


# ============================================================================ workers (each in its own process)


def _compose(overrides: list[str]):
    """The project's resolved config for ``overrides`` (train.py imported first: it registers vision/ and the rest)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import train  # noqa: F401

    with initialize_config_dir(config_dir=str(REPO / "config"), version_base="1.3"):
        config = compose(config_name="config", overrides=overrides)
    OmegaConf.resolve(config)
    return config


def read_pairs(spec: dict) -> list[dict]:
    """The prepared pairs: {messages, chosen, rejected, image (a PNG path)}."""
    with open(spec["pairs_file"]) as f:
        return json.load(f)


def our_examples(pairs: list[dict]) -> list[dict]:
    """The pairs as this project's image examples (what data/ hands the trainer for datasets=[shapes])."""
    return [
        {
            "prompt": p["messages"],
            "chosen": p["chosen"],
            "rejected": p["rejected"],
            "images": [p["image"]],
            "truncation_mode": "keep_start",
        }
        for p in pairs
    ]


def trl_rows(pairs: list[dict]) -> dict:
    """The pairs in TRL's vision preference format: columns prompt (messages), images, chosen, rejected (messages)."""
    from PIL import Image

    def answer(text):
        return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]

    return {
        "prompt": [p["messages"] for p in pairs],
        "images": [[Image.open(p["image"]).convert("RGB")] for p in pairs],
        "chosen": [answer(p["chosen"]) for p in pairs],
        "rejected": [answer(p["rejected"]) for p in pairs],
    }


def worker_prepare(spec: dict) -> dict:
    """The tiny VLM (model=tiny_vlm's config, --seed) saved with its processor, the shapes pairs as PNGs + JSON, and the
    check that TRL's collator and ours give the same prompt ids and pixel values on every batch."""
    import collections

    import torch

    from modeling import loading, models
    from preference_datasets import collate
    from vision.models import PROCESSORS
    from vision.shapes import get_shapes
    from vision.tokenize import tokenize_image_example

    config = _compose(["model=tiny_vlm", f"seed={spec['seed']}", "loss=dpo"])
    tokenizer = models.load_tokenizer(config.model)
    processor = PROCESSORS[tokenizer]
    policy, _ = loading.load_models(config, tokenizer, 0, False)
    model_dir = Path(spec["tmp"]) / "tiny_vlm"
    policy.save_pretrained(model_dir)
    processor.save_pretrained(model_dir)
    n_params = sum(p.numel() for p in policy.parameters())

    data = get_shapes("train", collections.Counter(), n_train=spec["n_pairs"], seed=spec["seed"])
    (Path(spec["tmp"]) / "images").mkdir()
    pairs = []
    for i, ex in enumerate(data.values()):
        path = Path(spec["tmp"]) / "images" / f"{i}.png"
        ex["images"][0].save(path)
        chosen, rejected = (ex["responses"][j] for j in ex["pairs"][0])
        pairs.append({"messages": ex["prompt_messages"], "chosen": chosen, "rejected": rejected, "image": str(path)})
    Path(spec["pairs_file"]).write_text(json.dumps(pairs))

    from transformers import AutoProcessor
    from trl.trainer.dpo_trainer import DataCollatorForVisionPreference

    # both sides' processors, loaded from the saved folder as each side loads it
    ours_config = _compose(_our_overrides({**spec, "model_dir": str(model_dir)}, spec["tmp"]))
    ours_tok = models.load_tokenizer(ours_config.model)
    trl_processor = AutoProcessor.from_pretrained(model_dir)
    trl_collator = DataCollatorForVisionPreference(processor=trl_processor, max_length=spec["max_length"])
    elements = [tokenize_image_example(e, ours_tok, spec["max_length"], spec["max_prompt_length"]) for e in our_examples(pairs)]
    rows = trl_rows(pairs)
    bs, out = spec["batch_size"], collections.defaultdict(list)
    for k in range(len(pairs) // bs):
        ours = collate(elements[k * bs : (k + 1) * bs], ours_tok.pad_token_id)
        trl = trl_collator([{key: rows[key][i] for key in rows} for i in range(k * bs, (k + 1) * bs)])
        # TRL's rows: [chosen of the B pairs, rejected of the B pairs], flushed left, prompt then completion
        trl_ids = [ids[m.bool()].tolist() for ids, m in zip(trl["input_ids"], trl["attention_mask"])]
        trl_completion = [int(c.sum()) for c in trl["completion_mask"]]
        prompt_ok = all(
            trl_ids[r][: len(e["prompt_input_ids"])] == e["prompt_input_ids"]
            for r, e in enumerate(elements[k * bs : (k + 1) * bs] * 2)
        )
        ours_pixels = torch.cat([e["model_inputs"]["pixel_values"] for e in elements[k * bs : (k + 1) * bs]] * 2)
        out["prompt_ids_equal"].append(prompt_ok)
        out["pixel_values_equal"].append(bool(torch.equal(ours_pixels, trl["pixel_values"])))
        out["completion_tokens_ours"].append(int((ours["chosen_labels"] != -100).sum() + (ours["rejected_labels"] != -100).sum()))
        out["completion_tokens_trl"].append(sum(trl_completion))
        out["tokens_per_batch"].append(int(ours["chosen_attention_mask"].sum() + ours["rejected_attention_mask"].sum()))
        out["longest_trl"].append(max(len(r) for r in trl_ids))
        out["longest_ours"].append(max(len(e["chosen_input_ids"]) for e in elements[k * bs : (k + 1) * bs]))
    return {**out, "model_dir": str(model_dir), "n_params": n_params, "prompt_tokens": len(elements[0]["prompt_input_ids"])}


def _our_vision_trainer(spec: dict, run_dir: str):
    """A BasicTrainer on the saved VLM folder (as our_worker._our_trainer builds one for text) and the image pairs
    tokenized by its processor. Returns (trainer, elements, None)."""
    import torch  # noqa: F401

    import trainers
    import utils
    from modeling import loading, models
    from runs import checks
    from vision.tokenize import tokenize_image_example

    config = _compose(_our_overrides(spec, run_dir))
    checks.validate_config(config)
    utils.set_seed(config.seed)
    utils.set_threads(config.num_threads)
    utils.set_malloc_mmap_threshold(config.get("malloc_mmap_threshold_mib"))
    tokenizer = models.load_tokenizer(config.model)
    examples = our_examples(read_pairs(spec))
    elements = [tokenize_image_example(e, tokenizer, config.max_length, config.max_prompt_length) for e in examples]
    policy, reference = loading.load_models(config, tokenizer, 0, False)
    os.makedirs(Path(run_dir) / "run", exist_ok=True)
    trainer = trainers.BasicTrainer(
        policy, config, str(Path(run_dir) / "run"), tokenizer, examples, examples[: config.batch_size], reference
    )
    return trainer, elements, None


def _trl_vision_trainer(spec: dict, out_dir: str, callbacks=()):
    """TRL's DPOTrainer on the saved VLM folder, its processor, and the pairs in TRL's vision format."""
    from datasets import Dataset
    from transformers import AutoProcessor
    from trl import DPOConfig, DPOTrainer

    class BenchDPOTrainer(DPOTrainer):
        precompute_s = 0.0

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if model.training:
                self.bench_losses.append((loss[0] if return_outputs else loss).detach())
                self.bench_rows.append(int(inputs["input_ids"].shape[0]))
            return loss

    dataset = Dataset.from_dict(trl_rows(read_pairs(spec)))
    processor = AutoProcessor.from_pretrained(spec["model_dir"])
    args = DPOConfig(**trl_common_args(DPOConfig, spec, out_dir), beta=spec["beta"], loss_type=["sigmoid"])
    trainer = BenchDPOTrainer(
        model=spec["model_dir"], args=args, train_dataset=dataset, processing_class=processor, callbacks=list(callbacks)
    )
    trainer.bench_losses, trainer.bench_rows = [], []
    check_trl_trainer(trainer, spec)
    assert type(trainer.model).__name__ == "LlavaForConditionalGeneration", type(trainer.model)
    return trainer


def worker_trl_vision(spec: dict) -> dict:
    """bench_dpo.py's TRL worker on :func:`_trl_vision_trainer`, with the rows each step forwarded."""
    built = []
    out = worker_trl(spec, build=lambda *a, **k: built.append(_trl_vision_trainer(*a, **k)) or built[-1])
    return {**out, "rows": built[0].bench_rows}


def worker_ours_vision(spec: dict) -> dict:
    """bench_dpo.py's worker for ours on :func:`_our_vision_trainer`, with the rows each step forwarded (2 per pair)."""
    rows = []

    def build(spec, run_dir):
        trainer, elements, precompute_s = _our_vision_trainer(spec, run_dir)
        step = trainer.train_step

        def counted(batch):
            rows.append(2 * len(batch["chosen_input_ids"]))  # chosen and rejected of each pair
            return step(batch)

        trainer.train_step = counted
        return trainer, elements, precompute_s

    return {**worker_ours(spec, build=build), "rows": rows}


WORKERS = {"prepare": worker_prepare, "ours": worker_ours_vision, "trl": worker_trl_vision}


# ============================================================================ parent


def build_parser() -> argparse.ArgumentParser:
    """bench_dpo.py's command line, with this benchmark's description and defaults (max_length 48, the preset's)."""
    parser = bench_dpo.build_parser()
    parser.description = __doc__
    parser.set_defaults(max_length=48, model=MODEL, mode="live")
    for action in parser._actions:  # text-model options that mean nothing here
        if action.dest in ("model", "mode", "profile"):
            action.help = argparse.SUPPRESS
    return parser


def main(argv: list[str] | None = None) -> dict:
    """Prepare the model and pairs, run both sides --rounds times (A B A B), print the table and the checks."""
    args = build_parser().parse_args(argv)
    if args.worker:
        bench_dpo.run_worker(args.worker, args.spec, args.result, WORKERS)
        return {}
    n_pairs = (args.warmup + args.steps) * args.batch_size
    started, code_before, load_before = time.time(), _code_hash(), os.getloadavg()[0]
    if load_before > 0.5:
        print(f"warning: 1-minute load average is {load_before:.2f} before starting: other work shares the CPUs", flush=True)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        base = bench_dpo.base_spec(
            args, tmp, n_pairs, max_grad_norm=args.max_grad_norm, max_prompt_length=MAX_PROMPT_LENGTH, model=MODEL, mode="live"
        )
        script = str(Path(__file__).resolve())
        prep = bench_dpo.spawn("prepare", base, tmp, script=script)
        same = all(prep["prompt_ids_equal"]) and all(prep["pixel_values_equal"])
        untruncated = max(prep["longest_trl"]) <= args.max_length and max(prep["longest_ours"]) <= args.max_length
        print(
            f"model: tiny_vlm ({prep['n_params'] / 1e6:.2f}M parameters, seed {args.seed}) saved with its processor; "
            f"{n_pairs} shapes pairs, prompt {prep['prompt_tokens']} tokens; longest row ours {max(prep['longest_ours'])}, "
            f"TRL {max(prep['longest_trl'])} of max_length {args.max_length}; prompt ids and pixel values equal on every "
            f"batch: {same}; completion tokens per batch ours {_mean(prep['completion_tokens_ours']):.0f}, "
            f"TRL {_mean(prep['completion_tokens_trl']):.0f} (TRL's hold the newline after <|im_end|>)",
            flush=True,
        )
        if not (same and untruncated):
            sys.exit("the two sides would not train on the same pairs (see the line above)")
        results: dict = {}
        for rnd in range(args.rounds):
            for side in bench_dpo.SIDES:
                spec = {**base, "side": side, "model_dir": prep["model_dir"], "script": script}
                results.setdefault((MODEL, "live", side), []).append(bench_dpo.run_side(args, spec, tmp, rnd))
    elapsed = time.time() - started
    if _code_hash() != code_before:
        print("WARNING: the project's code changed on disk during this run: rounds may have measured different code.")
    measured = slice(args.warmup, args.warmup + args.steps)
    table = bench_dpo.print_table(args, [MODEL], ["live"], results, _mean(prep["tokens_per_batch"][measured]))
    bench_dpo.print_checks(table)
    rows_per_step = {side: sorted({n for r in results[(MODEL, "live", side)] for n in r["rows"]}) for side in bench_dpo.SIDES}
    print(f"  forward rows per step (2 per pair): ours {rows_per_step['ours']}, TRL {rows_per_step['trl']}")
    print(f"\ntotal wall time {elapsed:.0f} s; 1-minute load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")
    out = {"args": vars(args), "prepare": prep, "rows": table, "rows_per_step": rows_per_step}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
