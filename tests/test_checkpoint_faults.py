"""Faults and bad input at checkpoints and at the end of a run (issue 13): a failed Hugging Face
export never costs the checkpoint, a disk that fills while writing one keeps LATEST, a resumed run
logs every step once (metrics.jsonl and W&B), float16 weights with an optimizer that cannot train
in them are refused, a NaN stop is one sentence, peak memory is printed, curves have units.

Faults in subprocesses are injected with a ``sitecustomize.py`` on PYTHONPATH, which every Python
process of the run (train.py and the ranks it starts) imports at start-up.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY, compose_config, copy_run, metric_records, one_run

import train
import trainers
import utils
from modeling import models
from runs import checkpoints, checks, resume, tracking

QUICK = ["sample_during_eval=false", "save_hf_export=true"]
CLI_TINY = [*TINY, "sample_during_eval=false", "num_threads=1"]
FSDP = [*CLI_TINY, "trainer=FSDPTrainer", "world_size=2", "n_examples=16", "eval_every=8", "data.arithmetic.n_train=16"]
REFUSE_EXPORT = """
import transformers

def _refuse(self, *args, **kwargs):
    raise ValueError("The model's quantization_config (gguf) cannot be saved; dequantize it first")

transformers.PreTrainedModel.save_pretrained = _refuse
"""
DISK_FULL_ON_2ND_FILE_OF_2ND_CHECKPOINT = """
import errno, os
import torch

_real_save, _files = torch.save, {}

def _save(obj, f, *args, **kwargs):
    if isinstance(f, (str, os.PathLike)):
        folder = os.path.dirname(os.fspath(f))
        _files.setdefault(folder, 0)
        _files[folder] += 1
        if len(_files) == 2 and _files[folder] == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(f))
    return _real_save(obj, f, *args, **kwargs)

torch.save = _save
"""


def cli(args: list[str], tmp_path: Path, inject: str | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    """``python train.py args`` in its own process group (killed whole on timeout), with
    ``inject`` run at start-up in every Python process of the run."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    if inject is not None:
        site = tmp_path / "site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(textwrap.dedent(inject))
        env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, "train.py", *one_run(args), f"output_root={tmp_path / 'out'}"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"train.py {' '.join(args)} did not finish in {timeout} s (a rank hung?):\n{out[-2000:]}\n{err[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The run's single ``Error:`` line; fails if there is none, several, or a traceback."""
    text = result.stdout + result.stderr
    assert "Traceback" not in text, text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, text[-3000:]
    return lines[0]


def run_folder(tmp_path: Path) -> Path:
    return next(p for p in (tmp_path / "out").iterdir() if p.is_dir())


def reference_files_complete(checkpoint: Path, sharded: bool = False) -> None:
    """The reference-format checkpoint is whole: every file loads and names its step."""
    step = int(checkpoint.resolve().name.split("-")[1])
    names = ["policy.pt", "scheduler.pt"] + ([] if sharded else ["optimizer.pt"])
    for name in names:
        assert torch.load(checkpoint / name, weights_only=False)["step_idx"] == step, name
    assert torch.load(checkpoint / "trainer_state.pt", weights_only=False)["example_counter"] == step
    if sharded:
        assert len(list((checkpoint / "sharded").glob("*.distcp"))) == 2


# ----------------------------------------------------------------------------- 1. a failed export


def test_a_failed_hf_export_keeps_the_checkpoint_and_the_run_ends_normally(tmp_path, monkeypatch, capsys):
    # Seen: SmolLM2 with a gguf quantization_config; save_pretrained raised in the final save, the
    # run ended with a traceback, a .step-*.tmp-* folder and no LATEST. Smallest input: one step.
    import transformers

    def refuse(self, *args, **kwargs):
        raise ValueError("The model's quantization_config (gguf) cannot be saved")

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", refuse)
    config = compose_config([*TINY, *QUICK, f"output_root={tmp_path}", "n_examples=8", "eval_every=8"])
    run_dir, stop = train.main(config)
    out = capsys.readouterr().out
    run_dir = Path(run_dir)
    assert stop is None
    latest = run_dir / "LATEST"
    assert latest.resolve().name == "step-8"
    reference_files_complete(latest)
    assert not (latest / "hf").exists()
    assert not list(run_dir.glob(".step-*"))
    reason = "ValueError: The model's quantization_config (gguf) cannot be saved"
    warnings = [line for line in out.splitlines() if line.startswith("Warning:")]
    assert len(warnings) == 1 and reason in warnings[0] and "complete" in warnings[0], out[-2000:]
    assert f"Checkpoint: {latest.resolve()} (no Hugging Face export: {reason})." in out
    # the weights saved are the trained ones: they load into the model and differ from its start
    state = torch.load(latest / "policy.pt", weights_only=False)["state"]
    start = models.load_model(config.model, models.load_tokenizer(config.model), torch.float32, config.seed).state_dict()
    assert state.keys() == start.keys()
    assert any(not torch.equal(state[k], start[k]) for k in state)


