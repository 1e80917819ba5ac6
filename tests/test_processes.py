"""Processes and run folders (issue 13): ranks die with their launcher, one run at a time per run
folder, and a mistyped key is one sentence with the key it was probably meant to be.

Every subprocess has a timeout and runs in its own session; on the way out what is left of it is
killed, so no test can hang or leave processes behind.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY, compose_config, run_train
from omegaconf import OmegaConf

import train
import utils
from modeling import loading
from runs import checkpoints, ending, processes, setup
from runs.overrides import override_error

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def is_dead(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie nobody has reaped yet counts as exited)."""
    try:
        import psutil

        return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except ImportError:
        pass
    except Exception:  # psutil.NoSuchProcess between the two calls
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def children(pid: int) -> list[int]:
    """The pids whose parent is ``pid``."""
    try:
        import psutil

        return [p.pid for p in psutil.Process(pid).children()]
    except ImportError:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]


def wait_until(condition, seconds: float, what: str) -> None:
    """Poll ``condition()`` every 0.1 s; fail the test naming ``what`` after ``seconds``."""
    deadline = time.time() + seconds
    while not condition():
        if time.time() > deadline:
            pytest.fail(f"timed out after {seconds} s waiting for {what}")
        time.sleep(0.1)


def kill_all(procs: list[subprocess.Popen], pids: list[int] = ()) -> None:
    """SIGKILL whatever is left of these processes (their sessions) and pids, the pids first (one
    may hold a process's output pipe open)."""
    for pid in pids:
        if not is_dead(pid):
            os.kill(pid, signal.SIGKILL)
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)


def holder(folder: Path) -> subprocess.Popen:
    """A process holding ``folder``'s lock (``checkpoints.lock_run_dir``) until it is killed; returns
    once it holds it."""
    code = f"import sys, time; from runs import checkpoints; lock = checkpoints.lock_run_dir({str(folder)!r}); print('held', flush=True); time.sleep(300)"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, env=ENV, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


# ----------------------------------------------------------------------------- ranks die with their launcher


