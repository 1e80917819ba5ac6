"""A data row's other columns reach reward functions as ``fields`` (issue 23 part 1): the json and
hf loaders keep them per prompt, and make_pairs.py, online DPO, evaluate.py (judge=reward_function)
and the trainer's answers_eval pass them, one value per completion, beside prompts and completions.

The user's function here is the README's ``exact`` (None where a row has no answer), which also
writes what it was given to a file, so each test checks every completion against its own prompt's
answer and works the scores out by hand from the written samples.
"""

from __future__ import annotations

import collections
import json
import math
import textwrap
from pathlib import Path

import pytest
from conftest import REPO, metric_records, needs_shared, run_train
from hydra import compose, initialize_config_dir

import preference_datasets as pd
from data import prompts as prompt_sets
from data.loading import flatten, load_dataset_dict
from evaluation import evaluate, rewards, sampling
from online import make_pairs
from utils import DataError

EXACT = """
import json
import os


def exact(prompts, completions, answer, **_):
    with open(os.environ["REWARD_FIELDS_LOG"], "a") as f:
        for p, c, a in zip(prompts, completions, answer):
            f.write(json.dumps({"prompt": p, "completion": c, "answer": a}) + "\\n")
    return [None if a is None else float(c.strip() == a) for c, a in zip(completions, answer)]
"""

# Sixteen questions with their sums as the answer column: eight sum to 9, one to 12, six to 14..24;
# the last row (8+18) has no answer column.
QUESTIONS = [(a, 9 - a) for a in range(8)] + [(a, 10 + a) for a in range(1, 9)]
ANSWERS = {f"Q: {a}+{b}=\nA:": str(a + b) for a, b in QUESTIONS[:-1]} | {"Q: 8+18=\nA:": None}


@pytest.fixture
def log(tmp_path, monkeypatch) -> Path:
    """The module ``fieldmod`` (``fieldmod:exact``) importable, and the file its calls are written to."""
    (tmp_path / "fieldmod.py").write_text(textwrap.dedent(EXACT))
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "calls.jsonl"
    monkeypatch.setenv("REWARD_FIELDS_LOG", str(path))
    return path


def calls(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prompt_rows() -> list[dict]:
    """Prompt-only rows with an answer column (and a source column), the last row without an answer."""
    return [{"prompt": p, "source": "sums", **({"answer": a} if a is not None else {})} for p, a in ANSWERS.items()]


def hf_both(path: Path) -> str:
    """``data.hf.path`` reading ``path`` as both splits (no held-out slice: every prompt in each)."""
    return f"data.hf.path={{train: '{path}', test: '{path}'}}"


def config_of(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(REPO / "config"), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


# ----------------------------------------------------------------------------- the loaders keep the columns


def test_json_and_hf_loaders_keep_the_other_columns_per_prompt_a_missing_one_is_none(tmp_path):
    f = write_jsonl(
        tmp_path / "pairs.jsonl",
        [
            {"prompt": "p1", "chosen": "a", "rejected": "b", "answer": "4", "level": 1},
            {"prompt": "p1", "chosen": "a", "rejected": "c", "answer": "5", "note": "x"},  # p1 again: first values kept
            {"prompt": "p2", "chosen": "a", "rejected": "b"},
        ],
    )
    data = load_dataset_dict("json", "train", {"path": str(f), "holdout_fraction": 0}, silent=True)
    assert data["p1"]["fields"] == {"answer": "4", "level": 1, "note": "x"}
    assert data["p2"]["fields"] == {"answer": None, "level": None, "note": None}
    examples = flatten("json", data, sft_mode=False)
    assert [e["fields"]["answer"] for e in examples] == ["4", "4", None]
    # the hf loader reads the same file: the same fields
    hf = load_dataset_dict("hf", "train", {"path": {"train": str(f), "test": str(f)}}, silent=True)
    assert {k: e["fields"] for k, e in hf.items()} == {k: e["fields"] for k, e in data.items()}
    # prompt-only rows (online DPO, make_pairs, evaluate): the prompt and its fields
    p = write_jsonl(tmp_path / "prompts.jsonl", prompt_rows())
    entries = prompt_sets.load_prompt_entries("hf", "train", {"hf": {"path": {"train": str(p), "test": str(p)}}}, silent=True)
    assert [(prompt, fields["answer"], fields["source"]) for prompt, fields in entries] == [
        (prompt, answer, "sums") for prompt, answer in ANSWERS.items()
    ]
    # a file without other columns keeps none
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}])
    assert "fields" not in load_dataset_dict("json", "train", {"path": str(plain), "holdout_fraction": 0}, silent=True)["p"]