def test_a_failed_hf_export_under_fsdp_ends_normally_on_both_ranks(tmp_path):
    result = cli(FSDP, tmp_path, inject=REFUSE_EXPORT)
    text = result.stdout + result.stderr
    assert result.returncode == 0, text[-3000:]
    assert "Traceback" not in text
    run_dir = run_folder(tmp_path)
    latest = run_dir / "LATEST"
    assert latest.resolve().name == "step-16"
    reference_files_complete(latest, sharded=True)
    assert not (latest / "hf").exists() and not list(run_dir.glob(".step-*"))
    warnings = [line for line in result.stdout.splitlines() if line.startswith("Warning:")]
    assert len(warnings) == 2, text[-3000:]  # step-8 and step-16, said once each (by rank 0)
    assert all("ValueError: The model's quantization_config (gguf) cannot be saved" in w for w in warnings)
    # 5. peak memory per rank at the end, the figures metrics.jsonl holds
    memory = next(r for r in metric_records(run_dir) if "memory/rank0_peak_rss_mib" in r)
    line = next(line for line in result.stdout.splitlines() if line.startswith("Peak memory:"))
    for rank in (0, 1):
        rss = memory[f"memory/rank{rank}_peak_rss_mib"]
        setup = memory[f"memory/rank{rank}_peak_setup_rss_mib"]
        assert f"rank {rank} {rss:.0f} MiB resident ({setup:.0f} MiB by the end of model loading)" in line


# ----------------------------------------------------------------------------- 3. a disk that fills


def test_disk_full_while_writing_a_checkpoint_keeps_latest_and_is_one_error_line(tmp_path):
    # torch.save fails (ENOSPC) on the 2nd file of the 2nd checkpoint (step-48: optimizer.pt).
    result = cli([*CLI_TINY, "save_hf_export=false"], tmp_path, inject=DISK_FULL_ON_2ND_FILE_OF_2ND_CHECKPOINT)
    assert result.returncode == 1, (result.stdout + result.stderr)[-3000:]
    error = one_error_line(result)
    run_dir = run_folder(tmp_path)
    assert error.startswith(f"Error: Could not write checkpoint step-48 in {run_dir}: no space left on the device (")
    assert "MiB free); the partial folder was removed and LATEST still points at the complete step-24: " in error
    assert "free space on that disk (step-24 takes " in error and f"MiB) and continue with resume={run_dir}." in error
    assert (run_dir / "LATEST").resolve().name == "step-24"
    reference_files_complete(run_dir / "LATEST")
    assert not list(run_dir.glob(".step-*")) and not (run_dir / "step-48").exists()
    # the checkpoint LATEST names loads and resumes to the end
    resumed, stop = train.main(compose_config([f"resume={run_dir}"]))
    assert stop is None and (run_dir / "LATEST").resolve().name == "step-48"
    reference_files_complete(run_dir / "LATEST")


def test_a_checkpoint_that_cannot_be_written_under_fsdp_stops_both_ranks_with_one_error_line(tmp_path):
    # rank 0's 2nd file (scheduler.pt) of the 2nd checkpoint: rank 1 must not wait for it forever.
    result = cli([*FSDP, "save_hf_export=false"], tmp_path, inject=DISK_FULL_ON_2ND_FILE_OF_2ND_CHECKPOINT)
    assert result.returncode == 1, (result.stdout + result.stderr)[-3000:]
    error = one_error_line(result)
    run_dir = run_folder(tmp_path)
    assert "Could not write checkpoint step-16" in error and "no space left on the device (" in error
    assert (run_dir / "LATEST").resolve().name == "step-8"
    reference_files_complete(run_dir / "LATEST", sharded=True)
    assert not list(run_dir.glob(".step-*")) and not (run_dir / "step-16").exists()


def test_an_error_while_saving_removes_the_partial_folder_and_names_latest(tmp_path):
    calls = []

    def write(folder):
        calls.append(folder)
        Path(folder, "policy.pt").write_text("half")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")  # torch.save, disk full

    first = checkpoints.save_checkpoint_dir(str(tmp_path), "step-8", lambda folder: Path(folder, "policy.pt").write_text("ok"))
    with pytest.raises(checkpoints.CheckpointError) as err:
        checkpoints.save_checkpoint_dir(str(tmp_path), "step-16", write)
    assert not os.path.exists(calls[0]) and not (tmp_path / "step-16").exists()
    assert os.path.realpath(tmp_path / "LATEST") == os.path.realpath(first)
    message = str(err.value)
    assert message.startswith(f"Could not write checkpoint step-16 in {tmp_path} (RuntimeError: [enforce fail")
    assert "MiB are free on its disk" in message and "LATEST still points at the complete step-8" in message
    reason = "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"
    assert reason in message and message.replace(reason, "").count(". ") == 0 and message.endswith(".")  # one sentence


