"""Training on something other than what the command asked for (issue 22, "Silently wrong
training"): a model path a preset ignores, n_epochs a preset's n_examples overrides, data changed
under a resumed run, and resume= / resume=auto with another config."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY, compose_config, needs_shared, one_run, run_train
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import train
import trainers
import utils
from runs import checkpoints, checks, reference_cache, setup
from utils import DataError

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def train_py(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """``python train.py args`` from the repository root; a run past ``timeout`` fails the test."""
    try:
        return subprocess.run(
            [sys.executable, "train.py", *one_run(args)], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"train.py {' '.join(args)} ran past {timeout} s")


def settled(overrides: list[str]):
    """The config ``python train.py <overrides>`` runs (before resume=): composed, then the
    command line's keys applied over the preset's as hydra_main applies them."""
    config = compose_config(overrides)
    checks.settle_given(config, checks.given_keys(overrides))
    return config


# ----------------------------------------------------------------------------- model.* contradictions


def test_a_model_path_with_the_default_preset_is_one_sentence_before_anything_loads(tmp_path):
    # Regression: the default model=tiny's random model trained, and config.yaml recorded the path too.
    stories = "../shared/models/stories260K"
    out = train_py([f"model.name_or_path={stories}", f"output_root={tmp_path}"])
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr == (
        f"Error: model.name_or_path={stories} is not loaded when model.config is set (the default model=tiny builds a "
        "random model from it); add model=blank_model to train that model, or drop model.name_or_path.\n"
    )
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_a_model_preset_without_its_path_or_a_path_as_a_preset_is_one_sentence(tmp_path):
    # Regression (a new user's first tries): model=blank_model alone gave OmegaConf's MissingMandatoryValue
    # traceback; model=<a folder> gave Hydra's "Could not find 'model/../shared/models/stories260K'".
    out = train_py(["model=blank_model", f"output_root={tmp_path}"])
    assert (out.returncode, out.stderr) == (
        2,
        "Error: model=blank_model needs the model to load: add model.name_or_path=<a hub id or a local folder>.\n",
    )
    for path in ("../shared/models/stories260K", "EleutherAI/pythia-70m"):
        out = train_py([f"model={path}", f"output_root={tmp_path}"])
        assert (out.returncode, out.stderr) == (
            2,
            f"Error: model={path}: model= takes a preset of config/model/ (e.g. tiny, pythia28); to load a folder or hub "
            f"id, give model=blank_model model.name_or_path={path}.\n",
        )
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_other_model_contradictions_are_one_sentence():
    with pytest.raises(utils.ConfigError, match=r"^model.device_map=auto places loaded weights, but model.config builds"):
        checks.validate_config(compose_config(["model.device_map=auto"]))
    stories = str(needs_shared("models", "stories260K"))
    on_fsdp = compose_config(
        ["model=blank_model", f"model.name_or_path={stories}", "model.device_map=auto", "trainer=FSDPTrainer"]
    )
    with pytest.raises(utils.ConfigError, match=r"^model.device_map=auto is for trainer=BasicTrainer"):
        checks.validate_config(on_fsdp)
    checks.validate_config(compose_config(["model=blank_model", f"model.name_or_path={stories}"]))  # what the README says
    with pytest.raises(utils.ConfigError) as e:  # both given: which tokenizer?
        settled(["model=blank_model", "model.tokenizer_class=ByT5Tokenizer", "model.tokenizer_name_or_path=gpt2"])
    assert str(e.value) == (
        "model.tokenizer_class=ByT5Tokenizer and model.tokenizer_name_or_path=gpt2 both set the tokenizer and contradict; "
        "give only one."
    )
    # the preset's tokenizer_class and the command line's tokenizer_name_or_path: the path wins (README "Chat")
    assert settled(["model.tokenizer_name_or_path=gpt2"]).model.tokenizer_class == "ByT5Tokenizer"


def readme_overrides() -> list[list[str]]:
    """The model.*, trainer, n_epochs and n_examples overrides of every line of README.md and docs/*.md
    (a command, a shell variable or a sentence) that sets model.name_or_path (``$VAR`` words left out)."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    text = "\n".join(page.read_text() for page in pages).replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        if "is not loaded when model.config is set" in line:  # the README quoting the error itself
            continue
        words = re.sub(r"[`\"']", " ", line.split(" #")[0]).split()
        words = [re.sub(r"^[A-Z0-9_]+=", "", w).rstrip(".,;") for w in words]  # S260="model=... -> model=...
        keep = [w for w in words if re.match(r"^(model(\.[\w.]+)?|trainer|n_epochs|n_examples)=", w) and "$" not in w]
        if any(w.startswith("model.name_or_path=") for w in keep):
            found.append([re.sub(r"<[^>]*>?", "X", w) for w in keep])
    return found


def test_the_readme_commands_that_give_a_model_path_have_no_contradiction():
    commands = readme_overrides()
    assert len(commands) >= 5  # S260 (three sections), SMOL (two), the LoRA command, the chat-data example
    for overrides in commands:
        config = settled(overrides)
        assert checks.model_contradiction(config) is None, overrides


# ----------------------------------------------------------------------------- n_epochs and n_examples


def test_n_epochs_on_the_command_line_governs_over_the_presets_n_examples():
    assert compose_config([]).n_examples == 16000  # model=tiny sets it
    assert (settled([]).n_examples, settled([]).n_epochs) == (16000, 1)  # nothing given: the preset's n_examples
    config = settled(["n_epochs=2"])
    assert (config.n_examples, config.n_epochs) == (None, 2)
    config = settled(["n_examples=100"])
    assert (config.n_examples, config.n_epochs) == (100, 1)
    assert settled(["n_epochs=3", "n_examples=null"]).n_examples is None
    with pytest.raises(utils.ConfigError) as e:
        settled(["n_epochs=1", "n_examples=100"])
    assert str(e.value) == "n_epochs=1 and n_examples=100 both set the training length and contradict; give only one."
    assert checks.training_length(settled(["n_epochs=2", "warmup_steps=0"]), 16) == (
        "Training length: n_epochs=2 governs (n_examples=null): 32 examples (16 per epoch)."
    )
    # tiny's batch_size=32: 32 examples are 1 optimizer step, inside tiny's 20 warmup steps, whose
    # multiplier (step + 1) / 21 never reaches 1 (found by a new user: n_epochs=1 of a small file trained at 1/21 of lr)
    assert checks.training_length(settled(["n_epochs=2"]), 16) == (
        "Training length: n_epochs=2 governs (n_examples=null): 32 examples (16 per epoch). Note: warmup_steps=20 is "
        "not shorter than the run's 1 optimizer step, so the learning rate never reaches lr=0.0003; lower warmup_steps."
    )
    # 33 examples are 2 steps (the last one short); warmup_steps=1 reaches lr at the second
    assert "Note" not in checks.training_length(settled(["n_examples=33", "warmup_steps=1"]), 16)
    assert "Note: warmup_steps=2 is not shorter than the run's 2 optimizer steps" in checks.training_length(
        settled(["n_examples=33", "warmup_steps=2"]), 16
    )
    assert checks.training_length(settled([]), 4000) == (
        "Training length: n_examples=16000 governs (n_epochs=1 is not used): 4 epochs of 4000 train examples."
    )
    one = checks.training_length(settled(["n_examples=2000"]), 2000)  # a new user's trial read "1 epochs"
    assert one.startswith("Training length: n_examples=2000 governs (n_epochs=1 is not used): 1 epoch of 2000 train examples.")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def pairs(start: int, stop: int) -> list[dict]:
    return [{"prompt": f"{i}+{i}=", "chosen": f"{2 * i}", "rejected": f"{2 * i + 1}"} for i in range(start, stop)]


SMALL = ["batch_size=8", "eval_batch_size=8", "n_eval_examples=8", "sample_during_eval=false", "save_hf_export=false"]
SMALL += ["progress_bar=false", "warmup_steps=2", "minimum_log_interval_secs=0"]
SMALL += ["sft_first.n_examples=null"]  # one run, not model=tiny's two stages


def json_data(tmp_path: Path) -> list[str]:
    """16 train and 8 eval pairs in two files."""
    train_file, test_file = (
        write_jsonl(tmp_path / "train.jsonl", pairs(0, 16)),
        write_jsonl(tmp_path / "test.jsonl", pairs(16, 24)),
    )
    return ["datasets=[json]", f"data.json.path={{train: {train_file}, test: {test_file}}}"]


def test_n_epochs_1_trains_one_epoch_with_the_default_preset(tmp_path):
    # Regression: model=tiny's n_examples=40000 won, so n_epochs=1 of 16 pairs ran 2,500 epochs.
    out = train_py([*json_data(tmp_path), *SMALL, "n_epochs=1", "eval_every=16", f"output_root={tmp_path / 'out'}"], timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Training length: n_epochs=1 governs (n_examples=null): 16 examples (16 per epoch). Note: warmup_steps=2" in out.stdout
    (run_dir,) = (tmp_path / "out").iterdir()
    assert (run_dir / checkpoints.FINISHED).read_text() == "16\n"
    both = train_py([*json_data(tmp_path), "n_epochs=1", "n_examples=100", f"output_root={tmp_path / 'out2'}"])
    assert both.returncode == 2
    assert both.stderr == "Error: n_epochs=1 and n_examples=100 both set the training length and contradict; give only one.\n"


# ----------------------------------------------------------------------------- resume: the data


def run_to_8_of_16(tmp_path: Path) -> tuple[list[str], Path]:
    """A run of 16 examples on :func:`json_data` whose LATEST is its step-8 checkpoint, unfinished."""
    data = json_data(tmp_path)
    run_dir = run_train([*data, *SMALL, "n_examples=16", "eval_every=8"], tmp_path / "out")
    (run_dir / "LATEST").unlink()
    (run_dir / "LATEST").symlink_to("step-8")
    (run_dir / checkpoints.FINISHED).unlink()
    return data, run_dir


def test_resume_after_the_data_changed_is_one_sentence(tmp_path):
    # Regression: rows added between kill and resume= gave another split and the run went on.
    data, run_dir = run_to_8_of_16(tmp_path)
    state = torch.load(run_dir / "step-8" / "trainer_state.pt", weights_only=False)
    assert {split: fp["n"] for split, fp in state["data"].items()} == {"train": 16, "eval": 8}
    assert all(type(v) in (int, str) for fp in state["data"].values() for v in fp.values())  # plain types only
    with open(tmp_path / "train.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in pairs(100, 104)))
    out = train_py([f"resume={run_dir}"])
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr == (
        "Error: The train split changed since this run's checkpoint: 16 examples then, 20 now; restore that data to "
        "resume, or start a new run from the checkpoint's weights (the optimizer and learning-rate schedule start anew) "
        f"with model.archive={run_dir}/step-8/policy.pt.\n"
    )
    # resume=auto picks the run by its config, then says how to start afresh (found by a new user: a requeued job
    # was only told to restore the data or take the weights)
    auto = train_py([*TINY, *data, *SMALL, "n_examples=16", "eval_every=8", "resume=auto", f"output_root={tmp_path / 'out'}"])
    assert auto.returncode == 2, auto.stderr[-2000:]
    assert "20 now; restore that data to resume, or start a fresh run under another exp_name, or start a new run" in auto.stderr
    write_jsonl(tmp_path / "train.jsonl", pairs(0, 16))  # restored: it resumes
    write_jsonl(tmp_path / "test.jsonl", pairs(17, 25))  # the eval file: as many rows, other contents
    with pytest.raises(
        DataError, match=r"^The eval split changed since this run's checkpoint: 8 examples then, 8 now \(the same"
    ):
        train.main(compose_config([f"resume={run_dir}"]))


def test_resume_with_the_same_data_continues_and_an_old_checkpoint_gets_a_note(tmp_path, capsys):
    _, run_dir = run_to_8_of_16(tmp_path)
    capsys.readouterr()
    _, stop = train.main(compose_config([f"resume={run_dir}"]))
    assert stop is None and (run_dir / checkpoints.FINISHED).read_text() == "16\n"
    out = capsys.readouterr().out
    assert "Resuming after 8 examples." in out and "predates data fingerprints" not in out
    # a checkpoint written before fingerprints were kept: resumed, with a note
    path = run_dir / "step-8" / "trainer_state.pt"
    state = torch.load(path, weights_only=False)
    del state["data"]
    torch.save(state, path)
    checkpoints.record_in_manifest(str(path.parent), [path.name])  # as the earlier version wrote it
    (run_dir / "LATEST").unlink()
    (run_dir / "LATEST").symlink_to("step-8")
    (run_dir / checkpoints.FINISHED).unlink()
    _, stop = train.main(compose_config([f"resume={run_dir}"]))
    out = capsys.readouterr().out
    assert stop is None and "Resuming after 8 examples." in out
    assert f"Note: {run_dir}/LATEST predates data fingerprints, so resume cannot check that the data is unchanged.\n" in out


def test_examples_fingerprint_is_sha256_of_the_examples_in_order():
    import hashlib

    a, b = {"prompt": "p", "chosen": "c", "rejected": "r"}, {"prompt": "q", "chosen": "c", "rejected": "r"}
    expected = hashlib.sha256(
        b'{"chosen": "c", "prompt": "p", "rejected": "r"}\n{"chosen": "c", "prompt": "q", "rejected": "r"}\n'
    ).hexdigest()
    assert checkpoints.examples_fingerprint([a, b]) == {"n": 2, "sha256": expected}
    assert checkpoints.examples_fingerprint([b, a])["sha256"] != expected  # the order is part of the data


# ----------------------------------------------------------------------------- resume: the config


def test_resume_with_a_changed_key_is_one_sentence_and_the_same_value_passes(tmp_path):
    # Regression: "Note: resume= continues with the run's saved config; ignoring ['lr=1.0', 'loss=ipo']".
    run_dir = run_train(["n_examples=8", "eval_every=8", "sample_during_eval=false", "save_hf_export=false"], tmp_path)
    out = train_py([f"resume={run_dir}", "lr=1.0", "loss=ipo"])
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.startswith(
        f"Error: resume={run_dir} continues that run with its saved config, but this command changes lr (saved 0.003, "
        "given 1.0), loss.name (saved dpo, given ipo), "
    )
    assert out.stderr.endswith(
        "; drop those overrides to continue the run, or start a new run from its checkpoint with "
        f"model.archive={run_dir}/LATEST/policy.pt and them.\n"
    )
    same = train_py([f"resume={run_dir}", "lr=3e-3", "loss=dpo", f"output_root={tmp_path / 'elsewhere'}"])
    assert same.returncode == 0, same.stderr[-2000:]
    assert (
        "Nothing to do: this run is complete (8/8 examples)" in same.stdout and "ignoring" not in same.stdout
    )  # no "Note: ... ignoring [...]"


def make_run(root: Path, name: str, overrides: list[str]) -> Path:
    """A run folder ``root/name`` with the config.yaml of ``overrides`` and a LATEST checkpoint link, unfinished."""
    run_dir = root / name
    (run_dir / "step-8").mkdir(parents=True)
    config = compose_config([*TINY, f"output_root={root}", "resume=null", *overrides])
    OmegaConf.resolve(config)
    OmegaConf.save(config, run_dir / "config.yaml")
    (run_dir / "LATEST").symlink_to("step-8")
    return run_dir


def auto(root: Path, *extra: str):
    return setup.effective_config(compose_config([*TINY, f"output_root={root}", "resume=auto", *extra]))


def test_resume_auto_continues_only_a_run_of_the_same_config(tmp_path, capsys):
    # Regression: a new command with the same exp_name silently continued an older unfinished run.
    older = make_run(tmp_path, "dpo_run_2025-01-01_00-00-00_000000", ["lr=0.5"])
    config = auto(tmp_path, "lr=0.5")
    assert config.resume == str(older)
    assert capsys.readouterr().out == f"resume=auto: continuing {older}, the newest unfinished run of exp_name=dpo_run.\n"

    config = auto(tmp_path, "lr=0.6")
    assert config.resume is None and config.lr == 0.6
    assert capsys.readouterr().out == (
        f"resume=auto: the newest unfinished run of exp_name=dpo_run, {older}, was started with another config "
        "(lr (saved 0.5, given 0.6)); starting a fresh run.\n"
    )

    newer = make_run(tmp_path, "dpo_run_2025-01-02_00-00-00_000000", ["lr=0.7", "loss.beta=0.2"])
    config = auto(tmp_path, "lr=0.5")  # the older run has this config: it is continued, past the newer one
    assert config.resume == str(older)
    assert capsys.readouterr().out == (
        f"resume=auto: continuing {older}, the newest unfinished run of exp_name=dpo_run with this config "
        f"(the newer {newer} differs in lr (saved 0.7, given 0.5), loss.beta (saved 0.2, given 0.1)).\n"
    )
    # where the runs are (output_root, resume) is not their config
    assert auto(tmp_path, "lr=0.7", "loss.beta=0.2").resume == str(newer)


def test_the_configuration_reference_gives_the_tiny_presets_values():
    # Regression: the table listed config.yaml's lr 5e-7, batch_size 4, n_examples null... while
    # `python train.py` (model=tiny) ran lr 3e-3, batch_size 32, n_examples 40000.
    import yaml

    def text(value) -> str:
        return (
            {None: "null", True: "true", False: "false"}.get(value, str(value)) if not isinstance(value, float) else f"{value:g}"
        )

    def same(a: str, b) -> bool:
        try:
            return float(a) == float(b)
        except (TypeError, ValueError):
            return a == text(b)

    def flat(node: dict) -> dict:  # sft_first: {n_examples: ...} -> sft_first.n_examples
        return {
            f"{k}.{j}" if isinstance(v, dict) else k: w
            for k, v in node.items()
            for j, w in (v.items() if isinstance(v, dict) else [(None, v)])
        }

    base = flat(yaml.safe_load((REPO / "config" / "config.yaml").read_text()))
    tiny = flat({k: v for k, v in yaml.safe_load((REPO / "config" / "model" / "tiny.yaml").read_text()).items() if k != "model"})
    tiny_keys = {k for k in tiny if k != "defaults"}
    rows = {}
    table = (REPO / "docs" / "configuration.md").read_text().split("<!-- configuration reference", 1)[1]
    for line in table.split("<!-- end of the configuration reference -->", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            for i, key in enumerate(re.findall(r"`([\w.]+)`", cells[0])):
                rows[key] = (i, cells[1])
    for key in tiny_keys:
        i, cell = rows[key]  # every key tiny sets has a row
        assert "; tiny: " in cell, (key, cell)
        ours, theirs = (part.split(", ") for part in cell.split("; tiny: "))
        assert same(ours[i], base[key]), (key, cell)
        assert same(theirs[i], tiny[key]), (key, cell)
    for key, (i, cell) in rows.items():
        if "; tiny: " in cell and key in base and key not in tiny_keys:  # a key tiny leaves: the same on both sides
            ours, theirs = (part.split(", ") for part in cell.split("; tiny: "))
            assert ours[i] == theirs[i], (key, cell)


@pytest.mark.parametrize("given", ["run", "LATEST", "step", "empty"])
def test_model_archive_given_a_folder_names_the_policy_file_that_is_there(tmp_path, given):
    # Regression (issue 24): <run>/LATEST and <run>/step-512 suggested .../LATEST/LATEST/policy.pt
    # and .../step-512/LATEST/policy.pt, neither of which exists.
    run = tmp_path / "run"
    (run / "step-512").mkdir(parents=True)
    (run / "step-512" / "policy.pt").write_bytes(b"")
    (run / "LATEST").symlink_to("step-512")
    (tmp_path / "empty").mkdir()
    folder = {"run": run, "LATEST": run / "LATEST", "step": run / "step-512", "empty": tmp_path / "empty"}[given]
    expected = {
        "run": run / "LATEST" / "policy.pt",
        "LATEST": run / "LATEST" / "policy.pt",
        "step": run / "step-512" / "policy.pt",
    }.get(given)
    with pytest.raises(utils.ConfigError) as error:
        checks.validate_config(compose_config([f"model.archive={folder}"]))
    message = str(error.value)
    assert message.startswith(f"model.archive={folder} is a folder; give a checkpoint's policy.pt: ")
    if expected is None:
        assert "this folder holds none" in message
    else:
        assert message.endswith(f"model.archive={expected}.")


def test_resume_of_a_run_stopped_before_its_first_checkpoint_says_there_is_nothing_to_resume(tmp_path):
    # Regression (issue 24): it said "is not a run folder" of a folder train.py had made.
    run = tmp_path / "dpo_run_2026-12-02_10-00-00_000000"
    run.mkdir()
    OmegaConf.save(compose_config(TINY), run / "config.yaml")
    with pytest.raises(
        utils.ConfigError, match=r"has no checkpoint yet .*nothing to resume; start it again with the same command"
    ):
        setup.effective_config(compose_config([*TINY, f"resume={run}"]))


def test_latest_pointing_at_a_missing_folder_resumes_from_the_newest_intact_step(tmp_path, capsys):
    # Regression (issue 24): LATEST -> a deleted step-48 made resume= say "is not a run folder"
    # and resume=auto start fresh, although step-16 and step-32 were intact.
    import shutil

    run = run_train(["n_examples=48", "eval_every=16", "keep_checkpoints=0", "save_hf_export=false"], tmp_path)
    assert os.readlink(run / "LATEST") == "step-48"
    shutil.rmtree(run / "step-48")
    (run / checkpoints.FINISHED).unlink()
    assert checkpoints.checkpoint_to_resume(str(run)) == (
        str(run / "step-32"),
        "LATEST points at step-48, which is missing; continuing from step-32, the newest checkpoint with its files.",
    )
    assert checkpoints.resumable_runs(str(tmp_path), "dpo_run") == [str(run)]  # resume=auto finds it
    capsys.readouterr()
    run_dir, stop = train.main(compose_config([*TINY, f"output_root={tmp_path}", f"resume={run}"]))
    assert stop is None and Path(run_dir) == run
    assert "Note: LATEST points at step-48, which is missing; continuing from step-32" in capsys.readouterr().out
    assert (run / checkpoints.FINISHED).read_text() == "48\n" and os.readlink(run / "LATEST") == "step-48"
    evals = [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss/eval" in r]
    assert evals == [0, 16, 32, 48]  # the rewound metrics: step 48 once


@pytest.mark.parametrize(
    "override, message",
    [
        ("lr_scheduler=cosin", "lr_scheduler must be constant, linear or cosine, got cosin."),
        ("wandb.mode=on", "wandb.mode must be online, offline or disabled, got on."),
        ("trainer=FSDP", "trainer=FSDP is unknown; choose one of BasicTrainer, FSDPTrainer, TensorParallelTrainer."),
        ("launcher=slurm", "launcher=slurm is unknown; choose launcher=local or launcher=ray."),
    ],
)
def test_a_value_outside_its_choices_is_one_sentence(override, message):
    with pytest.raises(utils.ConfigError) as e:
        checks.validate_config(compose_config([override]))
    assert str(e.value) == message


@pytest.mark.parametrize(
    "override", ["lr_scheduler=constant", "lr_scheduler=cosine", "wandb.mode=disabled", "wandb.mode=offline"]
)
def test_each_allowed_choice_passes(override):
    checks.validate_config(compose_config([override]))


def test_a_config_saved_before_newer_keys_existed_loads_with_todays_defaults_its_values_winning(tmp_path):
    old = tmp_path / "config.yaml"
    old.write_text(
        checkpoints.RUN_COMMAND_LINE + "python train.py loss=ipo loss.beta=0.5\n"
        "seed: 7\nlr: 1.0e-4\nloss: {name: ipo, beta: 0.5}\nmodel: {name_or_path: gpt2, policy_dtype: bfloat16}\n"
        "datasets: [hh]\na_key_since_removed: 1\n"
    )
    checkpoints._defaults.cache_clear()
    with initialize_config_dir(config_dir=str(REPO / "config"), version_base="1.3"):  # as inside hydra.main
        config = checkpoints.load_run_config(str(old))
        assert compose(config_name="config").loss.name == "dpo"  # the caller's Hydra is left as it was
    # saved values win
    assert (config.seed, config.lr, config.loss.beta, config.datasets) == (7, 1e-4, 0.5, ["hh"])
    assert (config.model.name_or_path, config.model.policy_dtype, config.a_key_since_removed) == ("gpt2", "bfloat16", 1)
    # by hand from config/config.yaml (not model=tiny's warmup_steps 20 or optimizer AdamW), loss/ipo.yaml, model/blank_model.yaml
    assert (config.warmup_steps, config.optimizer, config.reference_update.every, config.model.lora.alpha) == (
        150,
        "RMSprop",
        512,
        32,
    )
    assert (config.loss.average_log_prob, config.loss.nll_weight, config.model.reference_dtype) == (True, 0.0, None)
    assert config.exp_name == "ipo_run" and config.data.hh.holdout_fraction == 0.0 and "policy" not in config


def test_resume_of_a_run_killed_in_its_first_save_removes_the_save_then_says_there_is_nothing_to_resume(tmp_path):
    # Regression (issue 34): a kill -9 during the first save left .step-N.tmp-* for ever, refused before cleaning.
    run = tmp_path / "dpo_run_2026-12-02_10-00-00_000000"
    (run / ".step-24.tmp-9f3c2a1b").mkdir(parents=True)
    (run / ".step-24.tmp-9f3c2a1b" / "policy.pt").write_bytes(b"\0" * 64)
    OmegaConf.save(compose_config(TINY), run / "config.yaml")
    with pytest.raises(utils.ConfigError, match=r"has no checkpoint yet"):
        setup.effective_config(compose_config([*TINY, f"resume={run}"]))
    assert sorted(p.name for p in run.iterdir()) == [".lock", "config.yaml"]


def test_a_fault_after_the_run_folder_is_made_leaves_no_folder_holding_only_its_config(tmp_path, monkeypatch):
    # Regression (issue 34): a refused reference cache (or lr=inf before the first log) left config.yaml and .lock.
    def refuse(*args, **kwargs):
        raise utils.ConfigError("The reference cache is refused.")

    monkeypatch.setattr(reference_cache, "reference_inputs", refuse)
    with pytest.raises(utils.ConfigError, match="refused"):
        train.main(compose_config([*TINY, f"output_root={tmp_path / 'a'}"]))
    assert list((tmp_path / "a").iterdir()) == []
    monkeypatch.undo()
    with pytest.raises(trainers.NonFiniteLossError) as e:  # AdamW moves every weight by ~lr: the first step overflows
        train.main(compose_config([*TINY, f"output_root={tmp_path / 'b'}", "lr=1e30", "warmup_steps=0", "n_examples=16"]))
    (folder,) = (tmp_path / "b").iterdir()  # its step-0 eval was logged: the folder stays, named
    assert f"no checkpoint was written yet (its run folder {folder} holds only logs: delete it once read)" in str(e.value)
    assert (folder / "metrics.jsonl").exists()