def test_batches_carry_each_examples_fields_and_an_empty_dict_for_an_example_without():
    from transformers import ByT5Tokenizer

    examples = [
        {"prompt": "a", "chosen": "x", "rejected": "y", "truncation_mode": "keep_end", "fields": {"answer": "1"}},
        {"prompt": "b", "chosen": "x", "rejected": "y", "truncation_mode": "keep_end"},
    ]
    batch = next(pd.get_batch_iterator(examples, ByT5Tokenizer(), 2, 32, 16, shuffle=False, n_epochs=1))
    assert batch["fields"] == [{"answer": "1"}, {}]
    assert rewards.field_columns(batch["fields"]) == {"answer": ["1", None]}
    assert "fields" not in next(pd.get_batch_iterator(examples[1:], ByT5Tokenizer(), 2, 32, 16, n_epochs=1))


def test_a_column_named_as_a_reward_functions_parameter_is_one_sentence(tmp_path, log):
    assert rewards.field_columns([{}, None]) == {}
    for column in ("prompts", "completions"):
        with pytest.raises(DataError) as refused:
            rewards.field_columns([{"answer": "1"}, {column: "x"}])
        assert str(refused.value) == (
            f"The data has a column named {column!r}, which reward functions would receive as their own {column} "
            f"argument; rename that column in the data file (e.g. to {column}_field)."
        )
    # make_pairs refuses it before any model loads or anything is written
    f = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "p", "completions": "x"}])
    config = config_of(
        "make_pairs",
        ["policy=" + str(needs_shared("models", "stories260K")), f"output={tmp_path / 'o.jsonl'}", "datasets=[hf]"]
        + [hf_both(f), "reward_functions=[fieldmod:exact]"],
    )
    with pytest.raises(DataError, match="a column named 'completions', which reward functions would receive"):
        make_pairs.main(config)
    assert not (tmp_path / "o.jsonl").exists() and not log.exists()


# ----------------------------------------------------------------------------- every caller passes them

# make_pairs' samples with k=4 are these texts, in order, for every prompt (the generator replaced)
TEXTS = [" 9", " 12", "9 ", " x"]


def test_make_pairs_scores_each_completion_with_its_prompts_answer(tmp_path, log, monkeypatch):
    real = sampling.generate_batch

    def generate(*args, **kwargs):
        out = real(*args, **kwargs)
        return [{**o, "text": TEXTS[i % 4]} for i, o in enumerate(out)]

    monkeypatch.setattr(sampling, "generate_batch", generate)
    p = write_jsonl(tmp_path / "prompts.jsonl", prompt_rows())
    output = tmp_path / "pairs.jsonl"
    policy = needs_shared("models", "stories260K")
    overrides = [f"policy={policy}", f"output={output}", "datasets=[hf]", hf_both(p), "reward_functions=[fieldmod:exact]"]
    counts = make_pairs.main(config_of("make_pairs", [*overrides, "k=4", "max_new_tokens=2", "max_failure_rate=1"]))
    samples = [json.loads(line) for line in Path(f"{output}.samples.jsonl").read_text().splitlines()]
    assert len(samples) == 16 * 4 and [s["completion"] for s in samples] == TEXTS * 16
    # by hand: answer 9 (8 prompts): 1, 0, 1, 0 -> 4 pairs, 2 ties; answer 12 (1+11): 0, 1, 0, 0 -> 3 pairs, 3 ties;
    # the 6 other answers: all 0 -> 6 ties; no answer: 4 failures
    for s in samples:
        answer = ANSWERS[s["prompt"]]
        assert s["score"] == (None if answer is None else float(s["completion"].strip() == answer)), s
    assert counts == {"prompts": 16, "completions": 64, "pairs": 8 * 4 + 3, "ties": 8 * 2 + 3 + 6 * 6, "failures": 4}
    assert [(c["prompt"], c["answer"]) for c in calls(log)] == [(s["prompt"], ANSWERS[s["prompt"]]) for s in samples]
    pairs = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(pairs) == 35 and all(r["answer"] == ANSWERS[r["prompt"]] and r["source"] == "sums" for r in pairs)
    assert collections.Counter((r["chosen"], r["rejected"]) for r in pairs) == {
        (" 9", " 12"): 8,
        (" 9", " x"): 8,
        ("9 ", " 12"): 8,
        ("9 ", " x"): 8,
        (" 12", " 9"): 1,
        (" 12", "9 "): 1,
        (" 12", " x"): 1,
    }


