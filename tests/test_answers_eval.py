"""The main job shows a model writing better (issue 23, part 5): each eval scores the policy's
greedy answers with reward functions (``answers_eval/<name>``), and ``sft_first`` runs the
reference repository's two stages (SFT, then DPO from its policy) in one command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY, compose_config, metric_records, run_train
from omegaconf import OmegaConf

import train
import utils
from evaluation import reward_functions
from preference_datasets import declared_reward_functions
from runs import checkpoints, checks, launch
from runs.config_text import shell_line

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
# TINY without its two test settings: the preset's two stages (lr 3e-3 for SFT, 3e-4 after)
STAGED = [o for o in TINY if o not in ("lr=3e-3", "sft_first.n_examples=null")]


def greedy_answers(hf_dir: Path, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation by transformers' own generate, one prompt at a time
    (no padding), up to and including the first EOS: the trainer's batched answers recomputed."""
    from transformers import AutoModelForCausalLM, ByT5Tokenizer

    tokenizer = ByT5Tokenizer()
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    answers = []
    for prompt in prompts:
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        answers.append(out[0, ids.shape[1] :].tolist())
    return answers


def test_answers_eval_is_the_mean_over_an_independent_greedy_decode(tmp_path):
    # length scores the characters of each answer: the logged mean must be the mean over the
    # 16 held-out prompts of transformers' greedy answers from the final checkpoint, EOS dropped,
    # each up to max_length - max_prompt_length = 8 new tokens
    # (SFT for 768 examples: enough to end answers with EOS, so what follows an EOS must be dropped)
    overrides = ["loss=sft", "n_examples=768", "eval_every=768", "max_length=24", "max_prompt_length=16"]
    run_dir = run_train([*overrides, "eval_reward_functions=[length,arithmetic]"], tmp_path)
    last = [r for r in metric_records(run_dir) if "answers_eval/length" in r][-1]
    assert last["step"] == 768
    from transformers import ByT5Tokenizer

    tokenizer = ByT5Tokenizer()
    prompts = [f"Q: {a}+{b}=\nA:" for a, b in questions(16)]
    answers = greedy_answers(run_dir / "LATEST" / "hf", prompts, 24 - 16)  # max_length - max_prompt_length
    eos = tokenizer.eos_token_id
    texts = [tokenizer.decode(a[: a.index(eos)] if eos in a else a, skip_special_tokens=True) for a in answers]
    assert last["answers_eval/length"] == pytest.approx(sum(len(t) for t in texts) / 16)
    assert last["answers_eval/ended"] == pytest.approx(sum(eos in a for a in answers) / 16)
    assert 0 < last["answers_eval/ended"]  # some answers ended: the test sees what follows an EOS dropped
    right = sum(t.strip() == str(a + b) for t, (a, b) in zip(texts, questions(16)))
    assert last["answers_eval/arithmetic"] == pytest.approx(right / 16)
    assert "answers_eval/arithmetic_failed" not in last  # every prompt is an addition question


def questions(n: int) -> list[tuple[int, int]]:
    """The held-out (a, b) of the arithmetic dataset with n_train=64, in its own generator's order."""
    import random

    rng = random.Random(1234)
    problems = [(a, b) for a in range(100) for b in range(100)]
    rng.shuffle(problems)
    return problems[64 : 64 + n]


def test_auto_takes_the_datasets_own_checks_and_bad_values_are_one_sentence():
    assert declared_reward_functions(["arithmetic"]) == ["arithmetic"]
    assert declared_reward_functions(["hh", "json"]) == []
    assert [n for n, _ in reward_functions.eval_functions("auto", ["arithmetic", "arithmetic"])] == ["arithmetic"]
    assert reward_functions.eval_functions("auto", []) == []
    assert reward_functions.eval_functions(None, ["arithmetic"]) == []
    assert [n for n, _ in reward_functions.eval_functions(["length"], ["arithmetic"])] == ["length"]
    with pytest.raises(utils.ConfigError, match="eval_reward_functions='yes': give auto"):
        reward_functions.eval_functions("yes", [])
    with pytest.raises(
        utils.ConfigError, match="^eval_reward_functions: 'lenght' is not a registered reward function; did you mean"
    ):
        reward_functions.eval_functions(["lenght"], [])


