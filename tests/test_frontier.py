"""scripts/frontier.py and scripts/frontier_results.py (the sentiment frontier, DPO paper Figure 2 left): their pure
pieces by hand (prompts, Best-of-N by the true reward and by a reward model, the reference from many samples, the
interval across seeds, the label budgets), and one tiny end-to-end run of the whole pipeline on stories260K."""

from __future__ import annotations

import json
import math
import random

import pytest
from conftest import needs_shared

from scripts import frontier
from scripts import frontier_results as results


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
    assert results.best_of_n_kl(1) == 0.0
    assert results.best_of_n_kl(4) == pytest.approx(1.3862944 - 0.75, abs=1e-6)  # 0.6362944
    assert results.best_of_n_kl(16) == pytest.approx(2.7725887 - 0.9375, abs=1e-6)  # 1.8350887
    assert results.best_of_n_kl(64) == pytest.approx(4.1588831 - 0.984375, abs=1e-6)  # 3.1745081


def test_best_of_n_rewards_from_a_score_table_by_hand():
    table = [[0.1, 0.5, -0.2, 0.9], [None, -0.3, 0.2, 0.0]]
    assert results.best_of_n(table, 1) == [0.1]  # the second prompt's first sample failed
    assert results.best_of_n(table, 2) == [0.5, -0.3]
    assert results.best_of_n(table, 4) == [0.9, 0.2]
    with pytest.raises(ValueError, match="Best-of-5 needs 5 samples per prompt"):
        results.best_of_n(table, 5)
    samples = [{"id": f"hf/{i}", "score": s} for i, row in enumerate(table) for s in row]
    two, four = results.bon_rows(samples, [2, 4])
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


def test_best_of_n_by_a_reward_model_picks_its_first_ranked_sample_and_scores_it_by_the_truth():
    picker = [[0.3, 2.0, 1.0, 5.0], [1.0, 1.0, -2.0, 0.0], [0.0, 4.0, 1.0, 1.0]]  # the reward model's scores
    truth = [[0.9, -0.5, 0.1, 0.7], [0.2, 0.8, 0.95, -0.1], [0.4, None, 0.6, 0.3]]  # the true sentiment of the same samples
    # N=1: the first sample, whatever the scores
    assert results.best_of_n_by(picker, truth, 1) == [0.9, 0.2, 0.4]
    # N=2: the RM ranks the second first in prompt 0 (true -0.5: below its best 0.9), ties in prompt 1 (the earlier: 0.2),
    # picks prompt 2's second, whose true score failed: that prompt gives none
    assert results.best_of_n_by(picker, truth, 2) == [-0.5, 0.2]
    # N=4: prompt 0's 5.0 (0.7), prompt 1's tie of the first two again (0.2), prompt 2's 4.0 again (failed)
    assert results.best_of_n_by(picker, truth, 4) == [0.7, 0.2]
    assert results.best_of_n(truth, 4) == [0.9, 0.95, 0.6]  # the oracle, for contrast
    with pytest.raises(ValueError, match="Best-of-5 needs 5 samples per prompt"):
        results.best_of_n_by(picker, truth, 5)

    samples = [{"id": f"hf/{i}", "score": s} for i, row in enumerate(truth) for s in row]
    rm_scores = [r for row in picker for r in row]
    two, four = results.bon_rm_rows(samples, rm_scores, [2, 4])
    assert (two["reward_mean"], two["reward_n"]) == (pytest.approx(-0.15), 2)  # (-0.5 + 0.2) / 2
    assert (four["reward_mean"], four["label"], four["method"]) == (
        pytest.approx(0.45),
        "Best-of-4 (RM)",
        "Best-of-N (reward model)",
    )
    assert four["kl_mean"] == pytest.approx(math.log(4) - 0.75)  # the oracle's bound: one of N i.i.d. samples picked
    with pytest.raises(ValueError, match="11 reward-model scores for 12 samples"):
        results.bon_rm_rows(samples, rm_scores[:-1], [2])


def test_the_reward_models_pair_accuracy_by_hand():
    # wins 2.0 > 1.0 and 3.0 > -1.0, a tie 1.0 = 1.0 counts half, 0.5 < 0.7 a loss: (1 + 0.5 + 0 + 1) / 4
    assert results.pair_accuracy([2.0, 1.0, 0.5, 3.0], [1.0, 1.0, 0.7, -1.0]) == 0.625
    with pytest.raises(ValueError, match="as many chosen as rejected"):
        results.pair_accuracy([1.0], [])


