"""Model cards of the hf/ exports (modelcard.py) and hub.push of the final export."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TINY, compose_config, metric_records, needs_shared, run_train
from huggingface_hub import ModelCard
from test_extend import extend

import utils
from export import modelcard
from runs import checkpoints, checks, launch

BATCH = int(next(a for a in TINY if a.startswith("batch_size=")).split("=")[1])
N_EXAMPLES = int(next(a for a in TINY if a.startswith("n_examples=")).split("=")[1])
EVAL_EVERY = int(next(a for a in TINY if a.startswith("eval_every=")).split("=")[1])
PUSH = ["hub.push=true", "hub.model_id=me/tiny-dpo"]


def eval_record(run_dir: Path, step: int) -> dict:
    """The eval record of metrics.jsonl logged after ``step`` examples (the one with loss/eval)."""
    return next(r for r in metric_records(run_dir) if r["step"] == step and "loss/eval" in r)


def results_of(record: dict) -> dict:
    """The results a card's front matter lists for an eval record: its finite metrics but the count answers_eval/n."""
    assert "answers_eval/n" in record  # the prompts answered: in the card's table, not a result
    return {k: v for k, v in record.items() if k not in ("step", "answers_eval/n") and math.isfinite(v)}


def card_values(card) -> dict:
    """{metric key: value} of a card's model-index (front matter)."""
    return {r.metric_type: r.metric_value for r in card.data.eval_results or []}


@pytest.fixture(scope="module")
def pushed_run(tmp_path_factory):
    """One tiny DPO run with hub.push=true, huggingface_hub's HfApi stubbed: (run folder, the calls)."""
    from huggingface_hub import HfApi

    calls = []

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", repo_id, kwargs))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, **kwargs):
        folder = kwargs["folder_path"]
        files = sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)
        calls.append(("upload_folder", kwargs, files))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(HfApi, "create_repo", create_repo)
        mp.setattr(HfApi, "upload_folder", upload_folder)
        # answers_eval/n (a count) and the curves are in the card
        overrides = ["num_threads=1", *PUSH, "eval_reward_functions=auto", "plot_curves=true"]
        run_dir = run_train(overrides, tmp_path_factory.mktemp("pushed"))
    return run_dir, calls


def test_the_final_card_names_the_objective_the_steps_and_the_last_eval(pushed_run):
    run_dir, _ = pushed_run
    final = run_dir / f"step-{N_EXAMPLES}"
    assert (run_dir / "LATEST").resolve() == final.resolve()
    card = ModelCard.load(final / "hf" / "README.md")
    assert card.data.library_name == "transformers"
    assert card.data.tags == ["dpo"]  # [dpo, <objective>] with the objective dpo
    assert card.data.base_model is None  # model=tiny: a random model derives from nothing
    assert "`loss.beta` = `0.1`" in card.text  # config/loss/dpo.yaml's beta
    assert f"- examples trained on: {N_EXAMPLES}" in card.text
    assert f"- optimizer steps: {N_EXAMPLES // BATCH} (batch_size={BATCH} pairs a step)" in card.text
    record = eval_record(run_dir, N_EXAMPLES)
    assert card_values(card) == results_of(record)
    assert f"The eval after {N_EXAMPLES} examples" in card.text
    assert "![loss](curves/loss.png)" in card.text and (final / "hf" / "curves" / "loss.png").stat().st_size > 0
    assert '- `arithmetic`: `data.arithmetic` = `{"n_train": 64, "n_test": 16}`' in card.text


def test_an_earlier_checkpoint_card_states_the_metrics_at_its_own_step(pushed_run):
    run_dir, _ = pushed_run
    card = ModelCard.load(run_dir / f"step-{EVAL_EVERY}" / "hf" / "README.md")
    assert f"- examples trained on: {EVAL_EVERY}" in card.text
    assert f"- optimizer steps: {EVAL_EVERY // BATCH} " in card.text
    record = eval_record(run_dir, EVAL_EVERY)
    assert card_values(card) == results_of(record)
    assert card_values(card)["loss/eval"] != eval_record(run_dir, N_EXAMPLES)["loss/eval"]


