"""bench_dpo.py's prepare worker: the HH pairs that fit, tokenized by this project's code, TRL's collator checked on them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from measure import _set_threads

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(__file__).resolve().parents[2] / "shared"
HH = SHARED / "data" / "hh-rlhf"
STORIES = SHARED / "models" / "stories260K"
RANDOM_LLAMA = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 512,
    "max_position_embeddings": 512,
}


def _fitting_pairs(spec: dict, tokenizer) -> tuple[list, list]:
    """The HH harmless-base train examples and, shuffled by the seed, those (example, element)
    pairs whose prompt + longest response fit max_length untruncated."""
    import collections

    import preference_datasets as pdata
    from data.loading import flatten

    report = collections.Counter()
    data = pdata.get_hh("train", report, local_dir=str(HH), subsets=["harmless-base"], holdout_fraction=0.1)
    examples = flatten("hh", data, sft_mode=False)
    max_len = spec["max_length"]
    fitting = []
    for ex in examples:
        # no truncation at all: a huge max_length, then keep the pairs that fit max_length whole
        el = pdata.tokenize_element(
            ex["prompt"], ex["chosen"], ex["rejected"], ex["truncation_mode"], tokenizer, 10**9, 10**9 - 1
        )
        if max(len(el["chosen_input_ids"]), len(el["rejected_input_ids"])) <= max_len:
            fitting.append((ex, el))
    import random

    random.Random(spec["seed"]).shuffle(fitting)
    return examples, fitting


def _pair_rows(spec: dict, tokenizer, chosen: list) -> list[dict]:
    """The chosen pairs as rows of texts and our token ids (prompt_ids / chosen_ids / rejected_ids)."""
    import preference_datasets as pdata

    max_len = spec["max_length"]
    # our tokenization at the real max_length / max_prompt_length must give the same ids (nothing cut)
    pairs = []
    for ex, el in chosen:
        real = pdata.tokenize_element(
            ex["prompt"], ex["chosen"], ex["rejected"], ex["truncation_mode"], tokenizer, max_len, spec["max_prompt_length"]
        )
        assert real["chosen_input_ids"] == el["chosen_input_ids"] and real["rejected_input_ids"] == el["rejected_input_ids"]
        p = len(el["prompt_input_ids"])
        pairs.append(
            {
                "prompt": ex["prompt"],
                "chosen": ex["chosen"],
                "rejected": ex["rejected"],
                "truncation_mode": ex["truncation_mode"],
                "prompt_ids": el["prompt_input_ids"],
                "chosen_ids": el["chosen_input_ids"][p:],
                "rejected_ids": el["rejected_input_ids"][p:],
            }
        )
    return pairs


def _check_trl_collator(spec: dict, tokenizer, pairs: list[dict]) -> list[int]:
    """Assert that TRL's collator on our ids gives our collate + concatenated_inputs, batch by
    batch; return each batch's non-padding tokens."""
    import torch
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    import preference_datasets as pdata
    import trainers

    max_len = spec["max_length"]
    trl_collate = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id, max_length=max_len, truncation_mode="keep_start")
    bs = spec["batch_size"]
    tokens = []
    for k in range(0, spec["n_pairs"], bs):
        rows = pairs[k : k + bs]
        ours = trainers.concatenated_inputs(
            pdata.collate(
                [
                    pdata.tokenize_element(
                        r["prompt"],
                        r["chosen"],
                        r["rejected"],
                        r["truncation_mode"],
                        tokenizer,
                        max_len,
                        spec["max_prompt_length"],
                    )
                    for r in rows
                ],
                tokenizer.pad_token_id,
            )
        )
        theirs = trl_collate([{key: r[key] for key in ("prompt_ids", "chosen_ids", "rejected_ids")} for r in rows])
        # padding positions (attention mask 0) may hold different ids: ours pads the shorter side with 0, TRL with pad_token_id
        assert torch.equal(ours["attention_mask"], theirs["attention_mask"]), f"batch {k // bs}: attention_mask differs"
        real = ours["attention_mask"].bool()
        assert torch.equal(ours["input_ids"][real], theirs["input_ids"][real]), f"batch {k // bs}: input_ids differ"
        assert torch.equal((ours["labels"] != -100).long(), theirs["completion_mask"]), f"batch {k // bs}: response mask differs"
        tokens.append(int(ours["attention_mask"].sum()))
    return tokens