def test_the_reference_is_the_mean_of_all_its_samples_with_an_interval_over_prompts():
    table = [[0.2, 0.4, None, 0.6], [-0.1, 0.1, 0.3, 0.5]]  # per prompt: 0.4 (the failed sample left out), 0.2
    row = results.reference_row(table)
    # mean 0.3, sd of (0.4, 0.2) = 0.1 sqrt(2), t(0.975, 1) = 12.7062: half-width 12.7062 * 0.1 sqrt(2) / sqrt(2) = 1.27062
    assert row["reward_mean"] == pytest.approx(0.3)
    assert (row["reward_ci_low"], row["reward_ci_high"]) == pytest.approx((-0.970620, 1.570620), abs=1e-5)
    assert (row["kl_mean"], row["label"], row["reward_n"]) == (0.0, "reference (4 samples)", 2)


def _seed_row(reward: float, kl: float, win: float) -> dict:
    interval = {"reward_ci_low": reward - 0.1, "reward_ci_high": reward + 0.1, "kl_ci_low": kl - 1, "kl_ci_high": kl + 1}
    row = {"method": "DPO", "label": "DPO β=0.1", "beta": 0.1, "reward_mean": reward, "kl_mean": kl, **interval}
    return {**row, "reward_n": 128, "kl": "Monte Carlo", "win_rate_vs_reference": win, "ended": 0.0, "tokens": 48.0}


def test_a_point_across_seeds_is_the_mean_of_the_per_seed_means_with_their_t_interval_by_hand():
    point = results.across_seeds({0: _seed_row(0.80, 5.0, 0.9), 1: _seed_row(0.86, 6.0, 0.8), 2: _seed_row(0.92, 10.0, 1.0)})
    # reward: mean 0.86, sd 0.06, t(0.975, 2) = 4.302653: half-width 4.302653 * 0.06 / sqrt(3) = 0.149048
    assert point["reward_mean"] == pytest.approx(0.86)
    assert (point["reward_ci_low"], point["reward_ci_high"]) == pytest.approx((0.710952, 1.009048), abs=1e-6)
    # KL: mean 7, sd sqrt((4 + 1 + 9) / 2) = sqrt(7): half-width 4.302653 * sqrt(7) / sqrt(3) = 6.572411
    assert point["kl_mean"] == pytest.approx(7.0)
    assert (point["kl_ci_low"], point["kl_ci_high"]) == pytest.approx((0.427589, 13.572411), abs=1e-6)
    assert point["win_rate_vs_reference"] == pytest.approx(0.9)
    assert (point["seeds"], point["label"], point["interval"]) == ([0, 1, 2], "DPO β=0.1", "across seeds")
    assert [(s["seed"], s["reward_mean"], s["kl_mean"], s["kl_ci_high"]) for s in point["per_seed"]] == [
        (0, 0.80, 5.0, 6.0),
        (1, 0.86, 6.0, 7.0),
        (2, 0.92, 10.0, 11.0),
    ]
    line = next(x for x in results.frontier_table([point]).splitlines() if x.startswith("| DPO"))
    assert (
        line
        == "| DPO β=0.1 | 0.1 | 0.860 [0.711, 1.009] | 7.00 [0.43, 13.57] | 0.800, 0.860, 0.920 | 5.00, 6.00, 10.00 | 0.90 | 3 seeds |"
    )

    # Best-of-N (RM): the reward across seeds, the KL bound kept
    bound = results.best_of_n_kl(4)
    rm = {s: {**_seed_row(r, bound, None), "method": "Best-of-N (reward model)"} for s, r in ((0, 0.7), (1, 0.8))}
    for r in rm.values():
        r.update(kl_ci_low=None, kl_ci_high=None)
    point = results.across_seeds(rm, names=("reward",))
    # mean 0.75, sd 0.05 sqrt(2), t(0.975, 1) = 12.706205: half-width 12.706205 * 0.05 = 0.635310
    assert (point["reward_ci_low"], point["reward_ci_high"]) == pytest.approx((0.114690, 1.385310), abs=1e-6)
    assert (point["kl_mean"], point["kl_ci_low"], point["win_rate_vs_reference"]) == (bound, None, None)


def test_label_budgets_by_hand():
    rows = [("a", "x", 0.5), ("a", "y", 0.5), ("a", "z", -0.2), ("a", "x", 0.5), ("b", "u", 0.1), ("b", "v", None)]
    rows += [("b", "w", 0.3), ("b", "t", 0.1)]
    samples = [{"id": i, "completion": c, "score": s} for i, c, s in rows]
    # a: x y z distinct (the second x repeats the first): x>z, y>z, x=y tie; b: u w t scored: w>u, w>t, u=t tie
    assert results.offline_budget(samples, 4) == {"reward_function_calls": 8, "pairs_compared": 6, "ties": 2, "pairs_labelled": 4}
    with pytest.raises(ValueError, match="the samples give 4 labelled pairs .2 ties., the pairs file 5"):
        results.offline_budget(samples, 5)

    records = [
        {"counters/examples": 32.0, "online/labelled_pairs": 1.0, "online/ties": 0.0625},  # 32 prompts, 2 ties (coins)
        {"counters/examples": 32.0, "eval/scores": 0.5},  # an eval record: not counted
        {"counters/examples": 64.0, "online/labelled_pairs": 1.0, "online/ties": 0.03125},  # 32 more, 1 tie
        {"counters/examples": 76.0, "online/labelled_pairs": 0.75, "online/ties": 0.25},  # 12 more, 3 ties skipped: 9 labelled
    ]
    assert results.online_budget(records) == {"reward_function_calls": 152, "pairs_compared": 76, "ties": 6, "pairs_labelled": 73}