def test_a_bad_eval_reward_function_stops_before_any_model_loads(tmp_path):
    config = compose_config([*TINY, f"output_root={tmp_path}", "eval_reward_functions=[no_such_module:f]"])
    with pytest.raises(utils.ConfigError, match="does not import"):
        train.main(config)
    assert not list(tmp_path.iterdir())  # no run folder


def test_no_answers_eval_for_data_without_a_check(tmp_path):
    run_dir = run_train(["eval_reward_functions=null"], tmp_path)
    assert not any(k.startswith("answers_eval/") for r in metric_records(run_dir) for k in r)


# ----------------------------------------------------------------------------- two stages


def test_stage_commands_drop_what_the_sft_stage_sets_itself():
    overrides = ["datasets=[json]", "loss=ipo", "loss.beta=0.5", "n_epochs=2", "exp_name=mine", "lr=1e-4", "seed=3"]
    config = compose_config(overrides)
    sft, second = launch.stage_commands(config, overrides)
    assert sft == [
        "datasets=[json]",
        "seed=3",
        "loss=sft",
        "n_examples=80000",
        "sft_first.n_examples=null",
        "lr=0.003",
        "exp_name=mine_sft",
    ]
    assert second == [*overrides, "sft_first.n_examples=null"]


def test_the_stage_banner_pastes_back_into_a_shell_and_names_sft_first_once():
    """Found by a new user: an unquoted data.hf.columns={...} in the banner was a Hydra parse error when pasted."""
    import shlex

    overrides = ["datasets=[hf]", "data.hf.columns={prompt: instruction, input: input}", "sft_first.n_examples=32"]
    sft, second = launch.stage_commands(compose_config(overrides), overrides)
    assert second == ["datasets=[hf]", "data.hf.columns={prompt: instruction, input: input}", "sft_first.n_examples=null"]
    line = shell_line("train.py", second)
    assert (
        line == "python train.py 'datasets=[hf]' 'data.hf.columns={prompt: instruction, input: input}' sft_first.n_examples=null"
    )
    assert shlex.split(line)[2:] == second


def wanted(overrides: list[str]) -> bool:
    config = compose_config(overrides)
    return launch.sft_stage_wanted(config, checks.given_keys(overrides))


def test_when_the_sft_stage_applies(capsys, tmp_path):
    assert wanted([])  # the main job: model=tiny's preset, DPO from a random model
    assert wanted(["loss=ipo"])
    assert not wanted(["sft_first.n_examples=null"])
    assert not wanted(["model.archive=/x/policy.pt"])  # the preset's stage steps aside, with a note
    assert "Note: no SFT stage (sft_first.n_examples=80000 from the preset): model.archive is given" in capsys.readouterr().out
    assert not wanted(["loss=sft"])
    assert not wanted(["loss=reward"])
    assert not wanted(["online.enabled=true"])
    with pytest.raises(utils.ConfigError, match="sft_first.n_examples=10 cannot apply: model.archive is given"):
        wanted(["sft_first.n_examples=10", "model.archive=/x/policy.pt"])
    with pytest.raises(utils.ConfigError, match=r"=80000 \(set by the model preset\) runs two runs .* resume=auto continues one"):
        wanted(["resume=auto", f"output_root={tmp_path}"])


def stage_args(tmp_path: Path) -> list[str]:
    return [
        *STAGED,
        "eval_reward_functions=auto",
        "sft_first.n_examples=64",
        "n_examples=32",
        "eval_every=32",
        f"output_root={tmp_path}",
    ]