def _trl_text_same(spec: dict, tokenizer, pairs: list[dict]) -> int | None:
    """How many pairs TRL's own text tokenization (its _prepare_dataset) gives our ids for (None
    where it cannot run: informational only)."""
    try:
        from datasets import Dataset
        from trl import DPOConfig, DPOTrainer

        class _Fake:
            _tokenizer = tokenizer

        args = DPOConfig(output_dir=spec["tmp"], max_length=None, report_to="none", bf16=False, use_cpu=True)
        text = Dataset.from_dict({k: [r[k] for r in pairs] for k in ("prompt", "chosen", "rejected")})
        tokenized = DPOTrainer._prepare_dataset(_Fake(), text, tokenizer, args, "check")
        return sum(
            t["prompt_ids"] == r["prompt_ids"] and t["chosen_ids"] == r["chosen_ids"] and t["rejected_ids"] == r["rejected_ids"]
            for t, r in zip(tokenized, pairs)
        )
    except Exception as e:  # informational only
        print(f"[prepare] could not run TRL's text tokenization for comparison: {e!r}", file=sys.stderr)
        return None


def _save_random_llama(spec: dict, tokenizer, random_dir: Path) -> None:
    """The random Llama (RANDOM_LLAMA, seeded), saved with the stories260K tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(spec["seed"])
    cfg = LlamaConfig(**RANDOM_LLAMA, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(random_dir)
    tokenizer.save_pretrained(random_dir)


def worker_prepare(spec: dict) -> dict:
    """Select the pairs, tokenize them with this project's code, save the random model,
    and check that TRL's collator turns our ids into exactly our batches."""
    sys.path.insert(0, str(REPO))
    from transformers import AutoTokenizer

    import train  # noqa: F401  (registers the plugins: datasets, objectives, online DPO, as train.py does)

    _set_threads(spec["threads"])
    tokenizer = AutoTokenizer.from_pretrained(
        spec.get("tokenizer_dir", STORIES), trust_remote_code=False
    )  # bench_memory.py: SmolLM2's
    if tokenizer.pad_token_id is None:  # as models.load_tokenizer (and TRL) do
        tokenizer.pad_token = tokenizer.eos_token
    examples, fitting = _fitting_pairs(spec, tokenizer)
    n_pairs, max_len = spec["n_pairs"], spec["max_length"]
    if len(fitting) < n_pairs:
        raise SystemExit(f"only {len(fitting)} pairs fit max_length {max_len}; need {n_pairs} (lower --steps)")
    pairs = _pair_rows(spec, tokenizer, fitting[:n_pairs])
    tokens = _check_trl_collator(spec, tokenizer, pairs)
    trl_text_same = _trl_text_same(spec, tokenizer, pairs)
    random_dir = Path(spec["tmp"]) / "random-llama"
    if "random" in spec["models"]:
        _save_random_llama(spec, tokenizer, random_dir)
    with open(spec["pairs_file"], "w") as f:
        json.dump(pairs, f)
    bs = spec["batch_size"]
    return {
        "n_hh_pairs": len(examples),
        "n_fitting": len(fitting),
        "tokens_per_batch": tokens,
        "widths": [
            max(len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in pairs[k : k + bs])
            for k in range(0, n_pairs, bs)
        ],
        "trl_text_tokenization_identical": trl_text_same,
        "random_dir": str(random_dir),
    }