def test_online_dpo_labels_as_many_pairs_as_the_offline_file_has_whatever_the_epochs(tmp_path):
    args = frontier.parse_args(["--epochs", "2", "--methods", "dpo", "online", "rm", "--betas", "0.1"])
    assert args.seeds == [0, 1, 2]
    common = frontier.train_overrides(args, "model", 2 * 1484, 128, seed=1)
    commands = {m.name: frontier.merged(common, m.overrides) for m in frontier.methods(args, tmp_path, 1484)}
    for name, overrides in commands.items():
        keys = [o.split("=", 1)[0] for o in overrides]
        assert len(keys) == len(set(keys)), name  # one value per key in the printed command
        assert "seed=1" in overrides
    assert "n_examples=2968" in commands["dpo_beta0.1"]  # offline: 2 passes over the 1,484 labelled pairs
    # online: one sampled pair per prompt, a tie labelled by a coin: 1,484 prompts give 1,484 labelled pairs
    assert {"n_examples=1484", "eval_every=1484", "online.ties=random"} <= set(commands["online_dpo_beta0.1"])
    assert {"loss=reward", "lr=0.001", "save_hf_export=true"} <= set(commands["reward_model"])
    assert "lr=0.0001" in commands["dpo_beta0.1"] and "save_hf_export=false" in commands["dpo_beta0.1"]
    with pytest.raises(SystemExit):
        frontier.parse_args(["--seeds", "0", "0"])


@pytest.mark.system  # frontier.main starts train.py and evaluate.py as processes
def test_the_frontier_end_to_end_at_a_tiny_size(tmp_path, capsys):
    model = needs_shared("models", "stories260K")
    out, plot = tmp_path / "frontier", tmp_path / "docs" / "frontier.png"
    argv = ["--out", str(out), "--model", str(model), "--n-stories", "64", "--n-train", "6", "--n-test", "4", "--seeds", "0", "1"]
    argv += "--max-new-tokens 8 --best-of 2 4 --methods dpo online rm --betas 0.1 --batch-size 4".split()
    got = frontier.main([*argv, "--copy-plot", str(plot)])
    printed = capsys.readouterr().out

    for name in ("frontier.png", "frontier.md", "results.json", "prompts_train.jsonl", "prompts_test.jsonl"):
        assert (out / name).is_file(), name
    assert plot.read_bytes() == (out / "frontier.png").read_bytes()
    assert json.loads((out / "results.json").read_text()) == json.loads(json.dumps(got))

    train, test = ([json.loads(line)["prompt"] for line in (out / f"prompts_{s}.jsonl").open()] for s in ("train", "test"))
    assert (len(train), len(test)) == (6, 4) and not set(train) & set(test)
    assert all(2 <= len(p.split()) <= 8 for p in train + test)

    rows = {r["label"]: r for r in got["rows"]}
    labels = ["DPO β=0.1", "online DPO β=0.1", "Best-of-2", "Best-of-4", "Best-of-2 (RM)", "Best-of-4 (RM)"]
    assert list(rows) == ["reference (4 samples)", *labels]
    samples = [json.loads(line) for line in (out / "best_of_n.jsonl.samples.jsonl").open()]
    groups = _by_id(samples)
    assert len(samples) == 4 * 4
    per_prompt = [sum(s["score"] for s in g) / 4 for g in groups.values()]
    assert rows["reference (4 samples)"]["reward_mean"] == pytest.approx(sum(per_prompt) / 4)
    assert rows["reference (4 samples)"]["kl_mean"] == 0.0

    _check_trained_points(out, rows)
    _check_best_of_n(out, got, rows, samples)
    _check_label_budgets(out, got)

    table = (out / "frontier.md").read_text()
    for r in got["rows"]:
        reward = f"{r['reward_mean']:.3f}"
        assert any(line.startswith(f"| {r['label']} |") and reward in line for line in table.splitlines()), r
    assert "PPO is not implemented here" in table and "| online DPO, seed 1 |" in table and "chance 0.5" in table
    assert "$ python train.py " in printed and "$ python evaluate.py " in printed and "$ python make_pairs.py " in printed
    assert "$ python scripts/reward_model_scores.py " in printed


