"""Hydra sweeps through the submitit launcher: each job of ``python train.py -m`` in its own process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from runs import launch

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install hydra-submitit-launcher")

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
SMALL, BIG = 256, 8192  # model.config.intermediate_size of the sweep's two jobs (model=tiny's is 256)


def sweep(tmp_path: Path, *args: str, timeout: float = 240, launcher: str = "submitit_local") -> subprocess.CompletedProcess:
    """``python train.py -m hydra/launcher=<launcher> <TINY> num_threads=1 <args>`` run from
    ``tmp_path`` (not the repository: the jobs must find its modules themselves)."""
    cmd = [sys.executable, str(REPO / "train.py"), "-m", f"hydra/launcher={launcher}", *TINY, "num_threads=1"]
    cmd += [f"output_root={tmp_path / 'out'}", *args]
    return subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=timeout)


def lock_pid(run_dir: Path) -> int:
    """The pid of the process that ran ``run_dir`` (its ``.lock`` says "pid N on HOST")."""
    return int(re.match(r"pid (\d+)", (run_dir / ".lock").read_text()).group(1))


@pytest.mark.timeout(300)
def test_submitit_local_runs_each_job_in_its_own_process_with_its_own_peak(tmp_path):
    result = sweep(
        tmp_path, "loss=dpo", "save_hf_export=false", "sample_during_eval=false", f"model.config.intermediate_size={SMALL},{BIG}"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    runs = {saved_config(r).model.config.intermediate_size: r for r in out.glob("dpo_run_*")}
    assert sorted(runs) == [SMALL, BIG]
    for run in runs.values():
        assert (run / "FINISHED").is_file() and (run / "LATEST" / "policy.pt").is_file()
    # two processes, neither the command's: each run folder's lock names the process that held it
    pids = {size: lock_pid(run) for size, run in runs.items()}
    assert len(set(pids.values())) == 2 and not set(pids.values()) & {os.getpid()}
    # submitit kept one folder per job (job id = its local controller's pid), each log naming its own run
    (sweep_dir,) = out.glob("multirun_*")
    logs = sorted(sweep_dir.glob(".submitit/[0-9]*/*_0_log.out"))
    assert len(logs) == 2 and len({log.parent.name for log in logs}) == 2
    named = sorted(re.search(r"Run folder: (\S+)", log.read_text()).group(1) for log in logs)
    assert named == sorted(str(run) for run in runs.values())
    # the launching process names every job's run folder in the sweep's order (and leaves no unexpanded .submitit/%j)
    assert result.stdout == (
        f"\nSweep done: 2 jobs ({sweep_dir}; each job's output under .submitit/).\n"
        f"  model.config.intermediate_size={SMALL}   finished  {runs[SMALL]}\n"
        f"  model.config.intermediate_size={BIG}  finished  {runs[BIG]}\n"
    )
    assert sorted(p.name for p in (sweep_dir / ".submitit").iterdir()) == sorted(log.parent.name for log in logs)
    # each job's peak is its own: the big job's extra weights, by hand: 2 layers x (gate, up, down) x
    # hidden 64 x (8192 - 256) float32 numbers, for the policy and the reference, are in its setup peak
    # and not in the small job's
    extra_mib = 2 * 3 * 64 * (BIG - SMALL) * 4 * 2 / 2**20  # 23.25 MiB
    setup = {size: last_record(run)["memory/rank0_peak_setup_rss_mib"] for size, run in runs.items()}
    assert setup[BIG] - setup[SMALL] >= 0.9 * extra_mib, setup
    peak = {size: last_record(run)["memory/rank0_peak_rss_mib"] for size, run in runs.items()}
    assert peak[BIG] - peak[SMALL] >= 0.9 * extra_mib, peak


def saved_config(run_dir: Path):
    """The run's saved config."""
    return OmegaConf.load(run_dir / "config.yaml")


def last_record(run_dir: Path) -> dict:
    """The last record of the run's metrics.jsonl (the peak-memory record)."""
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