def test_two_stages_in_one_command(tmp_path):
    out = subprocess.run(
        [sys.executable, "train.py", *stage_args(tmp_path)], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "=== Stage 1 of 2: SFT on the chosen responses" in out.stdout
    assert "=== Stage 2 of 2: dpo from the SFT policy" in out.stdout
    sft_dir, dpo_dir = sorted(tmp_path.iterdir(), key=lambda d: OmegaConf.load(d / "config.yaml").loss.name != "sft")
    sft, dpo = OmegaConf.load(sft_dir / "config.yaml"), OmegaConf.load(dpo_dir / "config.yaml")
    assert (sft.loss.name, sft.n_examples, sft.lr, sft.sft_first.n_examples) == ("sft", 64, 3e-3, None)
    assert (dpo.loss.name, dpo.n_examples, dpo.lr, dpo.sft_first.n_examples) == ("dpo", 32, 3e-4, None)
    assert dpo.model.archive == str(tmp_path / sft_dir.name / "LATEST" / "policy.pt")  # the reference repository's shape
    assert (sft_dir / checkpoints.FINISHED).exists() and (dpo_dir / checkpoints.FINISHED).exists()
    # the DPO run starts from the SFT policy: its step-0 eval is the SFT run's last, on the same pairs
    sft_last = [r for r in metric_records(sft_dir) if "logps_eval/chosen" in r][-1]
    dpo_first = [r for r in metric_records(dpo_dir) if "logps_eval/chosen" in r][0]
    assert dpo_first["step"] == 0
    assert dpo_first["logps_eval/chosen"] == pytest.approx(sft_last["logps_eval/chosen"], abs=1e-4)
    assert dpo_first["answers_eval/arithmetic"] == sft_last["answers_eval/arithmetic"]
    assert dpo_first["rewards_eval/accuracies"] == 0.0  # policy = reference
    assert "answers_eval/arithmetic (mean score of the greedy answers to the held-out prompts):" in out.stdout
    assert "answers_eval/n (mean score" not in out.stdout  # a count, not a score (it read 256.00 at each stage)
    assert out.stdout.count("(mean score of the greedy answers") == 1  # the summary of both stages, not stage 2's own too
    dpo_last = [r for r in metric_records(dpo_dir) if "answers_eval/arithmetic" in r][-1]
    assert (
        f"{sft_last['answers_eval/arithmetic']:.2f} after SFT, {dpo_last['answers_eval/arithmetic']:.2f} after dpo (16 prompts)."
        in out.stdout
    )


def test_a_bad_data_file_is_said_before_the_first_stage_starts(tmp_path):
    """Found by a new user: the data was first read inside stage 1, so its error came after the stage's banner."""
    bad = tmp_path / "pairs.jsonl"
    bad.write_text('{"prompt": "Q", "chosen": "A"}\n')
    args = [*stage_args(tmp_path / "out"), "datasets=[json]", f"data.json.path={bad}"]
    out = subprocess.run([sys.executable, "train.py", *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert "Stage 1" not in out.stdout + out.stderr
    assert out.stderr.count("Error: ") == 1 and "'rejected'" in out.stderr and str(bad) in out.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_sigterm_in_the_sft_stage_stops_both_and_keeps_its_checkpoint(tmp_path):
    args = [*stage_args(tmp_path), "sft_first.n_examples=100000", "eval_every=100000", "do_first_eval=false"]
    proc = subprocess.Popen(
        [sys.executable, "train.py", *args], cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 120
    while time.time() < deadline and not any((d / "metrics.jsonl").exists() for d in tmp_path.iterdir()):
        time.sleep(0.5)
    time.sleep(2)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr[-2000:]
    assert "Stage 2 of 2" not in stdout and "Stage 1 of 2 ended with exit code 143" in stderr
    (run_dir,) = tmp_path.iterdir()
    assert (run_dir / "LATEST" / "policy.pt").exists() and not (run_dir / checkpoints.FINISHED).exists()
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"] > 0