def test_the_card_is_inside_the_checkpoint_manifest(pushed_run):
    run_dir, _ = pushed_run
    final = run_dir / f"step-{N_EXAMPLES}"
    manifest = json.loads((final / checkpoints.CHECKPOINT_MANIFEST).read_text())
    for name in ("hf/README.md", "hf/curves/loss.png"):
        data = (final / name).read_bytes()
        assert manifest[name] == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    checkpoints.check_checkpoint(str(final))  # raises if anything listed is missing or cut


def test_push_uploads_the_final_export_once_with_the_repo_id_and_private_flag(pushed_run):
    run_dir, calls = pushed_run
    assert [c[0] for c in calls] == ["create_repo", "upload_folder"]
    assert calls[0][1] == "me/tiny-dpo"
    assert calls[0][2]["private"] is True and calls[0][2]["exist_ok"] is True
    upload, files = calls[1][1], calls[1][2]
    assert upload["repo_id"] == "me/tiny-dpo"
    assert Path(upload["folder_path"]) == (run_dir / f"step-{N_EXAMPLES}" / "hf").resolve()
    assert {"README.md", "config.json", "model.safetensors", "curves/loss.png"} <= set(files)
    assert upload["commit_message"] == f"train.py: {run_dir.name} step-{N_EXAMPLES}"
    assert (run_dir / checkpoints.FINISHED).read_text() == f"{N_EXAMPLES}\n"


def test_lora_cards_say_peft_for_the_adapters_and_transformers_for_the_merged_model(tmp_path):
    stories = needs_shared("models", "stories260K")
    overrides = ["model=blank_model", f"model.name_or_path={stories}", "model.lora.r=8", "model.lora.export_merged=true"]
    run_dir = run_train([*overrides, "num_threads=1", "n_examples=16", "eval_every=16", "plot_curves=true"], tmp_path)
    hf = run_dir / "LATEST" / "hf"
    adapter, merged = ModelCard.load(hf / "README.md"), ModelCard.load(hf / "merged" / "README.md")
    assert adapter.data.library_name == "peft" and merged.data.library_name == "transformers"
    assert adapter.data.base_model is None  # a local folder is no hub id: the Hub refuses it as base_model
    for card in (adapter, merged):
        assert f"`{stories}`" in card.text  # the base, named in the body
        assert "- optimizer steps: 2 " in card.text  # 16 examples / batch_size 8
    assert "LoRA adapters (r=8, alpha=32)" in adapter.text and (hf / "merged" / "curves" / "loss.png").exists()
    assert (hf / "adapter_config.json").exists() and (hf / "merged" / "model.safetensors").exists()
    assert modelcard.export_to_push(str(run_dir / "LATEST"), compose_config(overrides)).rstrip(os.sep) == str(
        hf.resolve() / "merged"
    )


def card_for(overrides: list[str], tmp_path: Path, kind: str = "model"):
    """The card build_card makes for a hand-written run folder (config.yaml and one eval record at step 8)."""
    config = compose_config(overrides)
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.yaml").write_text(checkpoints.RUN_COMMAND_LINE + "python train.py x=1\n")
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 8, "loss/eval": 0.5, "rewards_eval/accuracies": 0.75})
        + "\n"
        + json.dumps({"step": 12, "loss/train": 0.4})
        + "\n"
        + json.dumps({"step": 16, "loss/eval": 0.25})
        + "\n"
    )
    return modelcard.build_card(config, str(tmp_path), 12, 3, kind)