def test_online_dpo_scores_each_completion_with_its_prompts_answer(tmp_path, log):
    p = write_jsonl(tmp_path / "prompts.jsonl", prompt_rows())
    online = ["online.enabled=true", "online.scorer=reward_function", "online.max_new_tokens=4", "loss.beta=0.1"]
    run_dir = run_train(
        [*online, "sample_during_eval=false", "reward_functions=[fieldmod:exact]", "datasets=[hf]", hf_both(p)]
        + ["n_examples=16", "eval_every=16", "online.max_failure_rate=1"],
        tmp_path / "out",
    )
    seen = calls(log)
    # the first eval (16 prompts, one completion each), two steps of 8 prompts (2 completions each), the last eval
    assert len(seen) == 16 + 2 * 8 * 2 + 16
    assert all(c["answer"] == ANSWERS[c["prompt"]] for c in seen)
    assert [c["prompt"] for c in seen[16:48:2]] == [c["prompt"] for c in seen[17:48:2]]  # both completions of a prompt
    evals = [r for r in metric_records(run_dir) if "eval/scores" in r]
    last = seen[-16:]
    by_hand = [float(c["completion"].strip() == c["answer"]) for c in last if c["answer"] is not None]
    assert evals[-1]["eval/scores"] == pytest.approx(sum(by_hand) / 15)


def test_evaluate_judge_reward_function_scores_each_response_with_its_prompts_answer(tmp_path, log):
    rows = [
        {"prompt": p, "chosen": f" {a}" if k % 2 else " 0", "rejected": " -1", "answer": a}
        for k, (p, a) in enumerate(list(ANSWERS.items())[:6])
    ]
    f = write_jsonl(tmp_path / "pairs.jsonl", rows)
    overrides = [f"policy={needs_shared('models', 'stories260K')}", f"output_root={tmp_path / 'out'}", "datasets=[json]"]
    overrides += [f"data.json.path={{train: '{f}', test: '{f}'}}", "judge=reward_function", "reward_functions=[fieldmod:exact]"]
    overrides += ["n_prompts=6", "temperatures=[1.0]", "max_new_tokens=4", "generate_batch_size=3", "num_threads=1"]
    out = Path(evaluate.main(config_of("evaluate", [*overrides, "progress_bar=false"])))
    verdicts = [json.loads(line) for line in (out / "verdicts.jsonl").read_text().splitlines()]
    assert len(verdicts) == 6
    for k, r in enumerate(verdicts):
        answer = ANSWERS[r["judge_prompt"]]
        assert r["fields"] == {"answer": answer} and r["b"] == (f" {answer}" if k % 2 else " 0")
        assert r["detail"] == {"score_a": float(r["a"].strip() == answer), "score_b": float(k % 2)}
    assert all(c["answer"] == ANSWERS[c["prompt"]] for c in calls(log)) and len(calls(log)) >= 6
    stats = json.loads((out / "results.json").read_text())["temperatures"]["1"]
    assert stats["reward_mean"] == pytest.approx(sum(r["detail"]["score_a"] for r in verdicts) / 6)


def test_answers_eval_scores_each_greedy_answer_with_its_prompts_answer(tmp_path, log):
    rows = [{"prompt": p, "chosen": " 1", "rejected": " 2", **({"answer": a} if a else {})} for p, a in ANSWERS.items()]
    f = write_jsonl(tmp_path / "pairs.jsonl", rows)
    run_dir = run_train(
        ["datasets=[json]", f"data.json.path={{train: '{f}', test: '{f}'}}", "eval_reward_functions=[fieldmod:exact]"]
        + ["n_examples=8", "eval_every=8", "sample_during_eval=false"],
        tmp_path / "out",
    )
    seen = calls(log)
    assert len(seen) == 2 * 16  # the first eval and the last, each of the 16 eval prompts
    assert all(c["answer"] == ANSWERS[c["prompt"]] for c in seen)
    last = [r for r in metric_records(run_dir) if "answers_eval/fieldmod:exact" in r][-1]
    by_hand = [float(c["completion"].strip() == c["answer"]) for c in seen[-16:] if c["answer"] is not None]
    assert last["answers_eval/fieldmod:exact"] == pytest.approx(sum(by_hand) / 15)
    assert last["answers_eval/fieldmod:exact_failed"] == pytest.approx(1 / 16)  # the row with no answer
    assert not math.isnan(last["answers_eval/fieldmod:exact"])