@pytest.mark.timeout(120)
def test_a_failed_job_is_one_sentence_naming_its_log(tmp_path):
    missing = tmp_path / "missing.jsonl"
    result = sweep(tmp_path, "loss=dpo", "datasets=[json]", f"data.json.path={missing}")
    assert result.returncode == 1
    (log,) = (tmp_path / "out").glob("multirun_*/.submitit/[0-9]*/*_0_log.out")
    job = log.parent.name
    assert f"Job {job} ended with exit code 2: Data file {missing} does not exist" in result.stderr
    assert f"(its output: {log})" in result.stderr
    assert "Traceback" not in result.stderr and "FailedJobError" not in result.stderr
    # the summary first (no swept key: the job's number), then the job's sentence as the last line
    sweep_dir = log.parent.parent.parent
    assert (
        result.stdout
        == f"\nSweep done: 1 job ({sweep_dir}; each job's output under .submitit/).\n  #0  failed (exit code 2)  (no run folder)\n"
    )
    assert result.stderr.endswith(f"(its output: {log})\n")


@pytest.mark.timeout(180)
def test_submitits_time_limit_signal_saves_a_checkpoint_and_stops(tmp_path):
    # submitit sends SIGUSR2 signal_delay_s before a job's time limit: the job saves and stops (140), as on SIGTERM
    command = [sys.executable, str(REPO / "train.py"), "-m", "hydra/launcher=submitit_local", *TINY, "num_threads=1"]
    command += ["loss=dpo", "n_examples=100000", "save_hf_export=false", f"output_root={tmp_path / 'out'}"]
    launcher = subprocess.Popen(command, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 150
        while not list((tmp_path / "out").glob("dpo_run_*/LATEST")) and time.time() < deadline:
            time.sleep(0.5)
        (run,) = [p.parent for p in (tmp_path / "out").glob("dpo_run_*/LATEST")]
        os.kill(lock_pid(run), signal.SIGUSR2)
        stdout, stderr = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 1
    assert re.search(rf"ended with exit code 140: Resume with: python train.py resume={re.escape(str(run))} ", stderr), stderr
    assert stdout.endswith(f"\n  #0  stopped (exit code 140)  {run}\n"), stdout
    assert (run / "LATEST" / "policy.pt").is_file() and not (run / "FINISHED").exists()
    (log,) = (tmp_path / "out").glob("multirun_*/.submitit/[0-9]*/*_0_log.out")
    assert "Received SIGUSR2: saving a checkpoint after this step, then stopping." in log.read_text()


@pytest.mark.timeout(120)
def test_a_basic_launcher_sweep_ends_with_the_same_summary(tmp_path):
    result = sweep(tmp_path, "save_hf_export=false", "sample_during_eval=false", "loss=dpo,ipo", launcher="basic")
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    (sweep_dir,) = out.glob("multirun_*")
    (dpo,), (ipo,) = out.glob("dpo_run_*"), out.glob("ipo_run_*")
    summary = f"\nSweep done: 2 jobs ({sweep_dir}).\n  loss=dpo  finished  {dpo}\n  loss=ipo  finished  {ipo}\n"
    assert result.stdout.endswith(summary), result.stdout[-2000:]


def test_a_basic_launcher_sweep_goes_on_after_a_job_that_ends_with_sys_exit_0(tmp_path, monkeypatch, capsys):
    # sft_first, FSDP/TP and Ray jobs end with sys.exit(0): that ended the whole sweep after its first job
    import train

    def run_command(config, command):
        launch.tell_launcher(str(tmp_path / f"{config.loss.name}_run"))
        sys.exit(0)

    monkeypatch.setattr(train, "run_command", run_command)
    monkeypatch.setattr(train.hydra_main.__wrapped__, "__module__", "__main__")  # Hydra finds config/ beside train.py
    monkeypatch.setattr(sys, "argv", ["train.py", "-m", "loss=dpo,ipo", f"output_root={tmp_path}"])
    train.hydra_main()
    (sweep_dir,) = tmp_path.glob("multirun_*")
    summary = f"\nSweep done: 2 jobs ({sweep_dir}).\n  loss=dpo  finished  {tmp_path / 'dpo_run'}\n  loss=ipo  finished  {tmp_path / 'ipo_run'}\n"
    assert capsys.readouterr().out == summary


def test_the_slurm_launcher_config_composes_into_an_sbatch_script(tmp_path, monkeypatch):
    submitit = pytest.importorskip("submitit")
    monkeypatch.setattr(submitit.SlurmExecutor, "affinity", staticmethod(lambda: 1))  # srun is not here: nothing is submitted
    overrides = ["hydra/launcher=slurm", "hydra.launcher.partition=gpu", "hydra.launcher.mem_gb=32"]
    with initialize_config_dir(config_dir=str(REPO / "config"), version_base="1.3"):
        config = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    launcher = config.hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (launcher.partition, launcher.mem_gb, launcher.timeout_min, launcher.gpus_per_node) == ("gpu", 32, 240, 1)
    # the keys as the plugin hands them to submitit (its own keys as they are, the others slurm_<key>), without submitting
    params = OmegaConf.to_container(launcher, resolve=False)
    shared = {"timeout_min", "cpus_per_task", "gpus_per_node", "tasks_per_node", "mem_gb", "nodes", "name", "stderr_to_stdout"}
    params = {
        k if k in shared else f"slurm_{k}": v
        for k, v in params.items()
        if k not in ("_target_", "submitit_folder", "max_num_timeout")
    }
    params["name"] = "train"
    executor = submitit.AutoExecutor(folder=tmp_path, cluster="slurm")
    executor.update_parameters(**params)
    script = executor._executor._make_submission_file_text("python -u -m submitit.core._submit x", "uid")
    for line in ("--partition=gpu", "--mem=32GB", "--time=240", "--gpus-per-node=1", "--cpus-per-task=8", "--signal=USR2@120"):
        assert f"#SBATCH {line}\n" in script, script


class FakeStage:
    """Stands in for a stage's ``subprocess.Popen`` in :func:`launch.run_stages`: makes a finished run
    folder under ``root`` and names it, as train.py does, through the pipe its launcher gave it."""

    commands: list[list[str]] = []

    def __init__(self, command, env=None, **kwargs):

        FakeStage.commands.append(command)
        root = Path(next(a for a in command if a.startswith("output_root=")).split("=", 1)[1])
        run = root / f"stage{len(FakeStage.commands)}_run"
        (run / "step-8").mkdir(parents=True)
        (run / "LATEST").symlink_to("step-8")
        (run / "FINISHED").write_text("ok\n")
        (run / "config.yaml").write_text("loss: {name: dpo}\n")
        if env is not None and launch.RUN_FOLDER_FD_ENV in env:
            os.write(int(env[launch.RUN_FOLDER_FD_ENV]), str(run).encode())

    def wait(self):
        return 0

    def poll(self):
        return 0


def test_sft_first_in_a_submitit_job_runs_train_py_from_its_own_sft_stage(tmp_path, monkeypatch):
    # In a submitit job sys.argv[0] is submitit's _submit.py, and the sweep's other jobs make run
    # folders in the same output_root at the same time: the stages must run train.py, and stage 2
    # must start from the policy of its own stage 1, not from the newest finished folder there.

    overrides = [*TINY[:-1], "sft_first.n_examples=8", f"output_root={tmp_path}"]
    with initialize_config_dir(config_dir=str(REPO / "config"), version_base="1.3"):
        config = compose(config_name="config", overrides=overrides)
    other = tmp_path / "zz_another_jobs_sft_run"  # newer by name than the stage's own folder
    (other / "LATEST").mkdir(parents=True)
    (other / "FINISHED").write_text("ok\n")
    monkeypatch.setattr(sys, "argv", ["/site-packages/submitit/core/_submit.py", "/sweep/.submitit/123"])
    monkeypatch.setattr(launch.subprocess, "Popen", FakeStage)
    FakeStage.commands = []
    assert launch.run_stages(config, overrides) == 0
    assert [Path(c[1]).resolve() for c in FakeStage.commands] == [REPO / "train.py"] * 2
    assert FakeStage.commands[1][-1] == f"model.archive={tmp_path / 'stage1_run' / 'LATEST' / 'policy.pt'}"


def test_fsdp_ranks_of_a_submitit_job_run_train_py_with_the_jobs_overrides(monkeypatch):
    # launch() started its ranks with sys.argv, which in a submitit job is submitit's _submit.py and its folder
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    class Started(Exception):
        """The first rank's command (nothing is started)."""

    def popen(command, **kwargs):
        raise Started(command)

    job = ["loss=ipo", "trainer=FSDPTrainer", "world_size=2"]
    with initialize_config_dir(config_dir=str(REPO / "config"), version_base="1.3"):
        hydra_config = compose(config_name="config", overrides=["hydra/launcher=submitit_local", *job], return_hydra_config=True)
        config = compose(config_name="config", overrides=job)
    monkeypatch.setattr(sys, "argv", ["/site-packages/submitit/core/_submit.py", "/sweep/.submitit/123"])
    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    monkeypatch.setattr(HydraConfig.instance(), "cfg", None)  # restored afterwards
    for mode, expected in ((RunMode.MULTIRUN, [str(REPO / "train.py"), *job]), (RunMode.RUN, sys.argv)):  # RUN: a rank, or no -m
        HydraConfig.instance().set_config(OmegaConf.merge(hydra_config, {"hydra": {"mode": mode}}))
        with pytest.raises(Started) as started:
            launch.launch(config)
        assert started.value.args[0] == [sys.executable, *expected]


def children_of(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path("/proc", entry, "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        return Path("/proc", str(pid), "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_two_stage(tmp_path: Path, stage_number: int = 1, extra: tuple = ()) -> subprocess.Popen:
    """Start the default two-stage command in ``tmp_path`` (made here), its output in ``tmp_path``/stdout and /stderr
    (files: several runners at once must never block on a full pipe); long enough to be stopped during stage
    ``stage_number``."""
    sft = 16 if stage_number == 2 else 100000  # a short SFT stage when the signal is for the second
    args = [a for a in TINY if not a.startswith("sft_first")] + [f"sft_first.n_examples={sft}", "n_examples=100000"]
    command = [sys.executable, str(REPO / "train.py"), *args, "num_threads=1", "save_hf_export=false", *extra]
    tmp_path.mkdir(parents=True, exist_ok=True)
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        return subprocess.Popen(
            [*command, f"output_root={tmp_path / 'out'}"], cwd=tmp_path, env=ENV, stdout=stdout, stderr=stderr, text=True
        )


def stage_started(runner: subprocess.Popen, tmp_path: Path, stage_number: int = 1) -> tuple[Path, int]:
    """Wait until stage ``stage_number`` of ``runner`` (started in ``tmp_path``) wrote a checkpoint: (the stage's run
    folder, the stage's pid)."""
    prefix = "sft_" if stage_number == 1 else "dpo_"
    deadline = time.time() + 150
    while not list((tmp_path / "out").glob(f"{prefix}*/LATEST")) and time.time() < deadline and runner.poll() is None:
        time.sleep(0.5)
    (run,) = [p.parent for p in (tmp_path / "out").glob(f"{prefix}*/LATEST")]
    (stage,) = children_of(runner.pid)
    assert lock_pid(run) in [stage, *children_of(stage)]  # the stage, or under FSDP its rank 0
    return run, stage


def two_stage_run(tmp_path: Path, stage_number: int = 1, extra: tuple = ()) -> tuple[subprocess.Popen, Path, int]:
    """The default two-stage command, started and waited for until stage ``stage_number`` wrote a checkpoint: (the
    runner, the stage's run folder, the stage's pid)."""
    runner = start_two_stage(tmp_path, stage_number, extra)
    return (runner, *stage_started(runner, tmp_path, stage_number))


STOP_SIGNALS = [signal.SIGUSR1, signal.SIGINT, signal.SIGTERM, signal.SIGUSR2]  # Slurm: USR1, submitit: USR2, Ctrl-C, TERM


@pytest.mark.timeout(420)
@pytest.mark.parametrize("stage_number", [1, 2])
def test_each_stop_signal_to_the_two_stage_runner_checkpoints_the_running_stage_and_leaves_nothing_running(
    tmp_path, stage_number
):
    # Regression (issue 40): SIGUSR1 ended the runner at once (138); the SFT stage trained on with parent pid 1.
    # Each stop signal a scheduler sends, during either stage: one runner per signal, all four at once.
    runners = {sig: start_two_stage(tmp_path / sig.name, stage_number) for sig in STOP_SIGNALS}
    try:
        stopped = {}
        for sig, runner in runners.items():
            run, stage = stage_started(runner, tmp_path / sig.name, stage_number)
            before = os.path.realpath(run / "LATEST")
            os.kill(runner.pid, sig)
            stopped[sig] = (run, stage, before)
        for runner in runners.values():
            runner.wait(timeout=120)
    finally:
        for runner in runners.values():
            if runner.poll() is None:
                runner.kill()
    for sig, (run, stage, before) in stopped.items():
        runner, folder = runners[sig], tmp_path / sig.name
        stdout, stderr = (folder / "stdout").read_text(), (folder / "stderr").read_text()
        code = 128 + sig
        assert runner.returncode == code, (sig.name, stderr[-3000:])
        assert not alive(stage) and not children_of(runner.pid)
        assert os.path.realpath(run / "LATEST") != before and (run / "LATEST" / "policy.pt").is_file()  # saved on the signal
        saved = re.findall(r"Interrupted after \d+ examples; checkpoint saved to (\S+)\.\n", stdout)
        assert [os.path.realpath(p) for p in saved] == [os.path.realpath(run / "LATEST")]  # one checkpoint, on the signal
        assert not (run / "FINISHED").exists() and f"Stage {stage_number} of 2" in stdout and "Both stages" not in stdout
        assert "Resume with: " in stdout and f"resume={run}\n" in stdout  # the stage's own resume line
        if stage_number == 1:
            assert "Stage 2 of 2" not in stdout
            said = rf"Stage 1 of 2 ended with exit code {code}\. Continue it with python \S*train\.py resume={re.escape(str(run))}, then stage 2: "
            assert re.search(said, stderr), stderr[-3000:]
            assert f"model.archive={run}/LATEST/policy.pt" in stderr
        else:
            assert f"Stage 2 of 2 ended with exit code {code}." in stderr, stderr[-3000:]
            (sft,) = (folder / "out").glob("sft_*")
            assert (sft / "FINISHED").exists()  # the first stage is finished and left as it was


@pytest.mark.timeout(240)
@pytest.mark.parametrize("extra", [(), ("trainer=FSDPTrainer", "world_size=2")], ids=["basic", "fsdp"])
def test_kill_9_of_the_two_stage_runner_kills_its_stage_and_the_stages_ranks(tmp_path, extra):
    # Regression (issue 40): kill -9 of the runner left the SFT stage training; under FSDP, the stage is the
    # launcher of its ranks, which die with it.
    runner, run, stage = two_stage_run(tmp_path, extra=extra)
    family = [stage, *children_of(stage)]
    assert len(family) == 1 + 2 * bool(extra), family
    try:
        runner.kill()
        runner.wait(timeout=10)
        deadline = time.time() + 10
        while any(map(alive, family)) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(map(alive, family))
    finally:
        for pid in filter(alive, family):
            os.kill(pid, signal.SIGKILL)
