"""bench/compare_objectives.py (the table of objectives from run folders) and Hydra multirun
(``python train.py -m loss=dpo,ipo ...``): its command-line check and where its jobs write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TINY

from bench import compare_objectives as co
from runs import checks

T0 = 1_700_000_000.0  # the config.yaml's modification time in the hand-written runs


def write_run(folder: Path, loss: dict, records: list[dict], wall_s: float, lr: float = 3e-4) -> Path:
    """A run folder by hand: config.yaml (loss + a budget), metrics.jsonl, and file times
    ``wall_s`` apart."""
    folder.mkdir(parents=True)
    lines = [
        f"{k}: {json.dumps(v)}" for k, v in {"seed": 0, "lr": lr, "n_examples": 64, "exp_name": f"{loss['name']}_run"}.items()
    ]
    lines += ["loss:"] + [f"  {k}: {json.dumps(v)}" for k, v in loss.items()]
    (folder / "config.yaml").write_text("\n".join(lines) + "\n")
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    os.utime(folder / "config.yaml", (T0, T0))
    os.utime(folder / "metrics.jsonl", (T0 + wall_s, T0 + wall_s))
    return folder


def train_record(examples: int, per_second: float) -> dict:
    return {"step": examples, "loss/train": 0.6, "examples_per_second": per_second, "counters/examples": examples}


DPO_RECORDS = [
    {"step": 0, "rewards_eval/accuracies": 0.0, "rewards_eval/margins": 0.0, "logps_eval/chosen": -100.0, "loss/eval": 0.6931},
    train_record(32, 16.0),  # 32 examples at 16/s: 2 s
    train_record(64, 8.0),  # 32 more at 8/s: 4 s
    {"step": 64, "rewards_eval/accuracies": 0.75, "rewards_eval/margins": 0.5, "logps_eval/chosen": -104.5, "loss/eval": 0.55},
    {"step": 64, "memory/rank0_peak_rss_mib": 500.0},
]
SFT_RECORDS = [
    {"step": 0, "logps_eval/chosen": -100.0, "loss/eval": 3.0},
    train_record(16, 4.0),  # 4 s
    train_record(48, 32.0),  # 1 s
    train_record(64, 16.0),  # 1 s
    {"step": 64, "logps_eval/chosen": -90.25, "loss/eval": 2.5},
]


@pytest.fixture
def two_runs(tmp_path: Path) -> Path:
    root = tmp_path / "sweep"
    write_run(root / "dpo_run_1", {"name": "dpo", "beta": 0.1, "average_log_prob": False}, DPO_RECORDS, wall_s=42.5)
    write_run(root / "sft_run_1", {"name": "sft"}, SFT_RECORDS, wall_s=7.0)
    return root


def test_the_table_holds_the_numbers_worked_out_by_hand(two_runs):
    rows, notes = co.build_table([str(two_runs)])
    dpo, sft = rows  # sorted by objective
    assert (dpo["objective"], dpo["beta"], dpo["accuracy"], dpo["margin"]) == ("dpo", 0.1, 0.75, 0.5)
    assert (dpo["accuracy_first"], dpo["margin_first"]) == (0.0, 0.0)
    assert dpo["chosen_logp_first"] == -100.0 and dpo["chosen_logp_delta"] == pytest.approx(-4.5)  # -104.5 - (-100)
    assert dpo["logp_unit"] == "seq" and dpo["eval_loss"] == 0.55 and dpo["examples"] == 64
    assert dpo["train_s"] == pytest.approx(6.0)  # 2 s + 4 s
    assert dpo["wall_s"] == pytest.approx(42.5)
    assert dpo["peak_mib"] == 500.0 and sft["peak_mib"] is None  # the run's logged peak; none logged: '-'
    assert sft["objective"] == "sft" and sft["accuracy"] is None and sft["margin"] is None
    assert sft["chosen_logp_delta"] == pytest.approx(9.75)  # -90.25 - (-100)
    assert sft["train_s"] == pytest.approx(6.0) and sft["wall_s"] == pytest.approx(7.0)  # 4 + 1 + 1 s
    assert notes == ["No rewards_eval/* (no implicit reward): sft."]
    table = co.to_markdown(rows, notes).splitlines()
    assert table[2] == "| dpo | 0.1 | 0.000 | 0.750 | 0.000 | 0.500 | -100.000 | -4.500 | seq | 0.550 | 64 | 6 | 42 | 500 |"
    assert table[3] == "| sft | - | - | - | - | - | -100.000 | 9.750 | seq | 2.500 | 64 | 6 | 7 | - |"


def test_main_writes_markdown_csv_json_and_png(two_runs, tmp_path, capsys):
    out = tmp_path / "table"
    assert co.main([str(two_runs / "*_run_1"), "--out", str(out)]) == 0  # a glob of run folders
    printed = capsys.readouterr().out
    assert "| dpo | 0.1 | 0.000 | 0.750 |" in printed
    assert (out / "comparison.md").read_text() in printed
    csv_lines = (out / "comparison.csv").read_text().splitlines()
    assert csv_lines[0].startswith("objective,beta,accuracy_first,accuracy,margin_first,margin,")
    assert csv_lines[2] == "sft,,,,,,-100.0,9.75,seq,2.5,64,6.0,7.0,,sft_run_1"
    data = json.loads((out / "comparison.json").read_text())
    assert [r["objective"] for r in data["rows"]] == ["dpo", "sft"] and data["rows"][0]["eval_steps"] == [0, 64]
    assert (out / "comparison.png").stat().st_size > 1000


def test_the_newest_run_of_an_objective_is_kept_and_a_different_budget_is_noted(two_runs):
    newer = [dict(r) for r in DPO_RECORDS]
    newer[3] = {**newer[3], "rewards_eval/accuracies": 0.5}
    write_run(two_runs / "dpo_run_2", {"name": "dpo", "beta": 0.1, "average_log_prob": False}, newer, wall_s=1.0, lr=1e-3)
    os.utime(two_runs / "dpo_run_2" / "config.yaml", (T0 + 100, T0 + 100))  # made later
    rows, notes = co.build_table([str(two_runs)])
    assert [(r["run"], r["accuracy"]) for r in rows] == [("dpo_run_2", 0.5), ("sft_run_1", None)]
    assert "1 older run(s) of an objective already in the table left out (--all keeps them)." in notes
    assert "The runs' configs differ in lr: not one budget." in notes
    rows, _ = co.build_table([str(two_runs)], keep_all=True)
    assert [r["run"] for r in rows] == ["dpo_run_1", "dpo_run_2", "sft_run_1"]


def test_labels_units_and_a_path_without_runs(tmp_path, capsys):
    assert co.objective_label({"name": "mix", "losses": ["dpo", "bco_pair", "nll"], "weights": [0.8, 0.2, 1.0]}) == (
        "mix(dpo 0.8, bco_pair 0.2, nll 1)"
    )
    assert co.averages_log_probs({"name": "simpo"}) and co.averages_log_probs({"name": "ipo", "average_log_prob": True})
    assert not co.averages_log_probs({"name": "dpo", "average_log_prob": False})
    records = [train_record(8, 0.0), train_record(16, 8.0)]  # a zero rate (nothing logged in it) adds nothing
    assert co.train_seconds(records) == pytest.approx(1.0) and co.train_seconds([]) is None
    assert co.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"Error: {tmp_path} holds no run folder (a folder with config.yaml and metrics.jsonl); give run folders or their output_root.\n"
    )


@pytest.mark.parametrize(
    "argv, sentence",
    [
        (
            ["-m", "loss=dpo,ipoo"],
            "In the job loss=ipoo: loss=ipoo is not an option of loss; did you mean loss=ipo? (options: ",
        ),
        (
            ["--multirun", "loss=dpo,ipo", "n_exampels=8"],
            "In the job loss=dpo: n_exampels is not a config key; did you mean n_examples?",
        ),
        (
            ["-m", "loss=dpo,simpo", "loss.reference_free=true"],
            "In the job loss=simpo: loss=simpo has no key 'reference_free' (keys of loss: ",
        ),
        (["-m", "loss=dpo", "loss.beta=-1"], "loss.beta must be > 0"),  # checks.validate_config's sentence, nothing swept
    ],
)
def test_a_multirun_checks_every_job_before_the_first_starts(argv, sentence):
    # regression: with -m nothing was checked, so a mistake in a later job stopped the sweep after the earlier runs
    problem = checks.command_line_error(argv)
    assert problem is not None and problem.startswith(sentence), problem


def test_a_valid_multirun_or_other_flags_pass_the_check():
    assert checks.command_line_error(["-m", "loss=dpo,ipo,simpo", "lr=1e-3,2e-3"]) is None
    assert checks.command_line_error(["-m", "loss=dpo,ipo", "--cfg", "job"]) is None  # Hydra's own flags: Hydra's business


@pytest.mark.timeout(120)
def test_each_multirun_job_writes_its_own_run_folder_under_output_root(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "train.py"), "-m", "loss=dpo,ipo", *TINY, "n_examples=8", "eval_every=8"]
    cmd += ["sample_during_eval=false", "save_hf_export=false", f"output_root={out}"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-2000:]
    runs = sorted(p.name.split("_run_")[0] for p in out.iterdir() if (p / "config.yaml").exists())
    assert runs == ["dpo", "ipo"]
    sweeps = [p for p in out.iterdir() if p.name.startswith("multirun_")]
    assert len(sweeps) == 1 and (sweeps[0] / "multirun.yaml").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # regression: Hydra's multirun/ folder in the current directory
    rows, _ = co.build_table([str(out)])
    assert [(r["objective"], r["examples"], r["accuracy"] is not None) for r in rows] == [("dpo", 8, True), ("ipo", 8, True)]