@pytest.mark.timeout(300)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="kill -9 and /proc: Linux")
def test_kill_9_of_the_fsdp_launcher_kills_both_ranks_and_a_resume_meanwhile_is_refused(tmp_path):
    # The issue: `kill -9` of `python train.py trainer=FSDPTrainer world_size=2` left both ranks
    # training under PID 1, moving LATEST, and a resume= started then wrote into the same folder.
    args = ["trainer=FSDPTrainer", "world_size=2", "n_examples=100000", "data.arithmetic.n_train=400", "eval_every=32"]
    args += ["batch_size=8", "eval_batch_size=8", "n_eval_examples=16", "data.arithmetic.n_test=16", "progress_bar=false"]
    args += ["sample_during_eval=false", "save_hf_export=false", "warmup_steps=2", f"output_root={tmp_path}"]
    args += ["sft_first.n_examples=null"]  # one run, not model=tiny's two stages
    launcher = subprocess.Popen(
        [sys.executable, "train.py", *args],
        cwd=REPO,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    ranks: list[int] = []
    resume = None
    try:
        wait_until(lambda: list(tmp_path.glob("*/LATEST")), 180, "the first checkpoint")
        run_dir = next(tmp_path.glob("*/LATEST")).parent
        ranks = children(launcher.pid)
        assert len(ranks) == 2
        with pytest.raises(utils.ConfigError, match="is in use by a live run"):
            checkpoints.lock_run_dir(str(run_dir))  # rank 0 holds it while training

        # resume= of the folder while it trains: refused before any process starts
        resume = subprocess.run(
            [sys.executable, "train.py", f"resume={run_dir}"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120
        )
        assert resume.returncode == 2, resume.stderr[-2000:]
        errors = [line for line in resume.stderr.splitlines() if line.strip()]
        holders = [f"Error: The run folder {run_dir} is in use by a live run (pid {pid} on {os.uname()[1]}); " for pid in ranks]
        assert len(errors) == 1 and errors[0].startswith(tuple(holders)), resume.stderr  # rank 0 made it and holds it
        assert "Starting" not in resume.stdout and "Policy:" not in resume.stdout

        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=10)
        wait_until(lambda: all(is_dead(pid) for pid in ranks), 5, "both ranks to die with their launcher")
        latest, size = os.readlink(run_dir / "LATEST"), (run_dir / "metrics.jsonl").stat().st_size
        time.sleep(2)
        assert os.readlink(run_dir / "LATEST") == latest  # LATEST stopped moving
        assert (run_dir / "metrics.jsonl").stat().st_size == size
        checkpoints.lock_run_dir(str(run_dir)).release()  # and the folder is free for resume=
    finally:
        kill_all([launcher], ranks)


def lock_is_free(folder: Path) -> bool:
    """Whether ``folder``'s lock can be taken (it is released again at once)."""
    try:
        checkpoints.lock_run_dir(str(folder)).release()
    except utils.ConfigError:
        return False
    return True


def long_fsdp_args(out: Path) -> list[str]:
    """A 2-rank FSDP run of the tiny model that trains for minutes (killed by the test), a checkpoint every 32 examples."""
    args = ["trainer=FSDPTrainer", "n_examples=100000", "data.arithmetic.n_train=400", "eval_every=32", "batch_size=8"]
    args += ["eval_batch_size=8", "n_eval_examples=16", "data.arithmetic.n_test=16", "progress_bar=false", "warmup_steps=2"]
    return [*args, "sample_during_eval=false", "save_hf_export=false", "sft_first.n_examples=null", f"output_root={out}"]


def torchrun(args: list[str], log: Path) -> subprocess.Popen:
    """``torchrun --nproc_per_node 2 train.py <args>`` in its own session, its output into ``log``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "train.py", *args]
    return subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def after_first_checkpoint(out: Path, launcher: subprocess.Popen) -> tuple[Path, list[int]]:
    """Wait for the first checkpoint of the run torchrun ``launcher`` writes into ``out``; its run
    folder and the pids of its ranks."""
    wait_until(lambda: list(out.glob("*/LATEST")), 240, "the first checkpoint")
    return next(out.glob("*/LATEST")).parent, children(launcher.pid)


@pytest.mark.timeout(300)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="kill -9 and /proc: Linux")
def test_kill_9_of_torchrun_kills_both_ranks_and_frees_the_run_folder(tmp_path):
    # The issue: `kill -9` of torchrun left both ranks training with parent 1; they kept the run
    # folder's lock and finished the run. Now each rank dies with torchrun (die_with_launcher).
    launcher = torchrun(long_fsdp_args(tmp_path / "out"), tmp_path / "log")
    ranks: list[int] = []
    try:
        run_dir, ranks = after_first_checkpoint(tmp_path / "out", launcher)
        assert len(ranks) == 2
        with pytest.raises(utils.ConfigError, match="is in use by a live run"):
            checkpoints.lock_run_dir(str(run_dir))
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=10)
        wait_until(lambda: all(is_dead(pid) for pid in ranks), 5, "both ranks to die with torchrun")
        # resume= is not refused as "in use" (a process shows as a zombie before its last thread has
        # exited and closed its files, so the lock may stay a moment longer)
        wait_until(lambda: lock_is_free(run_dir), 5, "the run folder's lock to be free")
    finally:
        kill_all([launcher], ranks)


def test_a_torchrun_rank_arms_its_death_signal_and_says_so():
    # die_with_launcher under torchrun (TORCHELASTIC_RUN_ID, no launcher pid) reports torchrun; in a
    # process no launcher started it does nothing.
    code = "from runs import processes; print(processes.die_with_launcher(), flush=True)"
    env = {k: v for k, v in ENV.items() if k not in (processes.LAUNCHER_PID_ENV, "TORCHELASTIC_RUN_ID")}
    for extra, said in (({"TORCHELASTIC_RUN_ID": "none"}, "torchrun"), ({}, "None")):
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env={**env, **extra}, capture_output=True, text=True, timeout=120
        )
        assert (done.returncode, done.stdout.strip()) == (0, said), done.stderr


@pytest.mark.timeout(420)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="kill -9 and /proc: Linux")
def test_a_killed_fsdp_rank_is_named_with_its_signal_and_the_resume_command_which_continues(tmp_path):
    # The issue: rank 1 killed printed rank 0's gloo traceback ("Connection reset by peer ... GLHF",
    # exit 1); rank 0 killed printed Hydra's "Error executing job" (exit 247). Now the launcher names
    # the rank and its signal and gives the resume command (rank 0's: the folder came from it).
    out = tmp_path / "out"
    args = [*long_fsdp_args(out), "n_examples=320", "world_size=2"]  # 36 steps left after the first checkpoint: seconds
    log = tmp_path / "log"
    launcher = subprocess.Popen(
        [sys.executable, "train.py", *args],
        cwd=REPO,
        env=ENV,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    ranks: list[int] = []
    try:
        wait_until(lambda: list(out.glob("*/LATEST")), 240, "the first checkpoint")
        run_dir = next(out.glob("*/LATEST")).parent
        ranks = children(launcher.pid)
        assert len(ranks) == 2
        os.kill(ranks[0], signal.SIGKILL)  # rank 0: the launcher starts the ranks in order
        assert launcher.wait(timeout=60) == 128 + signal.SIGKILL
    finally:
        kill_all([launcher], ranks)
    text = log.read_text()
    errors = [line for line in text.splitlines() if line.startswith("Error:")]
    assert errors == [
        f"Error: rank 0 was killed by SIGKILL, so the run stopped; continue the run with python train.py resume={run_dir}."
    ]
    for gone in ("Traceback", "GLHF", "Error executing job"):
        assert gone not in text, text[-3000:]
    assert "rank 1: another rank stopped answering (" in text  # the survivor's one line instead of its traceback
    assert not (run_dir / "FINISHED").exists()

    done = subprocess.run(
        [sys.executable, "train.py", f"resume={run_dir}"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Resuming after " in done.stdout and (run_dir / "FINISHED").exists()


@pytest.mark.timeout(300)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="kill -9 and /proc: Linux")
def test_under_torchrun_the_rank_left_when_another_is_killed_says_one_line_with_the_resume_command(tmp_path):
    launcher = torchrun(long_fsdp_args(tmp_path / "out"), tmp_path / "log")
    ranks: list[int] = []
    try:
        run_dir, ranks = after_first_checkpoint(tmp_path / "out", launcher)
        os.kill(ranks[1], signal.SIGKILL)
        assert launcher.wait(timeout=120) != 0
    finally:
        kill_all([launcher], ranks)
    text = (tmp_path / "log").read_text()
    said = [line for line in text.splitlines() if line.startswith("rank 0: ")]
    assert len(said) == 1 and said[0].startswith("rank 0: another rank stopped answering ("), text[-3000:]
    assert said[0].endswith(f"; stopping; continue the run with torchrun <the same options> train.py resume={run_dir}.")
    assert "GLHF" not in text and "Connection reset by peer. " not in text  # gloo's message, not its traceback
    assert f'File "{REPO}' not in text, text[-3000:]  # no traceback through our code (torchrun prints its own)
    # torchrun's summary names rank 1 (SIGKILL: -9) and rank 0 only if it left before torchrun stopped it:
    # then with PEER_LOST_EXIT (3), never a traceback's 1; a rank torchrun stops itself is not listed.
    codes = {int(code) for code in re.findall(r"exitcode\s+: (-?\d+)", text)}
    assert -signal.SIGKILL in codes and codes <= {3, -signal.SIGKILL}, text[-3000:]


def test_a_lost_peer_is_recognised_through_the_exceptions_it_caused():
    import torch.distributed as dist

    gloo = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:35518: "
        "Connection reset by peer. This is typically caused by a remote worker hanging. GLHF!"
    )
    assert processes.lost_peer(gloo) == "Connection reset by peer"
    try:
        try:
            raise gloo
        except RuntimeError as e:
            raise ValueError("while saving") from e
    except ValueError as wrapped:
        assert processes.lost_peer(wrapped) == "Connection reset by peer"
    assert processes.lost_peer(dist.DistNetworkError("connect() timed out.\nmore")) == "DistNetworkError: connect() timed out"
    assert processes.lost_peer(RuntimeError("CUDA out of memory")) is None
    assert processes.lost_peer(OSError("Connection reset by peer")) is None  # not a collective's error


@pytest.mark.parametrize(
    "codes, killed, code, said",
    [
        ({0: 0, 1: 0}, set(), 0, None),
        ({0: processes.PEER_LOST_EXIT, 1: -9}, set(), 137, "rank 1 was killed by SIGKILL"),  # the survivor ended first
        ({1: -11, 0: -9}, {0}, 139, "rank 1 was killed by SIGSEGV"),  # rank 0 killed by the launcher afterwards
        ({1: 7, 0: -9}, {0}, 7, "rank 1 exited with code 7"),
        ({0: 1, 1: -9}, {1}, 1, None),  # a traceback or an error sentence of its own: nothing to add
        ({0: 2, 1: 2}, set(), 2, None),  # a config mistake, said once
        ({0: 143, 1: 143}, set(), 143, None),  # SIGTERM: saved and stopped
        ({0: processes.PEER_LOST_EXIT, 1: -9}, {1}, processes.PEER_LOST_EXIT, None),  # nobody seen to die by itself
    ],
)
def test_the_launcher_names_the_rank_that_failed_first_and_exits_with_its_code(tmp_path, capsys, codes, killed, code, said):
    (tmp_path / "LATEST").symlink_to("step-8")
    stopped = {128 + s for s in ending.STOP_SIGNALS}
    assert processes.rank_failure(codes, killed, stopped, str(tmp_path)) == code
    err = capsys.readouterr().err
    expected = f"Error: {said}, so the run stopped; continue the run with python train.py resume={tmp_path}.\n"
    assert err == (expected if said else "")


def test_how_to_continue_names_the_resume_command_only_when_there_is_a_checkpoint(tmp_path):
    assert processes.how_to_continue(None, "python train.py") == "the run had made no run folder yet, so start it again"
    assert processes.how_to_continue(str(tmp_path), "x") == f"the run saved no checkpoint in {tmp_path} yet, so start it again"
    (tmp_path / "LATEST").symlink_to("step-8")
    assert (
        processes.how_to_continue(str(tmp_path), "python train.py") == f"continue the run with python train.py resume={tmp_path}"
    )


def test_a_rank_whose_launcher_is_already_gone_exits_at_once():
    # The race: the launcher dies between starting the rank and the rank arming its death signal.
    # Here the "launcher" pid is not this process's parent at all.
    code = "from runs import processes; processes.die_with_launcher(); print('still alive', flush=True)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**ENV, processes.LAUNCHER_PID_ENV: "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == -signal.SIGKILL and "still alive" not in done.stdout, done.stdout + done.stderr


def test_an_evaluate_py_rank_dies_with_its_launcher_too():
    # evaluate.py's ranks under torchrun outlived a killed torchrun: its entry arms the same death
    # signal. A "launcher" that is not its parent is already gone: killed before anything runs.
    done = subprocess.run(
        [sys.executable, "evaluate.py", "policy=/no/such/run"],
        cwd=REPO,
        env={**ENV, processes.LAUNCHER_PID_ENV: "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr


@pytest.mark.timeout(180)
def test_without_prctl_a_watch_thread_kills_the_rank_when_its_launcher_dies():
    # What other OSes get (no PR_SET_DEATHSIG): a thread that notices the parent is gone.
    rank = "import sys, time; from runs import processes; sys.platform = 'darwin'; processes.die_with_launcher(poll_s=0.1); print('armed', flush=True); time.sleep(300)"
    parent = (
        "import os, subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', {rank!r}], env={{**os.environ, {processes.LAUNCHER_PID_ENV!r}: str(os.getpid())}})\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", parent], cwd=REPO, env=ENV, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    child = None
    try:
        child = int(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "armed"
        assert not is_dead(child)
        os.kill(proc.pid, signal.SIGKILL)
        wait_until(lambda: is_dead(child), 5, "the rank to notice its launcher died")
    finally:
        kill_all([proc], [child] if child else [])


# ----------------------------------------------------------------------------- one run per run folder


def fake_run_folder(tmp_path: Path, overrides: list[str] = ()) -> Path:
    """A folder resume= accepts (config.yaml and a LATEST link) without any checkpoint in it: a
    refusal must come before anything is read from it."""
    folder = tmp_path / "run"
    (folder / "step-8").mkdir(parents=True)
    (folder / "LATEST").symlink_to("step-8")
    OmegaConf.save(compose_config([*TINY, f"output_root={tmp_path}", *overrides]), folder / "config.yaml")
    return folder


@pytest.mark.timeout(180)
def test_resume_of_a_folder_a_live_run_holds_is_refused_and_a_killed_holders_lock_does_not_block(tmp_path, monkeypatch):
    run_dir = run_train([], tmp_path)
    checkpoints.lock_run_dir(str(run_dir)).release()  # main() let go of it when it returned
    proc = holder(run_dir)
    try:
        loaded = []
        real_load_models = loading.load_models
        monkeypatch.setattr(loading, "load_models", lambda *a, **k: loaded.append(1) or real_load_models(*a, **k))
        with pytest.raises(utils.ConfigError, match=f"^The run folder {run_dir} is in use by a live run \\(pid {proc.pid} on "):
            train.main(compose_config([f"resume={run_dir}"]))
        assert not loaded  # refused before any model loads
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert (run_dir / ".lock").read_text().startswith(f"pid {proc.pid} ")  # the dead run's lock file is still there
        folder, stop = train.main(compose_config([f"resume={run_dir}"]))  # and does not block
        assert (Path(folder), stop) == (run_dir, None) and loaded
    finally:
        kill_all([proc])


@pytest.mark.timeout(120)
def test_a_fresh_run_holds_its_folder_from_before_config_yaml(tmp_path, monkeypatch):
    # The folder is locked before config.yaml (which resume= needs) exists.
    seen = {}
    save = checkpoints.save_run_config

    def spy(config, path, *a, **k):
        if path.endswith("config.yaml") and "locked" not in seen:
            try:
                checkpoints.lock_run_dir(os.path.dirname(path)).release()
                seen["locked"] = False
            except utils.ConfigError:
                seen["locked"] = True
        return save(config, path, *a, **k)

    monkeypatch.setattr(checkpoints, "save_run_config", spy)
    run_train([], tmp_path)
    assert seen == {"locked": True}


@pytest.mark.timeout(120)
def test_fsdp_launcher_refuses_a_held_folder_before_starting_any_process(tmp_path):
    folder = fake_run_folder(tmp_path, ["trainer=FSDPTrainer", "world_size=2"])
    proc = holder(folder)
    try:
        done = subprocess.run(
            [sys.executable, "train.py", f"resume={folder}"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120
        )
    finally:
        kill_all([proc])
    assert done.returncode == 2, done.stderr[-2000:]
    assert [line for line in done.stderr.splitlines() if line.strip()] == [
        f"Error: The run folder {folder} is in use by a live run (pid {proc.pid} on {os.uname()[1]}); "
        "wait for that run to end or stop it, then try again."
    ]
    assert "Starting" not in done.stdout


@pytest.mark.timeout(240)
def test_under_torchrun_a_held_folder_is_refused_on_every_rank_and_said_once(tmp_path):
    # Only rank 0 takes the lock; rank 1 must hear the refusal rather than go on loading.
    folder = fake_run_folder(tmp_path, ["trainer=FSDPTrainer"])
    proc = holder(folder)
    try:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "train.py", f"resume={folder}"]
        done = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=180)
    finally:
        kill_all([proc])
    assert done.returncode != 0
    assert done.stderr.count("is in use by a live run") == 1, done.stderr[-3000:]
    assert "Policy:" not in done.stdout and "Resuming" not in done.stdout


@pytest.mark.timeout(240)
def test_under_torchrun_every_rank_raises_the_refusal_before_loading(tmp_path):
    # Each rank runs main() itself: rank 1 must raise the refusal too, not load the models and
    # wait in rank 0's broadcast of them.
    folder = fake_run_folder(tmp_path, ["trainer=FSDPTrainer"])
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, sys, train, utils\nfrom modeling import models\n"
        "from conftest import compose_config\n"
        "train.load_tokenizer = models.load_tokenizer = None  # loading anything fails loudly\n"
        "try:\n"
        f"    train.main(compose_config(['resume={folder}']))\n"
        "except utils.ConfigError as e:\n"
        f"    with open(os.path.join({str(tmp_path)!r}, 'rank' + os.environ['RANK']), 'w') as f:\n"
        "        f.write(str(e))\n"
        "sys.stdout.flush(); sys.stderr.flush()\n"
        "os._exit(0)  # no interpreter teardown, as processes.exit_rank: gloo's threads can abort it (seen in CI)\n"
    )
    proc = holder(folder)
    try:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script)]
        env = {**ENV, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    finally:
        kill_all([proc])
    assert done.returncode == 0, done.stderr[-3000:]
    expected = f"The run folder {folder} is in use by a live run (pid {proc.pid} on {os.uname()[1]}); wait for that run to end or stop it, then try again."
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == [expected, expected]


@pytest.mark.timeout(120)
def test_ray_refuses_a_held_folder_before_ray_starts(tmp_path):
    ray = pytest.importorskip("ray")
    from parallel import ray_launcher

    folder = fake_run_folder(tmp_path, ["launcher=ray"])
    proc = holder(folder)
    try:
        config = setup.effective_config(compose_config(["launcher=ray", f"resume={folder}"]))
        with pytest.raises(utils.ConfigError, match=f"The run folder {folder} is in use by a live run"):
            ray_launcher.launch(config, train.main)
        assert not ray.is_initialized()
    finally:
        kill_all([proc])


# ----------------------------------------------------------------------------- mistyped keys

LOSS_KEYS = "average_log_prob, beta, label_smoothing, name, nll_weight, reference_free"  # config/loss/dpo.yaml
HH_KEYS = "conversation, holdout_fraction, local_dir, subsets"  # config/config.yaml, data.hh
LOSS_OPTIONS = ", ".join(sorted(p.stem for p in (REPO / "config" / "loss").glob("*.yaml")))  # the config group's files


@pytest.mark.parametrize(
    "overrides, sentence",
    [
        (["loss.betaa=0.1"], f"loss.betaa is not a config key; did you mean loss.beta? (keys of loss: {LOSS_KEYS})"),
        (
            ["data.hh.subset=[a]"],
            f"data.hh.subset is not a config key; did you mean data.hh.subsets? (keys of data.hh: {HH_KEYS})",
        ),
        (
            ["data.hhh.subsets=[a]"],
            "data.hhh.subsets is not a config key; did you mean data.hh.subsets? (keys of data: arithmetic, hf, hh, json, se, shp, tldr)",
        ),
        (["loss=ipoo"], f"loss=ipoo is not an option of loss; did you mean loss=ipo? (options: {LOSS_OPTIONS})."),
        (
            ["loss=ipo", "loss.label_smoothing=0.1"],
            # regression: it said "to add it, write +loss.label_smoothing=0.1", which validate_config then refuses
            "loss=ipo has no key 'label_smoothing' (keys of loss: average_log_prob, beta, name, nll_weight); remove it.",
        ),
    ],
)
def test_a_mistyped_nested_key_names_the_closest_one(overrides, sentence):
    assert override_error(overrides) == sentence


def test_a_mistyped_top_level_key_or_addition_names_the_closest_one():
    top = sorted(set(compose_config([]).keys()))
    for typed in ("batch_szie=8", "+batch_szie=8", "++batch_szie=8"):
        message = override_error([typed])
        assert message.startswith("batch_szie is not a config key; did you mean batch_size? ("), message
        assert message.endswith(f"keys: {', '.join(top)})")


@pytest.mark.parametrize(
    "overrides",
    [
        ["batch_size=8"],
        ["++batch_size=8"],
        ["+data.mine.path=x.jsonl", "datasets=[mine]"],
        ["+data.json.path=x.jsonl"],
        ["+model.config.foo=1"],
        ["+my_tag=x"],
        ["loss=ipo", "+loss.label_smoothing=0.1"],  # checks.validate_config's own sentence
        ["batch_size=4,8"],  # not about a key: Hydra says what is wrong
    ],
)
def test_legitimate_overrides_and_other_mistakes_are_left_alone(overrides):
    assert override_error(overrides) is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("typed", ["batch_szie=8", "+batch_szie=8"])
def test_command_line_says_did_you_mean_in_one_sentence_and_exits_2(tmp_path, typed):
    done = subprocess.run(
        [sys.executable, "train.py", typed, f"output_root={tmp_path}"],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: batch_szie is not a config key; did you mean batch_size? (")
    assert "HYDRA_FULL_ERROR" not in done.stderr and "Traceback" not in done.stderr
    assert not done.stdout.strip() and not list(tmp_path.iterdir())


def test_resume_of_a_checkpoint_folder_names_its_run_folder(tmp_path):
    # Regression (fresh-user trial): resume=<run>/step-N said only "is not a run folder".
    run = tmp_path / "run"
    (run / "step-8").mkdir(parents=True)
    (run / "config.yaml").write_text("seed: 0\n")
    os.symlink("step-8", run / "LATEST")
    config = compose_config([f"resume={run / 'step-8'}"])
    with pytest.raises(utils.ConfigError) as e:
        setup.effective_config(config)
    assert str(e.value) == (
        f"resume={run / 'step-8'} is not a run folder with a LATEST checkpoint and config.yaml; "
        f"it looks like a checkpoint inside one: give the run folder, resume={run}."
    )


@pytest.mark.parametrize("body, code", [("pass", 0), ("sys.exit(3)", 3), ("raise RuntimeError('boom')", 1)])
def test_a_rank_leaves_with_its_code_and_without_interpreter_teardown(body, code):
    # Regression: a finished FSDP/TP rank sometimes aborted in the interpreter's teardown (gloo's
    # threads freeing tensors: "terminate called without an active exception", exit 250), so the
    # launcher reported a finished run as failed. A rank now leaves by os._exit: no teardown runs
    # (the atexit handler below stands for it), and the exit code is kept.
    script = textwrap.dedent(
        f"""
        import atexit, sys
        sys.path.insert(0, {str(REPO)!r})
        import train
        from runs import checks
        from runs import processes
        atexit.register(lambda: print("teardown ran"))
        def run():
            print("trained", flush=False)
            {body}
        processes.exit_rank(run)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == code, done.stderr
    assert done.stdout == "trained\n"  # flushed, and no teardown


def test_the_training_loop_handles_stop_signals_only_within_it_and_only_in_the_main_thread():
    import threading
    from types import SimpleNamespace

    trainer = SimpleNamespace(stop_requested=False, stop_signal=None)
    before = {s: signal.getsignal(s) for s in ending.STOP_SIGNALS}
    with ending.stop_signals(trainer):
        os.kill(os.getpid(), signal.SIGTERM)  # asks for a checkpoint after this step, and stops nothing now
        time.sleep(0.1)
    assert (trainer.stop_requested, trainer.stop_signal) == (True, signal.SIGTERM)
    assert {s: signal.getsignal(s) for s in ending.STOP_SIGNALS} == before  # the handlers it replaced, back

    seen = []  # Ray Train runs the loop in a thread, where signal.signal raises: nothing is installed there
    thread = threading.Thread(target=lambda: seen.append(_installs_nothing(trainer)))
    thread.start()
    thread.join()
    assert seen == [True]


def _installs_nothing(trainer) -> bool:
    before = {s: signal.getsignal(s) for s in ending.STOP_SIGNALS}
    with ending.stop_signals(trainer):
        return {s: signal.getsignal(s) for s in ending.STOP_SIGNALS} == before
