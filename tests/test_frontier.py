"""scripts/frontier.py (the sentiment frontier, DPO paper Figure 2 left): its pure pieces by hand,
and one tiny end-to-end run of the whole pipeline on stories260K."""

from __future__ import annotations

import json
import math
import random

import pytest
from conftest import needs_shared

from scripts import frontier


class Draws:
    """A stand-in for random.Random whose randint returns the given numbers in turn."""

    def __init__(self, numbers: list[int]):
        self.numbers = iter(numbers)

    def randint(self, a: int, b: int) -> int:
        n = next(self.numbers)
        assert a <= n <= b
        return n


def test_story_prefixes_by_hand():
    texts = [
        "Once upon a time there was",  # n=2: "Once upon"
        "Once upon a time there was",  # n=3: "Once upon a"
        "The cat sat.",  # n=3: only 3 words, the last may be cut off: none
        "  Lily   saw\na big dog and smiled",  # n=5: whitespace collapsed
        "Once upon a time, a dog",  # n=2: "Once upon" again: dropped
        "One day",  # n=8: too short
    ]
    got = frontier.story_prefixes(texts, Draws([2, 3, 3, 5, 2, 8]))
    assert got == ["Once upon", "Once upon a", "Lily saw a big dog"]


def test_story_prefixes_word_counts_in_range_and_the_same_for_a_seed():
    texts = [" ".join(f"w{i}_{j}" for j in range(12)) for i in range(300)]  # distinct 12-word texts
    first = frontier.story_prefixes(texts, random.Random(7))
    assert first == frontier.story_prefixes(texts, random.Random(7))
    assert first != frontier.story_prefixes(texts, random.Random(8))
    counts = {len(p.split()) for p in first}
    assert counts == set(range(2, 9))  # 300 draws from 7 values: each appears
    assert len(first) == 300 and all(p == " ".join(t.split()[: len(p.split())]) for p, t in zip(first, texts))


def test_best_of_n_kl_by_hand():
    # log N - (N - 1) / N
    assert frontier.best_of_n_kl(1) == 0.0
    assert frontier.best_of_n_kl(4) == pytest.approx(1.3862944 - 0.75, abs=1e-6)  # 0.6362944
    assert frontier.best_of_n_kl(16) == pytest.approx(2.7725887 - 0.9375, abs=1e-6)  # 1.8350887
    assert frontier.best_of_n_kl(64) == pytest.approx(4.1588831 - 0.984375, abs=1e-6)  # 3.1745081


def test_best_of_n_rewards_from_a_score_table_by_hand():
    table = [[0.1, 0.5, -0.2, 0.9], [None, -0.3, 0.2, 0.0]]
    assert frontier.best_of_n(table, 1) == [0.1]  # the second prompt's first sample failed
    assert frontier.best_of_n(table, 2) == [0.5, -0.3]
    assert frontier.best_of_n(table, 4) == [0.9, 0.2]
    with pytest.raises(ValueError, match="Best-of-5 needs 5 samples per prompt"):
        frontier.best_of_n(table, 5)
    samples = [{"id": f"hf/{i}", "score": s} for i, row in enumerate(table) for s in row]
    two, four = frontier.bon_rows(samples, [2, 4])
    # N=2: per-prompt best 0.5, -0.3: mean 0.1, sd 0.8/sqrt(2), t(0.975, 1) = 12.7062: half-width 12.7062 * 0.4
    assert two["reward_mean"] == pytest.approx(0.1)
    assert (two["reward_ci_low"], two["reward_ci_high"]) == pytest.approx((0.1 - 5.08248, 0.1 + 5.08248), abs=1e-4)
    assert (two["kl_mean"], two["label"]) == (pytest.approx(math.log(2) - 0.5), "Best-of-2")
    assert four["reward_mean"] == pytest.approx(0.55) and four["reward_n"] == 2