def test_hub_ids_go_into_the_front_matter_and_local_paths_do_not(tmp_path):
    card = card_for(
        ["model=blank_model", "model.name_or_path=org/base", "model.lora.r=8", "datasets=[hh,shp]", "loss=ipo"],
        tmp_path,
        "adapter",
    )
    assert card.data.base_model == "org/base" and card.data.library_name == "peft"
    assert card.data.datasets == ["Anthropic/hh-rlhf", "stanfordnlp/SHP"]
    assert card.data.tags == ["dpo", "ipo"]
    assert card_values(card) == {"loss/eval": 0.5, "rewards_eval/accuracies": 0.75}  # the eval at step 8, not 16
    assert "python train.py x=1" in card.text
    local = card_for(["datasets=[hh,hf]", "data.hh.local_dir=/data/hh", "data.hf.path=org/prefs"], tmp_path / "x")
    assert local.data.datasets == ["org/prefs"] and local.data.base_model is None


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["hub.push=true"], r"hub.push=true needs the repository to push to: add hub.model_id=<org or user>/<name>\."),
        (["hub.push=true", "hub.model_id=a/b/c"], "hub.model_id=a/b/c is not a Hugging Face repository id"),
        ([*PUSH, "save_hf_export=false"], "which save_hf_export=false leaves out; set save_hf_export=true"),
        (["hub.push=yes"], "hub.push must be true or false"),
    ],
)
def test_hub_settings_are_checked_before_training(overrides, message):
    with pytest.raises(utils.ConfigError, match=message):
        checks.validate_config(compose_config(overrides))


def test_the_sft_stage_is_not_pushed():

    sft, dpo = launch.stage_commands(compose_config([]), ["lr=1e-3", *PUSH])
    assert not any(a.startswith("hub.") for a in sft) and all(a in dpo for a in PUSH)


def test_a_failed_push_keeps_the_finished_run_and_says_how_to_push_it_later(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "HF_TOKEN": ""}
    args = [*TINY, "num_threads=1", f"output_root={tmp_path}", *PUSH]
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    (run_dir,) = tmp_path.iterdir()
    hf = (run_dir / f"step-{N_EXAMPLES}" / "hf").resolve()
    line = next(x for x in proc.stderr.splitlines() if "Could not push" in x)
    assert re.fullmatch(
        rf"Error: Could not push {re.escape(str(hf))} to the Hub as me/tiny-dpo \(.+\); the run is finished and kept: "
        rf"push it later with: hf upload me/tiny-dpo {re.escape(str(hf))} \. --private",
        line,
    ), line
    assert (run_dir / checkpoints.FINISHED).exists()
    card = ModelCard.load(hf / "README.md")
    assert f"python train.py {' '.join(args)}" in card.text  # the command that made it


def test_the_card_names_the_checkpoint_a_latest_archive_pointed_to(tmp_path):
    """Found by a new user: model.archive=<sft run>/LATEST/policy.pt was named as the LATEST link, which moves."""
    sft = tmp_path / "sft_run"
    (sft / "step-40").mkdir(parents=True)
    (sft / "step-40" / "policy.pt").write_bytes(b"")
    (sft / "LATEST").symlink_to("step-40")
    card = card_for([f"model.archive={sft / 'LATEST' / 'policy.pt'}"], tmp_path / "run")
    assert f"starting from the policy `{sft / 'step-40' / 'policy.pt'}`" in card.text


EVAL_FAST = ["datasets=[arithmetic]", "data.arithmetic.n_test=16", "n_prompts=6", "temperatures=[0,1.0]", "max_new_tokens=6"]
EVAL_FAST += [
    "generate_batch_size=2",
    "num_threads=1",
    "progress_bar=false",
    "judge=reward_function",
    "reward_functions=[arithmetic]",
]
EVALUATIONS = re.compile(r"\n\n## Evaluations \(evaluate\.py\)\n.*?(?=\n\n## How it was made\n)", re.S)
"""A card's evaluations section, as build_card writes it (blank line, heading, tables; the next section after a blank line)."""


def run_evaluate(overrides: list[str]) -> Path:
    """evaluate.main on EVAL_FAST plus ``overrides``; returns the evaluation folder."""
    from hydra import compose, initialize_config_dir

    from evaluation import evaluate

    with initialize_config_dir(config_dir=str(REPO / "config"), version_base="1.3"):
        return Path(evaluate.main(compose(config_name="evaluate", overrides=[*EVAL_FAST, *overrides])))


