"""make_pairs.py: k sampled completions per prompt, scored by reward functions, paired as the DPO paper's IMDb data."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
from conftest import REPO, TINY
from hydra import compose, initialize_config_dir

import train
from data import formats
from data import prompts as prompt_sets
from online import make_pairs
from utils import ConfigError


def pairs_config(overrides: list[str]):
    """The composed config of ``python make_pairs.py <overrides>``."""
    with initialize_config_dir(config_dir=str(REPO / "config"), version_base="1.3"):
        return compose(config_name="make_pairs", overrides=overrides)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def run(zoo) -> Path:
    return zoo("default")


def test_pairs_by_hand_ties_and_failures_counted():
    # scores 3, 1, 3, None, 2: pairs (0,1) (0,4) (2,1) (2,4) (4,1); tie (0,2); one failure
    pairs, ties, failures = make_pairs.make_pairs(list("abcde"), [3.0, 1.0, 3.0, None, 2.0])
    assert sorted(pairs) == [(0, 1), (0, 4), (2, 1), (2, 4), (4, 1)]
    assert (ties, failures) == (1, 1)
    assert make_pairs.make_pairs(list("abcd"), [4.0, 3.0, 2.0, 1.0])[0] == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]


def test_a_repeated_completion_is_paired_once():
    # Regression (fresh-user trial): k=4 samples "a", "b", "a", "c" scored 2, 1, 2, 2 wrote the pair a > b twice.
    # Distinct texts a (0), b (1), c (3): pairs (0, 1) and (3, 1), tie (0, 3); the second "a" is neither.
    assert make_pairs.make_pairs(list("abac"), [2.0, 1.0, 2.0, 2.0]) == ([(0, 1), (3, 1)], 1, 0)


def test_widest_pairs_by_hand():
    # scores 4, 3, 2, 0.5: gaps (0,1) 1, (0,2) 2, (0,3) 3.5, (1,2) 1, (1,3) 2.5, (2,3) 1.5
    scores = [4.0, 3.0, 2.0, 0.5]
    pairs = make_pairs.make_pairs(list("abcd"), scores)[0]
    assert make_pairs.widest_pairs(pairs, scores, 1) == [(0, 3)]
    assert make_pairs.widest_pairs(pairs, scores, 3) == [(0, 2), (0, 3), (1, 3)]
    assert make_pairs.widest_pairs(pairs, scores, 4) == [(0, 2), (0, 3), (1, 3), (2, 3)]
    # scores 2, 1, 0: (0,1) and (1,2) both have gap 1, the earlier is kept
    assert make_pairs.widest_pairs([(0, 1), (0, 2), (1, 2)], [2.0, 1.0, 0.0], 2) == [(0, 1), (0, 2)]


def test_max_pairs_per_prompt_1_keeps_the_longest_against_the_shortest(run, tmp_path, capsys):
    output = tmp_path / "pairs.jsonl"
    overrides = [f"policy={run}", f"output={output}", "reward_functions=[length]", "n_prompts=5", "k=6", "max_new_tokens=12"]
    counts = make_pairs.main(pairs_config([*overrides, "max_pairs_per_prompt=1"]))
    pairs, samples = read_jsonl(output), read_jsonl(Path(str(output) + ".samples.jsonl"))
    left_out = 0
    for prompt in {s["id"] for s in samples}:
        lengths = [len(t) for t in dict.fromkeys(s["completion"] for s in samples if s["id"] == prompt)]  # distinct texts
        mine = [p for p in pairs if p["id"] == prompt]
        differ = sum(a != b for a, b in itertools.combinations(lengths, 2))
        assert len(mine) == min(differ, 1)
        if mine:
            assert (mine[0]["chosen_score"], mine[0]["rejected_score"]) == (max(lengths), min(lengths))
        left_out += max(differ - 1, 0)
    assert left_out > 0 and counts["pairs"] == len(pairs) and counts["left out by max_pairs_per_prompt"] == left_out
    assert f"{left_out} left out by max_pairs_per_prompt" in capsys.readouterr().out


def test_offline_pairs_by_length_end_to_end_then_trains(run, tmp_path, capsys):
    output = tmp_path / "pairs.jsonl"
    config = pairs_config(
        [
            f"policy={run}",
            f"output={output}",
            "reward_functions=[length]",
            "n_prompts=6",
            "k=4",
            "max_new_tokens=12",
            "data.arithmetic.n_train=64",
            "data.arithmetic.n_test=16",
        ]
    )
    counts = make_pairs.main(config)
    pairs = read_jsonl(output)
    samples = read_jsonl(Path(str(output) + ".samples.jsonl"))
    assert len(samples) == 6 * 4 and counts["prompts"] == 6 and counts["completions"] == 24
    train_prompts = prompt_sets.load_prompts(["arithmetic"], "train", {"arithmetic": {"n_train": 64, "n_test": 16}})
    assert [s["prompt"] for s in samples[::4]] == train_prompts[:6]  # split=train (the default): prompts to train on
    for s in samples:
        assert s["score"] == len(s["completion"])  # length: characters, recomputed here
    assert pairs
    for p in pairs:
        assert p["chosen_score"] == len(p["chosen"]) > p["rejected_score"] == len(p["rejected"])
    expected_pairs = expected_ties = distinct = 0
    for prompt in {s["id"] for s in samples}:
        lengths = [len(t) for t in dict.fromkeys(s["completion"] for s in samples if s["id"] == prompt)]  # distinct texts
        assert 1 <= len(lengths) <= 4
        differ = sum(a != b for a, b in itertools.combinations(lengths, 2))
        assert sum(p["id"] == prompt for p in pairs) == differ
        expected_pairs, expected_ties = expected_pairs + differ, expected_ties + math.comb(len(lengths), 2) - differ
        distinct += len(lengths)
    assert counts.get("repeated completions left out", 0) == 24 - distinct
    assert (counts["pairs"], counts["ties"], counts["failures"]) == (expected_pairs, expected_ties, 0)
    printed = capsys.readouterr().out
    assert f"6 prompts, 24 completions, {expected_pairs} pairs, {expected_ties} ties, 0 failures" in printed
    assert f"python train.py datasets=[json] data.json.path={output} model.archive=" in printed

    from conftest import compose_config

    trained = compose_config(
        [
            *TINY,
            f"output_root={tmp_path}",
            "datasets=[json]",
            f"data.json.path={output}",
            "data.json.holdout_fraction=0",
            f"model.archive={run}/LATEST/policy.pt",
            "n_examples=8",
            "batch_size=4",
            "eval_batch_size=4",
            "n_eval_examples=4",
            "eval_every=8",
        ]
    )
    _, stop = train.main(trained)
    assert stop is None


def test_a_failed_score_is_left_out_and_counted(run, tmp_path, monkeypatch):
    from evaluation import reward_functions

    # None for every completion with an even length: those are failures, never in a pair
    monkeypatch.setitem(
        reward_functions.REWARD_FUNCTIONS,
        "length",
        lambda prompts, completions, **f: [None if len(c) % 2 == 0 else float(len(c)) for c in completions],
    )
    output = tmp_path / "pairs.jsonl"
    config = pairs_config(
        [
            f"policy={run}",
            f"output={output}",
            "reward_functions=[length]",
            "n_prompts=6",
            "max_new_tokens=12",
            "max_failure_rate=1",
        ]
    )
    counts = make_pairs.main(config)
    samples = read_jsonl(Path(str(output) + ".samples.jsonl"))
    failed = [s for s in samples if len(s["completion"]) % 2 == 0]
    assert counts["failures"] == len(failed) and all(s["score"] is None and s["error"] for s in failed)
    assert all(len(p["chosen"]) % 2 == 1 and len(p["rejected"]) % 2 == 1 for p in read_jsonl(output))


def test_a_conversation_pair_is_a_row_the_hf_loader_reads_and_a_text_pair_one_json_reads(tmp_path):
    import collections

    item = {"prompt": [{"role": "user", "content": "Hi?"}], "conversation": True, "id": "hh/0"}
    row = make_pairs.pair_record(item, " Hello there. ", " No.", 13.0, 4.0)
    assert row["chosen"] == [{"role": "assistant", "content": "Hello there."}]
    data = formats.hf_rows_to_data([row], collections.Counter(), "pairs.jsonl")
    assert len(data) == 1 and [len(e["pairs"]) for e in data.values()] == [1]
    text = make_pairs.pair_record({"prompt": "Q: 1+1=\nA:", "conversation": False, "id": "a/0"}, " 2", " 3", 1.0, 0.0)
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(text) + "\n")
    data = formats.get_json("train", collections.Counter(), str(path), holdout_fraction=0)
    assert list(data) == ["Q: 1+1=\nA:"] and data["Q: 1+1=\nA:"]["sft_target"] == " 2"


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["reward_functions=[lenght]"], "'lenght' is not a registered reward function; did you mean 'length'?"),
        (["k=1"], "k must be an integer >= 2"),
        (["split=eval"], "split must be train or test"),
        (["max_pairs_per_prompt=0"], "max_pairs_per_prompt must be null (every pair) or an integer >= 1, got 0."),
    ],
)
def test_bad_input_is_one_sentence_before_any_model_loads(overrides, says, tmp_path, monkeypatch):
    from evaluation import sampling

    monkeypatch.setattr(sampling, "load_source", lambda *a: pytest.fail("a model was loaded"))
    config = pairs_config(["policy=nowhere/run", f"output={tmp_path}/p.jsonl", *overrides])
    with pytest.raises(ConfigError, match=None) as e:
        make_pairs.main(config)
    assert says in str(e.value)
    assert not (tmp_path / "p.jsonl").exists()


def test_text_prompts_and_conversations_mixed_are_refused_before_any_model_loads(run, tmp_path, monkeypatch):
    from evaluation import sampling

    items = [
        {"id": "a/0", "prompt": "Q: 1+1=\nA:", "conversation": False},
        {"id": "b/0", "prompt": [{"role": "user", "content": "Hi?"}], "conversation": True},
    ]
    monkeypatch.setattr(sampling, "load_items", lambda *a, **k: items)
    monkeypatch.setattr(sampling, "load_source", lambda *a: pytest.fail("a model was loaded"))
    config = pairs_config([f"policy={run}", f"output={tmp_path}/p.jsonl", "reward_functions=[length]"])
    with pytest.raises(ConfigError, match="mix text prompts and conversations"):
        make_pairs.main(config)


def test_the_printed_train_command_for_a_named_model_composes_and_names_it(tmp_path):
    """A policy given by name (an hf folder) needs model=blank_model: model=tiny, the default, refuses a name_or_path."""
    from conftest import compose_config, needs_shared

    from evaluation import sampling
    from runs import checks

    folder = str(needs_shared("models", "stories260K"))
    model_config = compose_config(["model=blank_model", f"model.name_or_path={folder}"]).model
    source = sampling.Source(folder, "hf", model_config, None, 0)
    command = make_pairs.train_command(source, str(tmp_path / "pairs.jsonl"))
    args = command.split()[2:]
    assert args[:2] == ["datasets=[json]", f"data.json.path={tmp_path / 'pairs.jsonl'}"]
    config = compose_config(args)
    checks.validate_config(config)
    assert config.model.name_or_path == folder and config.model.config is None


def test_an_output_that_is_what_it_reads_or_a_folder_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    # Regression (issue 34): output= its own input file turned 200 rows into 6; output=<a folder> failed after sampling.
    from evaluation import sampling

    monkeypatch.setattr(sampling, "load_source", lambda *a: pytest.fail("a model was loaded"))
    data = tmp_path / "data"
    data.mkdir()
    rows = data / "rows.jsonl"
    rows.write_text('{"prompt": "Q", "chosen": "a", "rejected": "b"}\n')
    read = ["policy=nowhere/run", "datasets=[json]", f"data.json.path={rows}"]
    cases = {
        str(rows): f"which is data.json.path={rows}, what make_pairs.py reads",
        str(data / "pairs.jsonl"): None,  # beside the input: a new file
        str(data): f"output={data} is a folder; give the pairs file to write, e.g. output={data / 'pairs.jsonl'}.",
        str(rows / "p.jsonl"): f"output={rows / 'p.jsonl'} lies under {rows}, which is a file, not a folder",
    }
    for output, says in cases.items():
        config = pairs_config([*read, f"output={output}"])
        if says is None:
            assert make_pairs.output_problem(config) is None
            continue
        with pytest.raises(ConfigError) as e:
            make_pairs.main(config)
        assert says in str(e.value), output
    in_folder = pairs_config(["policy=nowhere/run", "datasets=[hf]", f"data.hf.path={data}", f"output={data / 'new.jsonl'}"])
    assert f"which lies inside data.hf.path={data}, what make_pairs.py reads" in make_pairs.output_problem(in_folder)
    folder_read = pairs_config(["policy=nowhere/run", "datasets=[json]", f"data.json.path={{train: {rows}, test: {rows}}}"])
    folder_read.output = str(rows)
    assert "which is data.json.path.train=" in make_pairs.output_problem(folder_read)
    assert rows.read_text() == '{"prompt": "Q", "chosen": "a", "rejected": "b"}\n'
