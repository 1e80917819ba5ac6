"""scripts/main_job_seeds.py: the run folders it reads from the main job's output, and its across-seed table."""

from __future__ import annotations

from scripts import main_job_seeds as seeds


def fake_results() -> dict[int, dict]:
    """Three seeds; SFT's answers at 0 / 8000 examples (0, 0.2), (0, 0.9), (0, 0.4); DPO's accuracies at its end."""
    answers = {0: 0.2, 1: 0.9, 2: 0.4}
    accuracies = {0: 0.8, 1: 0.9, 2: 1.0}
    results = {}
    for seed in answers:
        sft = {0: {"answers_eval/arithmetic": 0.0}, 8000: {"answers_eval/arithmetic": answers[seed]}}
        dpo = {0: {"rewards_eval/accuracies": 0.0}, 8000: {"rewards_eval/accuracies": accuracies[seed]}}
        results[seed] = {"evals": {"SFT": sft, "DPO": dpo, "RPO": {}, "SFT continued": {}}}
    return results


def test_the_main_jobs_closing_line_gives_both_run_folders():
    # runs/launch.run_stages prints this line after both stages (a newline before it)
    out = "...\n\nBoth stages finished: the SFT run /o/sft_run_1, then the dpo run /o/dpo_run_2.\nanswers_eval/...\n"
    assert seeds.FINISHED.search(out).groups() == ("/o/sft_run_1", "/o/dpo_run_2")


def test_summary_gives_the_mean_and_range_over_seeds():
    rows = {(r["stage"], r["metric"], r["examples"]): r for r in seeds.summary(fake_results())}
    late = rows[("SFT", "answers_eval/arithmetic", 8000)]
    assert late["values"] == {0: 0.2, 1: 0.9, 2: 0.4}
    assert abs(late["mean"] - 0.5) < 1e-12 and (late["min"], late["max"]) == (0.2, 0.9)  # (0.2 + 0.9 + 0.4) / 3
    assert abs(rows[("DPO", "rewards_eval/accuracies", 8000)]["mean"] - 0.9) < 1e-12
    assert ("SFT", "rewards_eval/accuracies", 0) not in rows  # SFT logs no pair accuracies: no row, not a 0


def test_the_table_shows_mean_and_range_and_each_seed():
    text = seeds.markdown(seeds.summary(fake_results()), [0, 1, 2], 90.0)
    assert "| SFT | answers right | 0.00 [0.00, 0.00] | 0.50 [0.20, 0.90] |" in text
    assert "| DPO | pairs ranked right | 0.00 [0.00, 0.00] | 0.90 [0.80, 1.00] |" in text
    assert "| SFT | answers right | 0.20 | 0.90 | 0.40 |" in text  # each seed's value at the stage's end
    assert "chance 0.5" in text and "1.5 min" in text
    assert "| stage | metric | 0 | 8,000 |" in text  # each eval's examples in full (128 was "0k")