def test_an_evaluation_of_a_checkpoint_goes_into_its_card_and_the_checkpoint_stays_whole(tmp_path, capsys):
    run_dir = run_train(["num_threads=1", "plot_curves=true"], tmp_path)
    final = run_dir / f"step-{N_EXAMPLES}"
    card, earlier = final / "hf" / "README.md", run_dir / f"step-{EVAL_EVERY}" / "hf" / "README.md"
    before, earlier_before = card.read_text(), earlier.read_text()
    assert "## Evaluations" not in before
    capsys.readouterr()

    run_evaluate([f"policy={run_dir}/LATEST/hf"])  # an hf folder: its card is left alone
    assert card.read_text() == before and "Model card" not in capsys.readouterr().out

    out = run_evaluate([f"policy={run_dir}"])
    assert f"Model card updated with this evaluation: {final.resolve() / 'hf' / 'README.md'}\n" in capsys.readouterr().out
    after = card.read_text()
    assert EVALUATIONS.sub("", after) == before  # all but the new section as it was
    results = json.loads((out / "results.json").read_text())
    assert results["policy_path"] == str(final.resolve())
    table = [f"`eval/{out.name}`: {run_dir.name} vs chosen, judge reward_function:", ""]
    table += ["| temperature | win rate | 95% interval | n |", "|---|---|---|---|"]
    for t, r in results["temperatures"].items():
        assert r["win_rate"] == r["wins"] / r["n"]
        table.append(f"| {t} | {r['win_rate']:.3f} | [{r['ci_low']:.3f}, {r['ci_high']:.3f}] | {r['n']} |")
    assert "\n".join(table) in EVALUATIONS.search(after).group(0)
    assert earlier.read_text() == earlier_before  # another checkpoint's card: not this evaluation's

    manifest = json.loads((final / checkpoints.CHECKPOINT_MANIFEST).read_text())
    assert manifest["hf/README.md"] == {"bytes": card.stat().st_size, "sha256": hashlib.sha256(card.read_bytes()).hexdigest()}
    assert card.stat().st_size != len(before.encode())
    assert not list(final.rglob("*.tmp-*"))
    checkpoints.check_checkpoint(str(run_dir / "LATEST"))
    _, stop = extend(run_dir, ["num_threads=1", "sample_during_eval=false", f"n_examples={N_EXAMPLES + BATCH}"])
    assert stop is None and (run_dir / "LATEST").resolve().name == f"step-{N_EXAMPLES + BATCH}"  # resumed, not refused


def test_the_evaluations_section_is_spliced_in_as_build_card_writes_it(tmp_path):
    plain = str(card_for([], tmp_path))
    (tmp_path / "eval" / "vs_chosen_1").mkdir(parents=True)
    result = {"policy": "run", "baseline": "chosen", "judge": "reward_function"}
    result["temperatures"] = {"0": {"win_rate": 0.5, "ci_low": 0.25, "ci_high": 0.75, "n": 4}, "1": {"win_rate": None}}
    (tmp_path / "eval" / "vs_chosen_1" / "results.json").write_text(json.dumps(result))
    found = modelcard.evaluations(str(tmp_path))
    full = str(card_for([], tmp_path))
    assert modelcard.with_evaluations(plain, found) == full
    assert modelcard.with_evaluations(full, found) == full  # an earlier section is replaced, not repeated
    assert "| 0 | 0.500 | [0.250, 0.750] | 4 |\n| 1 | - | - | 0 |" in full


def test_a_checkpoint_without_an_export_is_left_alone(tmp_path):
    checkpoint = tmp_path / "run" / "step-8"
    checkpoint.mkdir(parents=True)
    (checkpoint / "policy.pt").write_bytes(b"x")
    checkpoints.write_checkpoint_manifest(str(checkpoint))
    manifest = (checkpoint / checkpoints.CHECKPOINT_MANIFEST).read_text()
    (tmp_path / "run" / "eval" / "e").mkdir(parents=True)
    (tmp_path / "run" / "eval" / "e" / "results.json").write_text(json.dumps({"temperatures": {}}))
    assert modelcard.add_evaluation(str(checkpoint), str(tmp_path / "run"), str(tmp_path / "run" / "eval" / "e")) == []
    assert (checkpoint / checkpoints.CHECKPOINT_MANIFEST).read_text() == manifest