# ----------------------------------------------------------------------------- 2. every step once after resume=


class Crash(Exception):
    """The process dying after a checkpoint, before the next one."""


def crash_at_step(monkeypatch, n: int) -> None:
    """Make the n-th optimizer step (1-based) raise Crash, after the steps before it were logged."""
    real = trainers.BasicTrainer.train_step

    def train_step(self, batch):
        if self.batch_counter + 1 == n:
            raise Crash
        return real(self, batch)

    monkeypatch.setattr(trainers.BasicTrainer, "train_step", train_step)


TIMING = ("examples_per_second", "tokens_per_second")


def test_resume_after_a_crash_logs_every_step_once_and_as_an_uninterrupted_run(tmp_path, monkeypatch, capsys):
    # TINY: steps of 8 up to 48, eval and checkpoint at 24; the crash comes at step 6 (40 -> 48),
    # after the train records of 32 and 40 were logged: they were doubled on resume.
    common = [*TINY, "sample_during_eval=false", "save_hf_export=false"]
    full = Path(train.main(compose_config([*common, f"output_root={tmp_path / 'full'}"]))[0])
    with monkeypatch.context() as m:
        crash_at_step(m, 6)
        with pytest.raises(Crash):
            train.main(compose_config([*common, f"output_root={tmp_path / 'cut'}"]))
    cut = next((tmp_path / "cut").iterdir())
    assert (cut / "LATEST").resolve().name == "step-24"
    assert [r["step"] for r in metric_records(cut) if "loss/train" in r] == [8, 16, 24, 32, 40]
    capsys.readouterr()
    train.main(compose_config([f"resume={cut}"]))
    assert "metrics.jsonl: removed 2 records logged after this checkpoint" in capsys.readouterr().out

    train_steps = [r["step"] for r in metric_records(cut) if "loss/train" in r]
    eval_steps = [r["step"] for r in metric_records(cut) if "loss/eval" in r]
    assert train_steps == [8, 16, 24, 32, 40, 48] and eval_steps == [0, 24, 48]
    steps = [r["step"] for r in metric_records(cut)]
    assert steps == sorted(steps)  # nothing logged out of order
    a = [{k: v for k, v in r.items() if k not in TIMING} for r in metric_records(full)]
    b = [{k: v for k, v in r.items() if k not in TIMING} for r in metric_records(cut)]
    a = [r for r in a if not any(k.startswith("memory/") for k in r)]
    b = [r for r in b if not any(k.startswith("memory/") for k in r)]
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for key in ra:
            assert rb[key] == pytest.approx(ra[key], rel=1e-6, abs=1e-7), (ra["step"], key)