def test_preferred_ft_takes_each_prompts_best_completion():
    pairs = [
        {"prompt": "a", "chosen": "x", "rejected": "y", "chosen_score": 0.9, "rejected_score": 0.1},
        {"prompt": "a", "chosen": "z", "rejected": "y", "chosen_score": 0.5, "rejected_score": 0.1},
        {"prompt": "b", "chosen": "u", "rejected": "v", "chosen_score": 0.2, "rejected_score": -0.4},
        {"prompt": "a", "chosen": "x", "rejected": "z", "chosen_score": 0.9, "rejected_score": 0.5},
    ]
    assert frontier.preferred_rows(pairs) == [
        {"prompt": "a", "chosen": "x", "rejected": "y"},
        {"prompt": "b", "chosen": "u", "rejected": "v"},
    ]


@pytest.mark.system  # frontier.main starts train.py and evaluate.py as processes
def test_the_frontier_end_to_end_at_a_tiny_size(tmp_path, capsys):
    model = needs_shared("models", "stories260K")
    out, plot = tmp_path / "frontier", tmp_path / "docs" / "frontier.png"
    argv = ["--out", str(out), "--model", str(model), "--n-stories", "64", "--n-train", "6", "--n-test", "4"]
    argv += ["--max-new-tokens", "8", "--best-of", "2", "4", "--methods", "dpo", "--betas", "0.1", "--batch-size", "4"]
    results = frontier.main([*argv, "--copy-plot", str(plot)])
    printed = capsys.readouterr().out

    for name in ("frontier.png", "frontier.md", "results.json", "prompts_train.jsonl", "prompts_test.jsonl"):
        assert (out / name).is_file(), name
    assert plot.read_bytes() == (out / "frontier.png").read_bytes()
    assert json.loads((out / "results.json").read_text()) == json.loads(json.dumps(results))

    train, test = ([json.loads(line)["prompt"] for line in (out / f"prompts_{s}.jsonl").open()] for s in ("train", "test"))
    assert (len(train), len(test)) == (6, 4) and not set(train) & set(test)
    assert all(2 <= len(p.split()) <= 8 for p in train + test)

    rows = {r["label"]: r for r in results["rows"]}
    assert list(rows) == ["reference (stories260K)", "DPO β=0.1", "Best-of-2", "Best-of-4"]
    assert rows["reference (stories260K)"]["kl_mean"] == 0.0  # the model against itself
    dpo = json.loads((out / "eval" / "dpo_beta0.1" / "results.json").read_text())["temperatures"]["1"]
    assert (rows["DPO β=0.1"]["reward_mean"], rows["DPO β=0.1"]["kl_mean"]) == (dpo["reward_mean"], dpo["kl_mean"])

    # Best-of-N recomputed from the 4 samples per held-out prompt that make_pairs.py scored
    samples = [json.loads(line) for line in (out / "best_of_n.jsonl.samples.jsonl").open()]
    assert len(samples) == 4 * 4
    for n in (2, 4):
        best = [max(s["score"] for s in group[:n]) for group in _by_id(samples).values()]
        assert rows[f"Best-of-{n}"]["reward_mean"] == pytest.approx(sum(best) / len(best))
        assert rows[f"Best-of-{n}"]["kl_mean"] == pytest.approx(math.log(n) - (n - 1) / n)

    # every trained run saw the same number of examples: the number of train pairs
    pairs = (out / "pairs_train.jsonl").read_text().splitlines()
    assert results["examples_per_run"] == len(pairs)
    assert f"Done: {len(pairs)} examples." in (out / "logs" / "dpo_beta0.1.log").read_text()

    table = (out / "frontier.md").read_text()
    for r in results["rows"]:
        reward = f"{r['reward_mean']:.3f}"
        kl = f"{r['kl_mean']:.2f}"
        assert any(line.startswith(f"| {r['label']} |") and reward in line and kl in line for line in table.splitlines()), r
    assert "PPO is not implemented here" in table
    assert "$ python train.py " in printed and "$ python evaluate.py " in printed and "$ python make_pairs.py " in printed


def _by_id(samples: list[dict]) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = {}
    for s in samples:
        grouped.setdefault(s["id"], []).append(s)
    return grouped


def test_a_missing_model_is_one_sentence_and_exit_2_before_anything_is_written(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        frontier.main(["--out", str(tmp_path / "out"), "--model", str(tmp_path / "nowhere")])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        f"Error: --model {tmp_path / 'nowhere'} is not a Hugging Face model folder (no config.json); give stories260K's folder.\n"
    )
    assert not (tmp_path / "out").exists()