def _check_trained_points(out, rows: dict) -> None:
    """Each trained point: the mean over the 2 seeds of each seed's own evaluation."""
    for name, label in (("dpo_beta0.1", "DPO β=0.1"), ("online_dpo_beta0.1", "online DPO β=0.1")):
        evals = [json.loads((out / "eval" / name / f"seed{s}" / "results.json").read_text())["temperatures"]["1"] for s in (0, 1)]
        assert [(s["seed"], s["reward_mean"], s["kl_mean"]) for s in rows[label]["per_seed"]] == [
            (s, e["reward_mean"], e["kl_mean"]) for s, e in zip((0, 1), evals)
        ]
        assert rows[label]["reward_mean"] == pytest.approx((evals[0]["reward_mean"] + evals[1]["reward_mean"]) / 2)
        assert rows[label]["kl_mean"] == pytest.approx((evals[0]["kl_mean"] + evals[1]["kl_mean"]) / 2)


def _check_best_of_n(out, got: dict, rows: dict, samples: list[dict]) -> None:
    """Best-of-N by the true reward and by each seed's reward model, and its pair accuracy, from the scores on disk."""
    groups = _by_id(samples)
    for n in (2, 4):
        best = [max(s["score"] for s in g[:n]) for g in groups.values()]
        assert rows[f"Best-of-{n}"]["reward_mean"] == pytest.approx(sum(best) / len(best))
        assert rows[f"Best-of-{n}"]["kl_mean"] == rows[f"Best-of-{n} (RM)"]["kl_mean"] == pytest.approx(math.log(n) - (n - 1) / n)
        by_seed = []
        for seed in (0, 1):
            rm = json.loads((out / "reward_model_scores" / f"seed{seed}.json").read_text())["samples"]
            picked = [max(g[:n], key=lambda s: rm[samples.index(s)])["score"] for g in groups.values()]
            by_seed.append(sum(picked) / len(picked))
        assert [s["reward_mean"] for s in rows[f"Best-of-{n} (RM)"]["per_seed"]] == pytest.approx(by_seed)
    scored = [json.loads((out / "reward_model_scores" / f"seed{s}.json").read_text()) for s in (0, 1)]
    n_test_pairs = len((out / "pairs_test.jsonl").read_text().splitlines())
    accuracy = [sum(c > r for c, r in zip(s["chosen"], s["rejected"])) / n_test_pairs for s in scored]
    assert list(got["reward_model"]["per_seed"].values()) == pytest.approx(accuracy)


def _check_label_budgets(out, got: dict) -> None:
    """Online DPO labelled as many pairs as the offline file has, two reward-function calls each."""
    pairs = (out / "pairs_train.jsonl").read_text().splitlines()
    assert got["examples_per_run"] == len(pairs) and got["label_budgets"]["offline"]["pairs_labelled"] == len(pairs)
    assert got["label_budgets"]["offline"]["reward_function_calls"] == 6 * 4
    for seed in (0, 1):
        online = got["label_budgets"]["online"][seed]
        assert (online["pairs_labelled"], online["pairs_compared"], online["reward_function_calls"]) == (
            len(pairs),
            len(pairs),
            2 * len(pairs),
        )
        for name in ("dpo_beta0.1", "online_dpo_beta0.1"):
            assert f"Done: {len(pairs)} examples." in (out / "logs" / f"{name}_seed{seed}.log").read_text()


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


def test_reward_model_scores_refuses_a_folder_without_a_model_or_without_a_trained_head_in_one_sentence(tmp_path, capsys):
    from scripts import reward_model_scores

    samples = tmp_path / "s.jsonl"
    samples.write_text('{"id": "hf/0", "prompt": "a", "completion": " b", "score": 0.1}\n')
    with pytest.raises(SystemExit) as e:
        reward_model_scores.main(
            ["--reward-model", str(tmp_path / "nowhere"), "--samples", str(samples), "--output", str(tmp_path / "o")]
        )
    assert e.value.code == 2
    assert capsys.readouterr().err.endswith(
        f"error: --reward-model {tmp_path / 'nowhere'} is not a Hugging Face model folder (no config.json); give a loss=reward run's LATEST/hf.\n"
    )
    model = needs_shared("models", "stories260K")  # a causal LM: no score head
    with pytest.raises(SystemExit) as e:
        reward_model_scores.main(["--reward-model", str(model), "--samples", str(samples), "--output", str(tmp_path / "o")])
    assert (
        str(e.value)
        == f"Error: --reward-model {model} has no trained score head; give a reward model (a loss=reward run's LATEST/hf)."
    )
    assert not (tmp_path / "o").exists()