def test_resumed_wandb_run_keeps_its_id_and_is_rewound_to_the_checkpoint(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from wandb.sdk.wandb_run import Run

    inits, logged = [], []
    real_init, real_log = wandb.init, Run.log

    def init(**kwargs):
        run = real_init(**kwargs)
        inits.append((kwargs, run.id))
        return run

    def log(self, data, step=None, **kwargs):
        logged.append((len(inits), step, sorted(data)))
        return real_log(self, data, step=step, **kwargs)

    monkeypatch.setattr(wandb, "init", init)
    monkeypatch.setattr(Run, "log", log)
    common = [*TINY, "sample_during_eval=false", "save_hf_export=false", "wandb.enabled=true", "wandb.mode=offline"]
    with monkeypatch.context() as m:
        crash_at_step(m, 6)
        with pytest.raises(Crash):
            train.main(compose_config([*common, f"output_root={tmp_path}"]))
    run_dir = next(p for p in tmp_path.iterdir() if p.is_dir())
    train.main(compose_config([f"resume={run_dir}"]))

    (first, first_id), (second, second_id) = inits
    assert "resume_from" not in first and first.get("id") is None
    assert second["resume_from"] == f"{first_id}?_step=24" and "resume" not in second and "id" not in second
    assert second_id == first_id == torch.load(run_dir / "LATEST" / "trainer_state.pt", weights_only=False)["wandb_id"]
    # offline-run-<time>-<id>, with "-1" added by W&B when the resumed run starts in the same second
    folders = [
        re.fullmatch(r"offline-run-\d{8}_\d{6}-([a-z0-9]+)(-\d+)?", p.name) for p in (run_dir / "wandb").glob("offline-run-*")
    ]
    assert all(folders) and {m.group(1) for m in folders} == {first_id}
    # W&B keeps the first run's history up to step 24 and the resumed run logs after it only
    train_steps = lambda segment: [s for seg, s, keys in logged if seg == segment and "loss/train" in keys]  # noqa: E731
    assert train_steps(1) == [8, 16, 24, 32, 40]
    assert all(s > 24 for seg, s, _ in logged if seg == 2)
    assert [s for s in train_steps(1) if s <= 24] + train_steps(2) == [8, 16, 24, 32, 40, 48]


def test_a_wandb_server_that_refuses_rewind_continues_the_same_run(tmp_path, monkeypatch, capsys):
    import types

    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        if "resume_from" in kwargs:
            raise RuntimeError("rewind is not enabled for this entity")
        return types.SimpleNamespace(id=kwargs["id"], log=lambda *a, **k: None, finish=lambda: None)

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    config = compose_config(["wandb.enabled=true", "wandb.mode=online"])
    logger = tracking.MetricsLogger(str(tmp_path), config, resume_id="abc123")
    assert calls == []  # opened once the checkpoint's step is known
    logger.rewind(24)
    assert [c.get("resume_from") for c in calls] == ["abc123?_step=24", None]
    assert calls[1]["id"] == "abc123" and calls[1]["resume"] == "allow" and logger.run_id == "abc123"
    assert "W&B could not rewind run abc123 to step 24 (RuntimeError: rewind is not enabled" in capsys.readouterr().out


def test_a_resumed_checkpoint_written_after_an_eval_does_not_evaluate_again(tmp_path, capsys):
    # The checkpoint after the eval at 24 held next_eval_at=24, so resume= evaluated (and logged,
    # and sampled) at 24 a second time.
    from conftest import run_train

    run_dir = run_train(["sample_during_eval=false", "save_hf_export=false", "keep_checkpoints=0"], tmp_path)
    assert torch.load(run_dir / "step-24" / "trainer_state.pt", weights_only=False)["next_eval_at"] == 48
    (run_dir / "LATEST").unlink()
    (run_dir / "LATEST").symlink_to("step-24")
    capsys.readouterr()
    train.main(compose_config([f"resume={run_dir}"]))
    out = capsys.readouterr().out
    assert "[eval] after 24 examples" not in out and "[eval] after 48 examples" in out
    assert [r["step"] for r in metric_records(run_dir) if "loss/eval" in r] == [0, 24, 48]


def test_rewind_jsonl_drops_records_after_the_step_and_a_cut_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "a": 1}\n{"step": 8, "a": 2}\n{"step": 16, "a": 3}\n{"step": 24, "a"')
    assert tracking.rewind_jsonl(str(path), 8) == 2
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"step": 0, "a": 1}, {"step": 8, "a": 2}]
    assert tracking.rewind_jsonl(str(path), 8) == 0 and tracking.rewind_jsonl(str(tmp_path / "absent.jsonl"), 8) == 0


# ----------------------------------------------------------------------------- 4. numbers that cannot train


@pytest.mark.parametrize("optimizer", ["RMSprop", "AdamW", "Adam", "SGD"])
def test_float16_weights_break_exactly_the_refused_optimizers(optimizer):
    # One step of the tiny model in float16: Adam, AdamW and RMSprop divide by sqrt(v) + eps with
    # v = g^2 (1e-10 and below) and eps = 1e-8 both 0 in float16, so every weight becomes inf/NaN.
    config = compose_config([])
    tokenizer = models.load_tokenizer(config.model)
    model = models.load_model(config.model, tokenizer, torch.float16, seed=0)
    ids = torch.tensor([tokenizer.encode("Q: 17+25=\nA: 42")])
    opt = getattr(torch.optim, optimizer)(model.parameters(), lr=5e-7)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    broken = not all(torch.isfinite(p).all() for p in model.parameters())
    assert broken == (optimizer in checks.FLOAT16_UNSAFE_OPTIMIZERS)


@pytest.mark.parametrize("optimizer", checks.FLOAT16_UNSAFE_OPTIMIZERS)
def test_float16_weights_with_an_adaptive_optimizer_are_refused_naming_what_works(optimizer):
    with pytest.raises(utils.ConfigError) as err:
        checks.validate_config(compose_config(["model.policy_dtype=float16", f"optimizer={optimizer}"]))
    message = str(err.value)
    assert f"model.policy_dtype=float16 with optimizer={optimizer}" in message
    assert "model.policy_dtype=bfloat16" in message and "model.fsdp_policy_mp=float16" in message
    for fine in (["model.policy_dtype=float16", "optimizer=SGD"], ["model.policy_dtype=bfloat16", f"optimizer={optimizer}"]):
        checks.validate_config(compose_config(fine))


def test_float16_with_adamw_is_one_sentence_before_any_model_loads(tmp_path):
    result = cli(["model.policy_dtype=float16", "optimizer=AdamW"], tmp_path)
    assert result.returncode == 2
    assert "model.policy_dtype=bfloat16" in one_error_line(result)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    assert "Policy:" not in result.stdout  # no model was loaded


NAN = ["lr=1e30", "warmup_steps=0", "n_examples=32"]  # AdamW moves every weight by ~lr: step 2 overflows


