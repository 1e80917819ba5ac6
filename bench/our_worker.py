"""bench_dpo.py's worker for this project's side: a BasicTrainer built from the saved model folder, timed per step."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from measure import _mark, _opt_desc, _rss_now_mib, _set_threads, _steady

REPO = Path(__file__).resolve().parents[1]


def _our_overrides(spec: dict, run_dir: str) -> list[str]:
    """The Hydra overrides of the project's config that give ``spec``'s settings, with outputs under ``run_dir``."""
    return [
        "model=blank_model",
        f"model.name_or_path={spec['model_dir']}",
        f"model.policy_dtype={spec.get('dtype', 'float32')}",
        f"loss={spec.get('loss', 'dpo')}",  # bench_memory.py: sft too
        *([f"loss.beta={spec['beta']}"] if spec.get("loss", "dpo") == "dpo" else []),
        "optimizer=AdamW",
        f"lr={spec['lr']}",
        "weight_decay=0.0",
        "lr_scheduler=constant",
        "warmup_steps=0",
        f"max_grad_norm={spec['max_grad_norm']}",
        f"batch_size={spec['batch_size']}",
        f"eval_batch_size={spec['batch_size']}",
        f"n_eval_examples={spec['batch_size']}",
        f"n_examples={spec['n_pairs']}",
        f"max_length={spec['max_length']}",
        f"max_prompt_length={spec['max_prompt_length']}",
        f"num_threads={spec['threads']}",
        f"seed={spec['seed']}",
        "do_first_eval=false",
        "sample_during_eval=false",
        "progress_bar=false",
        f"output_root={run_dir}",
        f"cache_dir={Path(run_dir) / 'cache'}",  # fresh: a cached precompute would not be measured
        *spec.get("overrides", []),  # bench_memory.py / bench_gpu_dpo.py: loss=sft, activation_checkpointing, LoRA, ...
    ]


def _our_trainer(spec: dict, run_dir: str):
    """A BasicTrainer built as tests/test_train.py's build_trainer builds one (and train.py the
    precomputed reference), from the saved model folder. Returns (trainer, elements, precompute_s)."""
    sys.path.insert(0, str(REPO))
    import torch
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import preference_datasets as pdata
    import train  # noqa: F401  (registers the plugins: datasets, objectives, online DPO, as train.py does)
    import trainers
    import utils
    from modeling import loading, models
    from runs import checks, reference_cache

    overrides = _our_overrides(spec, run_dir)
    with initialize_config_dir(config_dir=str(REPO / "config"), version_base="1.3"):
        config = compose(config_name="config", overrides=overrides)
    OmegaConf.resolve(config)
    checks.validate_config(config)
    utils.set_seed(config.seed)
    utils.set_threads(config.num_threads)
    utils.set_malloc_mmap_threshold(config.get("malloc_mmap_threshold_mib"))
    with open(spec["pairs_file"]) as f:
        pairs = json.load(f)
    examples = [{k: p[k] for k in ("prompt", "chosen", "rejected", "truncation_mode")} for p in pairs]
    tokenizer = models.load_tokenizer(config.model)
    elements = [
        pdata.tokenize_element(
            e["prompt"], e["chosen"], e["rejected"], e["truncation_mode"], tokenizer, config.max_length, config.max_prompt_length
        )
        for e in examples
    ]
    for el, p in zip(elements, pairs):  # the ids TRL gets
        assert el["chosen_input_ids"] == p["prompt_ids"] + p["chosen_ids"]
        assert el["rejected_input_ids"] == p["prompt_ids"] + p["rejected_ids"]

    # as train.py loads them (float32 here; bench_gpu_dpo.py: bfloat16 on a GPU); no reference for SFT
    policy, reference = loading.load_models(config, tokenizer, 0, False)
    if torch.cuda.is_available() and reference is not None:  # as train.py does (reference_cache.cached_reference)
        reference.to("cuda")
    os.makedirs(Path(run_dir) / "run", exist_ok=True)
    trainer = trainers.BasicTrainer(
        policy, config, str(Path(run_dir) / "run"), tokenizer, examples, examples[: config.batch_size], reference
    )
    precompute_s = None
    if spec["mode"] == "precomputed":  # as train.py: the cache file's name (a hash of the reference), one pass, then freed
        t0 = time.perf_counter()
        path, cache = reference_cache.cached_reference(reference, examples, tokenizer, config)
        trainer.reference_cache = cache if cache is not None else reference_cache.precompute_reference(trainer, examples, path)
        trainer.reference_model = None
        precompute_s = time.perf_counter() - t0
    return trainer, elements, precompute_s


def worker_ours(spec: dict, build=None) -> dict:
    """Our trainer (``build(spec, run_dir)`` -> (trainer, elements, precompute_s), default :func:`_our_trainer`) trained
    for warmup + steps steps on the collated ``elements``, batch k = elements [k B, (k + 1) B); timed per step."""
    _set_threads(spec["threads"])
    with tempfile.TemporaryDirectory() as tmp:
        trainer, elements, precompute_s = (build or _our_trainer)(spec, tmp)
        from collections import defaultdict

        import torch

        from preference_datasets import collate

        pad = trainer.tokenizer.pad_token_id
        bs = spec["batch_size"]
        rss_setup = _rss_now_mib()
        losses, pending = [], defaultdict(list)
        trainer.policy.train()
        marks = [_mark()]
        for k in range(spec["warmup"] + spec["steps"]):
            batch = collate(elements[k * bs : (k + 1) * bs], pad)
            metrics = trainer.train_step(batch)
            for key, v in metrics.items():  # what train() keeps between logs
                pending[key].extend(v)
            losses.append(sum(metrics["loss/train"]) / len(metrics["loss/train"]))
            marks.append(_mark())
        timing = _steady(marks, spec["warmup"])
        threads = torch.get_num_threads()
    return {
        **timing,
        "losses": losses,
        "precompute_s": precompute_s,
        "rss_setup": rss_setup,
        "threads": threads,
        "optimizer": _opt_desc(trainer.optimizer),
    }