def test_a_nan_stop_is_one_error_line_without_traceback(tmp_path):
    result = cli([*CLI_TINY, *NAN], tmp_path)
    assert result.returncode == 1
    error = one_error_line(result)
    assert re.match(r"Error: Training stopped: (loss|gradient norm) is (nan|inf) at step 2 \(after 8 examples\)", error), error
    assert "no checkpoint was written yet" in error and "lower lr" in error


def test_a_nan_stop_under_fsdp_is_one_error_line_without_traceback(tmp_path):
    result = cli([*FSDP, *NAN], tmp_path)
    assert result.returncode == 1, (result.stdout + result.stderr)[-3000:]
    error = one_error_line(result)
    assert re.match(r"Error: Training stopped: (loss|gradient norm) is (nan|inf) at step 2 \(after 8 examples\)", error), error


# ----------------------------------------------------------------------------- 5. peak memory at the end


def test_peak_memory_is_printed_at_the_end_as_logged(tmp_path, capsys):
    from conftest import run_train

    run_dir = run_train(["sample_during_eval=false", "save_hf_export=false", "n_examples=8", "eval_every=8"], tmp_path)
    out = capsys.readouterr().out
    memory = next(r for r in metric_records(run_dir) if "memory/rank0_peak_rss_mib" in r)
    rss, setup = memory["memory/rank0_peak_rss_mib"], memory["memory/rank0_peak_setup_rss_mib"]
    # The job's peak is the kernel's high-water mark since the job began (VmHWM, read in the job), so
    # at most the same mark read now; getrusage's ru_maxrss lags VmHWM by up to a few hundred KiB.
    with open("/proc/self/status") as f:
        now = next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))
    assert 0 < setup <= rss <= now
    assert rss <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 + 4  # the process's peak, to the page-accounting lag
    assert f"Peak memory: {rss:.0f} MiB resident ({setup:.0f} MiB by the end of model loading)." in out.splitlines()


def test_peak_memory_line_names_every_rank_and_cuda():
    line = tracking.format_peak_memory({"rss": [812.4, 640.0], "setup_rss": [600.2, 500.0], "cuda": [1024.0, 900.6]})
    assert line == (
        "Peak memory: rank 0 812 MiB resident (600 MiB by the end of model loading), 1024 MiB CUDA; "
        "rank 1 640 MiB resident (500 MiB by the end of model loading), 901 MiB CUDA."
    )


# ----------------------------------------------------------------------------- 6. curves


def test_curves_have_units_keep_accuracies_apart_and_no_single_point_panels(tmp_path):
    records = [
        {"step": 0, "loss/eval": 0.69, "rewards_eval/accuracies": 0.0, "rewards_eval/margins": 0.0},
        {"step": 8, "loss/train": 0.69, "rewards_train/accuracies": 0.5, "rewards_train/margins": 0.1, "lr": 1e-3},
        {"step": 16, "loss/train": 0.60, "rewards_train/accuracies": 0.6, "rewards_train/margins": 0.3, "lr": 1e-3},
        {"step": 16, "loss/eval": 0.65, "rewards_eval/accuracies": 0.7, "grad_norm": 1.5, "counters/examples": 16},
        {"step": 16, "memory/rank0_peak_rss_mib": 400.0, "memory/rank0_peak_setup_rss_mib": 300.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "config.yaml").write_text("loss: {name: dpo, beta: 0.1, average_log_prob: false}\n")
    (tmp_path / "curves").mkdir()
    (tmp_path / "curves" / "memory.png").write_bytes(b"stale")
    written = tracking.plot_curves(str(tmp_path))
    # by hand: grad_norm (one point), rewards_eval/margins (one point), memory, counters are not drawn
    assert [Path(f).name for f in written] == ["accuracy.png", "loss.png", "rewards_train.png", "lr.png"]
    assert sorted(p.name for p in (tmp_path / "curves").iterdir()) == sorted(Path(f).name for f in written)
    series = {}
    for r in records:
        for k, v in r.items():
            if k != "step":
                series.setdefault(k, []).append((r["step"], v))
    plan = {p["name"]: p for p in tracking.curve_panels(series, "dpo")}
    assert plan["accuracy"]["keys"] == ["rewards_eval/accuracies", "rewards_train/accuracies"]
    assert plan["accuracy"]["ylim"] == (-0.02, 1.02) and "fraction" in plan["accuracy"]["ylabel"]
    assert plan["rewards_train"]["keys"] == ["rewards_train/margins"] and "(nats)" in plan["rewards_train"]["ylabel"]
    assert plan["loss"]["ylabel"].startswith("loss (nats")
    assert plan["lr"]["ylabel"].startswith("learning rate")
    for loss, unit in (("sft", "nats per target token"), ("ipo", "nats²"), ("reward", "nats")):
        assert unit in tracking.curve_panels(series, loss)[1]["ylabel"]
    logps = {"logps_train/chosen": [(8, -20.0), (16, -19.0)]}
    assert "summed over response tokens" in tracking.curve_panels(logps, "dpo")[0]["ylabel"]
    assert "per token" in tracking.curve_panels(logps, "ipo", average_log_prob=True)[0]["ylabel"]


def test_saving_again_at_the_same_step_keeps_latest_on_a_complete_checkpoint_throughout(tmp_path, monkeypatch):
    """Regression: re-publishing step-8 moved the old folder away before the new one was in
    place, so for a moment LATEST named nothing (a crash then left no checkpoint to resume)."""

    def write(marker):
        def fill(folder):
            Path(folder, "policy.pt").write_text(marker)

        return fill

    checkpoints.save_checkpoint_dir(str(tmp_path), "step-8", write("first"))
    seen = []
    real_replace = os.replace

    def watching_replace(src, dst):
        real_replace(src, dst)
        seen.append((tmp_path / "LATEST" / "policy.pt").read_text())  # raises if LATEST dangles

    monkeypatch.setattr(os, "replace", watching_replace)
    checkpoints.save_checkpoint_dir(str(tmp_path), "step-8", write("second"))
    assert seen and set(seen) <= {"first", "second"}
    assert os.readlink(tmp_path / "LATEST") == "step-8" and (tmp_path / "step-8" / "policy.pt").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step-8"]


# ----------------------------------------------------------------------------- 7. damaged checkpoints on resume (issue 24)

DAMAGE_ARGS = [*CLI_TINY, "save_hf_export=false", "keep_checkpoints=0", "plot_curves=true"]


@pytest.fixture(scope="module")
def two_checkpoints(zoo) -> Path:
    """A finished tiny DPO run (the command line ``cli`` with DAMAGE_ARGS gives) with checkpoints at 24 and 48 examples."""
    from conftest import ZOO

    assert compose_config(DAMAGE_ARGS) == compose_config([*TINY, *ZOO["no_export"]])  # the same run
    return zoo("no_export")


def unfinished_copy(run: Path, parent: Path) -> Path:
    """A copy of ``run`` in ``parent`` without FINISHED: what a killed run leaves, to resume."""
    copy = parent / run.name
    shutil.copytree(run, copy, symlinks=True)
    (copy / "FINISHED").unlink()
    return copy


def cut(path: Path, size: int) -> int:
    """Cut ``path`` to ``size`` bytes (an interrupted copy, a full disk); returns its size before."""
    before = path.stat().st_size
    os.truncate(path, size)
    return before


def damaged_sentence(run: Path, what: str) -> str:
    return (
        f"Error: The checkpoint {run}/step-48 is damaged: {what}; resume from step-24, which is intact: "
        f"ln -sfn step-24 {run}/LATEST && python train.py resume={run}."
    )


@pytest.mark.parametrize("damage", ["policy.pt half", "policy.pt empty", "trainer_state.pt cut", "optimizer.pt deleted"])
def test_resume_from_a_damaged_checkpoint_is_one_sentence_naming_the_intact_step_before_loading(
    two_checkpoints, tmp_path, damage
):
    # Seen: a traceback (or a sentence saying to use checkpoints of this train.py) after data and
    # models loaded, and no word of the intact step-24.
    run = unfinished_copy(two_checkpoints, tmp_path)
    name, how = damage.split()
    path = run / "step-48" / name
    if how == "deleted":
        path.unlink()
        what = f"{name} is missing"
    elif how == "empty":
        size = cut(path, 0)
        what = f"{name} is empty (0 bytes of the {size} written)"
    else:
        size = cut(path, path.stat().st_size // 2)
        what = f"{name} is cut short ({size // 2} bytes of the {size} written; its zip directory is gone)"
    result = cli([f"resume={run}"], tmp_path)
    assert result.returncode == 2, (result.stdout + result.stderr)[-3000:]
    assert one_error_line(result) == damaged_sentence(run, what)
    assert "Training length:" not in result.stdout and "Policy:" not in result.stdout  # before data and models


def test_the_damaged_checkpoint_sentences_command_resumes_from_the_intact_step(two_checkpoints, tmp_path):
    run = unfinished_copy(two_checkpoints, tmp_path)
    (run / "step-48" / "optimizer.pt").unlink()
    with pytest.raises(utils.ConfigError) as err:
        train.main(compose_config([f"resume={run}"]))
    command = str(err.value).split("which is intact: ")[1].rstrip(".")
    assert command == f"ln -sfn step-24 {run}/LATEST && python train.py resume={run}"
    subprocess.run(command.split(" && ")[0].split(), check=True)
    run_dir, stop = train.main(compose_config([f"resume={run}"]))
    assert stop is None and (run / "LATEST").resolve().name == "step-48"
    a = torch.load(two_checkpoints / "step-48" / "policy.pt", weights_only=True)["state"]
    b = torch.load(run / "step-48" / "policy.pt", weights_only=True)["state"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # resumed exactly, as an uninterrupted run


def test_resume_auto_of_a_run_whose_latest_is_damaged_is_the_same_sentence(two_checkpoints, tmp_path):
    (tmp_path / "out").mkdir()
    run = unfinished_copy(two_checkpoints, tmp_path / "out")
    size = cut(run / "step-48" / "trainer_state.pt", 1000)
    result = cli([*DAMAGE_ARGS, "resume=auto"], tmp_path)
    assert result.returncode == 2, (result.stdout + result.stderr)[-3000:]
    what = f"trainer_state.pt is cut short (1000 bytes of the {size} written; its zip directory is gone)"
    assert one_error_line(result) == damaged_sentence(run, what)
    assert f"resume=auto: continuing {run}" in result.stdout and "Policy:" not in result.stdout


def test_a_checkpoint_without_a_manifest_is_checked_by_its_files(two_checkpoints, tmp_path):
    # Checkpoints of earlier versions have no manifest.json: the files every resume reads must be
    # there and whole torch.save archives; one that slips through is the same sentence when read.
    run = unfinished_copy(two_checkpoints, tmp_path)
    for step in ("step-24", "step-48"):
        (run / step / checkpoints.CHECKPOINT_MANIFEST).unlink()
    assert checkpoints.checkpoint_damage(str(run / "step-48")) == []
    size = cut(run / "step-48" / "policy.pt", 1000)
    assert checkpoints.checkpoint_damage(str(run / "step-48")) == [
        ("policy.pt", "is cut short (1000 bytes; its zip directory is gone)")
    ]
    with pytest.raises(utils.ConfigError) as err:
        resume.read_checkpoint_file(str(run / "LATEST"), "policy.pt")
    assert "Error: " + str(err.value) == damaged_sentence(run, "policy.pt is cut short (1000 bytes; its zip directory is gone)")
    assert size > 1000
    (run / "step-48" / "scheduler.pt").unlink()
    assert [name for name, _ in checkpoints.checkpoint_damage(str(run / "step-48"))] == ["policy.pt", "scheduler.pt"]
    (run / "step-24" / "optimizer.pt").unlink()  # no intact checkpoint left
    with pytest.raises(utils.ConfigError) as err:
        checkpoints.check_checkpoint(str(run / "LATEST"))
    assert str(err.value) == (
        f"The checkpoint {run}/step-48 is damaged: policy.pt is cut short (1000 bytes; its zip directory is gone) "
        f"(and 1 more file); no other checkpoint of {run} is intact: restore that file, or start the run again with "
        f"its config ({run}/config.yaml)."
    )


def test_each_checkpoint_holds_a_manifest_of_its_files_their_sizes_and_sha256(two_checkpoints):
    folder = two_checkpoints / "step-24"
    manifest = json.loads((folder / checkpoints.CHECKPOINT_MANIFEST).read_text())
    names = sorted(p.name for p in folder.iterdir() if p.name != checkpoints.CHECKPOINT_MANIFEST)
    assert names == ["optimizer.pt", "policy.pt", "scheduler.pt", "trainer_state.pt"]
    assert manifest == {
        name: {"bytes": (folder / name).stat().st_size, "sha256": hashlib.sha256((folder / name).read_bytes()).hexdigest()}
        for name in names
    }


def tensor_checkpoints(run: Path) -> None:
    """``step-1`` and ``step-2`` of run folder ``run`` (LATEST on step-2), each the files every resume reads holding
    a tensor of four ones, written as train.py writes checkpoints (checkpoints.save_checkpoint_dir)."""
    run.mkdir()
    checkpoints.save_run_config(compose_config(TINY), str(run / "config.yaml"))
    for step in (1, 2):

        def write(folder, step=step):
            for name in ("policy.pt", "optimizer.pt", "scheduler.pt", "trainer_state.pt"):
                torch.save({"step_idx": step, "state": {"w": torch.ones(4)}}, Path(folder, name))

        checkpoints.save_checkpoint_dir(str(run), f"step-{step}", write)


def nan_in_place(path: Path) -> int:
    """Turn the first of the four ones in the torch.save file ``path`` into NaN, the file's size unchanged; returns it."""
    data = path.read_bytes()
    ones = struct.pack("<4f", 1, 1, 1, 1)
    assert data.count(ones) == 1
    path.write_bytes(data.replace(ones, struct.pack("<4f", float("nan"), 1, 1, 1)))
    assert path.stat().st_size == len(data)
    return len(data)


def test_bytes_changed_inside_a_checkpoint_file_of_the_same_size_are_one_sentence_naming_the_intact_step(tmp_path):
    # Seen: a file whose bytes changed at the same size loaded as it is (NaN at step 9, blamed on lr or data).
    run = tmp_path / "run"
    tensor_checkpoints(run)
    size = nan_in_place(run / "step-2" / "optimizer.pt")
    assert torch.isnan(torch.load(run / "step-2" / "optimizer.pt", weights_only=True)["state"]["w"][0])  # it loads
    sentence = (
        f"The checkpoint {run}/step-2 is damaged: optimizer.pt holds other bytes than were written (its {size} bytes "
        f"have another sha256 than manifest.json records); resume from step-1, which is intact: ln -sfn step-1 "
        f"{run}/LATEST && python train.py resume={run}."
    )
    with pytest.raises(utils.ConfigError) as err:
        checkpoints.check_checkpoint(str(run / "LATEST"))
    assert str(err.value) == sentence
    with pytest.raises(utils.ConfigError) as err:  # resume=: before data and models load
        train.main(compose_config([f"resume={run}"]))
    assert str(err.value) == sentence
    (run / "LATEST").unlink()  # without LATEST, resume takes the newest intact step
    assert checkpoints.checkpoint_to_resume(str(run)) == (
        str(run / "step-1"),
        "LATEST is missing; continuing from step-1, the newest checkpoint with its files.",
    )


def test_a_manifest_of_an_earlier_version_with_sizes_only_still_loads(tmp_path):
    run = tmp_path / "run"
    tensor_checkpoints(run)
    folder = run / "step-2"
    sizes = {p.name: p.stat().st_size for p in folder.iterdir() if p.name != checkpoints.CHECKPOINT_MANIFEST}
    (folder / checkpoints.CHECKPOINT_MANIFEST).write_text(json.dumps(sizes))
    assert checkpoints.checkpoint_damage(str(folder)) == []
    nan_in_place(folder / "policy.pt")
    assert checkpoints.checkpoint_damage(str(folder)) == []  # sizes only: what it cannot see
    os.truncate(folder / "scheduler.pt", 10)
    assert checkpoints.checkpoint_damage(str(folder)) == [
        ("scheduler.pt", f"is cut short (10 bytes of the {sizes['scheduler.pt']} written; its zip directory is gone)")
    ]


def test_a_cut_sharded_checkpoint_of_an_earlier_version_names_the_cut_shard(tmp_path):
    # Without a manifest, DCP's .metadata says where each shard file's last entry ends.
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "step-16" / "sharded"
    dcp.save({"w": torch.arange(1000.0), "v": torch.ones(10)}, checkpoint_id=str(folder))
    (shard,) = folder.glob("*.distcp")
    size = cut(shard, 100)
    with pytest.raises(utils.ConfigError) as err:
        resume.read_sharded_checkpoint({"w": torch.zeros(1000), "v": torch.zeros(10)}, str(folder))
    assert str(err.value) == (
        f"The checkpoint {tmp_path}/step-16 is damaged: sharded/{shard.name} is cut short (100 of its {size} bytes); "
        "restore that file."
    )
    cut(folder / ".metadata", 50)
    with pytest.raises(utils.ConfigError, match=r"damaged: sharded/\.metadata could not be read \((EOFError|UnpicklingError)"):
        resume.read_sharded_checkpoint({"w": torch.zeros(1000), "v": torch.zeros(10)}, str(folder))


def test_fsdp_resume_from_a_cut_shard_is_one_sentence_naming_the_intact_step(zoo, tmp_path):
    # Seen: six CheckpointException tracebacks (EOFError on each rank) after the models loaded.
    run = copy_run(zoo("fsdp"), tmp_path / "first")  # FSDP, save_hf_export=false: sharded checkpoints at 8 and 16
    (run / "FINISHED").unlink()
    shard = run / "step-16" / "sharded" / "__1_0.distcp"
    size = cut(shard, 1000)
    result = cli([f"resume={run}"], tmp_path)
    assert result.returncode == 2, (result.stdout + result.stderr)[-3000:]
    assert one_error_line(result) == (
        f"Error: The checkpoint {run}/step-16 is damaged: sharded/__1_0.distcp is cut short (1000 of its {size} bytes); "
        f"resume from step-8, which is intact: ln -sfn step-8 {run}/LATEST && python train.py resume={run}."
    )
    assert "Policy:" not in result.stdout


def test_a_cut_reference_cache_is_computed_again_with_a_note(tmp_path, capsys):
    # Seen: a sentence to delete the file by hand, after the models loaded; it is a cache.
    cache_dir = tmp_path / "cache"
    args = [*TINY, *QUICK, "save_hf_export=false", "precompute_ref_log_probs=true", f"cache_dir={cache_dir}", "n_examples=8"]
    train.main(compose_config([*args, f"output_root={tmp_path / 'first'}"]))
    (path,) = cache_dir.glob("reference_logps-*.pt")
    whole = torch.load(path, weights_only=True)
    size = cut(path, path.stat().st_size // 2)
    capsys.readouterr()
    train.main(compose_config([*args, f"output_root={tmp_path / 'second'}"]))
    out = capsys.readouterr().out
    assert f"Note: the reference log-prob cache {path} is cut short ({size // 2} bytes); computing them again." in out
    assert f"Reference log-probs: {len(whole)} pairs cached in {path}" in out
    assert torch.load(path, weights_only=True) == whole  # rewritten whole
