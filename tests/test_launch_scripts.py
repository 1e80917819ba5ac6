"""The launch scripts in scripts/ on CPU (gloo): run_node.sh, run_nodes.sh (torchrun's c10d
rendezvous; two "nodes" are two launches on this machine), slurm_dpo.sbatch under a stand-in
Slurm (``srun`` and ``scontrol`` on PATH) and ray_job.sh with a stand-in ``ray``.

Every command runs in its own process group with a timeout; on timeout the whole group is
killed, so no test can hang CI.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO
from test_distributed import assert_same_run, weights

SCRIPTS = REPO / "scripts"
# 2 nodes x 1 process, 16 steps of 8 examples: long enough to be signalled after the first eval.
ARGS = [
    "batch_size=8",
    "eval_batch_size=8",
    "n_eval_examples=16",
    "n_examples=128",
    "eval_every=64",
    "data.arithmetic.n_train=128",
    "data.arithmetic.n_test=16",
    "progress_bar=false",
    "minimum_log_interval_secs=0",
    "warmup_steps=2",
    "keep_checkpoints=0",
    "sample_during_eval=false",
    "sft_first.n_examples=null",  # one run, not model=tiny's two stages
    "plot_curves=false",
]
JOB_ID = "4242"


class Command:
    """A command started in its own process group, its output (stdout and stderr together)
    read by a thread so that a test can wait for a line while it runs."""

    def __init__(self, cmd: list[str], env: dict[str, str], cwd: Path = REPO):
        self.cmd = cmd
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    @property
    def text(self) -> str:
        """The output so far."""
        return "".join(self.lines)

    def kill(self, why: str) -> None:
        """Kill the process group and fail the test with ``why`` and the output's tail."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.reader.join(10)
        pytest.fail(f"{' '.join(self.cmd)}: {why} (killed):\n{self.text[-4000:]}")

    def wait_for(self, line_start: str, timeout: float) -> None:
        """Wait until a line starts with ``line_start``; fail (killing the group) on timeout or exit."""
        deadline = time.monotonic() + timeout
        while not any(line.startswith(line_start) for line in list(self.lines)):
            if self.proc.poll() is not None:
                self.reader.join(10)
                pytest.fail(f"{' '.join(self.cmd)} ended ({self.proc.returncode}) before {line_start!r}:\n{self.text[-4000:]}")
            if time.monotonic() > deadline:
                self.kill(f"no line starting with {line_start!r} in {timeout} s")
            time.sleep(0.05)

    def finish(self, timeout: float = 300) -> tuple[int, str]:
        """Wait for the exit; returns (exit status, output). Kills the group on timeout."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill(f"did not finish in {timeout} s")
        self.reader.join(30)
        return self.proc.returncode, self.text


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(**extra: str) -> dict[str, str]:
    """This environment with one thread per process, unbuffered output, this Python as the
    scripts' PYTHON, and ``extra``; no MASTER_ADDR/NNODES/RANK... from outside."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "NNODES", "RANK", "WORLD_SIZE")}
    env |= {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHON": sys.executable}
    return env | extra


def recording_stand_in(path: Path, log: Path) -> Path:
    """An executable at ``path`` that appends its working directory and arguments (one per
    line) to ``log`` and exits 0: a stand-in for a command a script must (not) run."""
    path.write_text(f'#!/usr/bin/env bash\n{{ pwd; printf "%s\\n" "$@"; }} >> {log}\n')
    path.chmod(0o755)
    return path


def run_dirs(out: Path) -> list[Path]:
    """The run folders under ``out`` (none when ``out`` does not exist), sorted."""
    return sorted(p for p in out.iterdir() if p.is_dir()) if out.exists() else []


def nodes_env(port: int, **extra: str) -> dict[str, str]:
    """run_nodes.sh's environment for 2 nodes of 1 process, rendezvous at 127.0.0.1:``port``."""
    return base_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NNODES="2", NPROC_PER_NODE="1", **extra)


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory) -> Path:
    """Two nodes of one process each, through run_nodes.sh (two concurrent launches on this
    machine): the uninterrupted run the Slurm runs must equal."""
    out = tmp_path_factory.mktemp("two-nodes") / "out"
    env = nodes_env(free_port())
    nodes = [Command([str(SCRIPTS / "run_nodes.sh"), *ARGS, f"output_root={out}"], env) for _ in range(2)]
    for node in nodes:
        code, text = node.finish()
        assert code == 0, text[-4000:]
    [run_dir] = run_dirs(out)
    return run_dir


# ---------------------------------------------------------------------------- run_nodes.sh


@pytest.mark.parametrize(
    ("env", "sentence"),
    [
        ({"NNODES": "2"}, "Error: MASTER_ADDR is not set; set it to a host every node reaches"),
        ({"MASTER_ADDR": "127.0.0.1"}, "Error: NNODES is not set; set it to the number of nodes"),
        ({"MASTER_ADDR": "127.0.0.1", "NNODES": "0"}, "Error: NNODES=0 is not a number of nodes; give an integer >= 1."),
    ],
    ids=["no-master-addr", "no-nnodes", "zero-nodes"],
)
def test_run_nodes_environment_mistake_is_one_sentence_before_torchrun_starts(tmp_path, env, sentence):
    calls = tmp_path / "python_calls"
    python = recording_stand_in(tmp_path / "python", calls)
    code, text = Command([str(SCRIPTS / "run_nodes.sh"), *ARGS], base_env(NPROC_PER_NODE="1", PYTHON=str(python), **env)).finish(
        30
    )
    assert code == 2
    assert text.startswith(sentence) and text.count("\n") == 1, text
    assert not calls.exists()  # torchrun (python -m torch.distributed.run) never started


def test_run_nodes_with_fewer_nodes_than_nnodes_ends_with_one_sentence(tmp_path):
    # NNODES=2 but one node only: torchrun's rendezvous would wait; after RDZV_TIMEOUT the
    # script says what is wrong and exits 2, within the test's timeout.
    env = nodes_env(free_port(), RDZV_TIMEOUT="3")
    start = time.monotonic()
    code, text = Command([str(SCRIPTS / "run_nodes.sh"), *ARGS, f"output_root={tmp_path}"], env).finish(120)
    assert code == 2, text[-3000:]
    last = text.strip().splitlines()[-1]
    assert last.startswith("Error: torchrun's rendezvous at 127.0.0.1:") and "did not gather NNODES=2 nodes within 3 s" in last
    assert "check NNODES" in last
    assert time.monotonic() - start < 90
    assert run_dirs(tmp_path) == []


def test_two_nodes_through_run_nodes_train_to_the_end(two_node_run):
    assert (two_node_run / "FINISHED").exists()
    assert os.readlink(two_node_run / "LATEST") == "step-128"
    # one process per node, world size 2: two shards
    assert sorted(p.name for p in (two_node_run / "LATEST" / "sharded").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


def test_run_node_trains_on_this_node_with_train_py_launching_the_ranks(tmp_path):
    short = [a for a in ARGS if not a.startswith(("n_examples=", "eval_every="))] + ["n_examples=16", "eval_every=16"]
    code, text = Command([str(SCRIPTS / "run_node.sh"), "world_size=2", *short, f"output_root={tmp_path}"], base_env()).finish()
    assert code == 0, text[-4000:]
    assert "Starting 2 FSDPTrainer processes" in text
    [run_dir] = run_dirs(tmp_path)
    assert (run_dir / "FINISHED").exists()


# ---------------------------------------------------------------------------- slurm_dpo.sbatch

FAKE_SRUN = '''#!{python}
"""Stand-in for srun: runs the command once per node (SLURM_NNODES) on this machine,
concurrently, each task in a process group of its own with SLURM_NODEID/SLURM_PROCID set;
exits with the highest exit status. A signal it gets goes where slurmstepd would send it:
FAKE_PROCTRACK=cgroup: every process of each task (the task and all its descendants);
pgid: each task's process group."""
import os, signal, subprocess, sys
import psutil

args = sys.argv[1:]
while args and args[0].startswith("-"):
    args.pop(0)
n = int(os.environ["SLURM_NNODES"])
tasks = []
for node in range(n):
    env = dict(os.environ, SLURM_NODEID=str(node), SLURM_PROCID=str(node), SLURM_LOCALID="0", SLURM_STEP_ID="0")
    tasks.append(subprocess.Popen(args, env=env, start_new_session=True))


def forward(signum, frame):
    for task in tasks:
        if task.poll() is not None:
            continue
        if os.environ["FAKE_PROCTRACK"] == "pgid":
            os.killpg(task.pid, signum)
            continue
        procs = [psutil.Process(task.pid)]
        procs += procs[0].children(recursive=True)
        for p in procs:
            try:
                p.send_signal(signum)
            except psutil.NoSuchProcess:
                pass


for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
    signal.signal(s, forward)
codes = [task.wait() for task in tasks]
sys.exit(max(codes))
'''

FAKE_SCONTROL = """#!/usr/bin/env bash
# Stand-in for scontrol: show hostnames (this machine, once per node), show config
# (ProctrackType from FAKE_PROCTRACK), requeue (recorded in FAKE_SCONTROL_LOG).
case "$1 ${2:-}" in
"show hostnames") for _ in $(seq "$SLURM_NNODES"); do echo 127.0.0.1; done ;;
"show config") echo "ProctrackType           = proctrack/$FAKE_PROCTRACK" ;;
"requeue "*) echo "$*" >> "$FAKE_SCONTROL_LOG" ;;
*) echo "fake scontrol: unexpected $*" >&2; exit 1 ;;
esac
"""


def fake_slurm(tmp_path: Path, proctrack: str = "cgroup") -> tuple[dict[str, str], Path]:
    """The environment of a 2-node Slurm job on this machine: stand-in srun and scontrol on
    PATH, and the file where the stand-in scontrol records requeues."""
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN.format(python=sys.executable)), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "scontrol_calls"
    env = base_env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SLURM_JOB_ID=JOB_ID,
        SLURM_JOB_NODELIST="node[0-1]",
        SLURM_NNODES="2",
        SLURM_JOB_NUM_NODES="2",
        SLURM_SUBMIT_DIR=str(REPO),
        MASTER_PORT=str(free_port()),
        NPROC_PER_NODE="1",  # the stand-in nodes have no GPU
        FAKE_PROCTRACK=proctrack,
        FAKE_SCONTROL_LOG=str(log),
    )
    return env, log


def sbatch(env: dict[str, str], out: Path) -> Command:
    """The batch script's body as Slurm would run it: ``bash scripts/slurm_dpo.sbatch <overrides>``."""
    return Command(["bash", str(SCRIPTS / "slurm_dpo.sbatch"), *ARGS, f"output_root={out}"], env)


def test_slurm_warning_checkpoints_requeues_and_the_requeued_job_continues_to_the_same_weights(tmp_path, two_node_run):
    # pgid: srun's signal reaches only the tasks' process groups, not the ranks (run_nodes.sh must
    # pass it on). With cgroup, where it reaches every process (the two-stage test below), run_nodes.sh
    # must not pass it on: a rank told twice stops without a checkpoint.
    env, requeues = fake_slurm(tmp_path, "pgid")
    out = tmp_path / "out"
    job = sbatch(env, out)
    job.wait_for("[eval] after 0 examples", timeout=240)
    os.kill(job.proc.pid, signal.SIGUSR1)  # --signal=B:USR1: the batch shell alone
    code, text = job.finish()
    assert code == 138, text[-4000:]
    assert requeues.read_text() == f"requeue {JOB_ID}\n"
    assert text.count("Received SIGUSR1") == 2, text[-4000:]  # each of the 2 ranks, once
    [run_dir] = run_dirs(out)
    stopped_at = int(os.readlink(run_dir / "LATEST").removeprefix("step-"))
    assert 0 < stopped_at < 128
    assert not (run_dir / "FINISHED").exists()

    # The requeued job: the same script, the same environment.
    code, text = sbatch(env, out).finish()
    assert code == 0, text[-4000:]
    assert f"resume=auto: continuing {run_dir}" in text
    assert requeues.read_text() == f"requeue {JOB_ID}\n"  # no second requeue
    assert run_dirs(out) == [run_dir]
    assert (run_dir / "FINISHED").exists()
    assert_same_run(two_node_run, run_dir)


TWO_STAGES = [a for a in ARGS if not a.startswith("sft_first")] + ["sft_first.n_examples=128"]  # model=tiny's SFT stage


def sbatch_two_stages(env: dict[str, str], out: Path) -> Command:
    """The batch script in the default two-stage mode (sft_first): an SFT launch, then DPO from its policy."""
    return Command(["bash", str(SCRIPTS / "slurm_dpo.sbatch"), *TWO_STAGES, f"output_root={out}"], env)


def wait_after(job: Command, banner: str, line_start: str, timeout: float = 240) -> None:
    """Wait until a line starting with ``line_start`` follows the line starting with ``banner``."""
    deadline = time.monotonic() + timeout
    while True:
        lines = list(job.lines)
        starts = [k for k, line in enumerate(lines) if line.startswith(banner)]
        if starts and any(line.startswith(line_start) for line in lines[starts[0] :]):
            return
        if job.proc.poll() is not None or time.monotonic() > deadline:
            job.kill(f"no {line_start!r} after {banner!r}")
        time.sleep(0.05)


def test_slurm_two_stage_job_requeued_in_each_stage_ends_with_the_weights_of_an_uninterrupted_one(tmp_path):
    # Regression (issue 40): under the batch script's torchrun each rank skipped model=tiny's SFT stage without a
    # word. Now each stage is a launch; a job warned in stage 1 continues it when requeued, then runs stage 2; one
    # warned in stage 2 leaves the finished SFT run as it is and continues the DPO run. The stand-in srun
    # signals every process of the step (proctrack/cgroup), the ranks too: each rank must be told once.
    env, requeues = fake_slurm(tmp_path, "cgroup")
    code, text = sbatch_two_stages(env, tmp_path / "whole").finish(400)
    assert code == 0, text[-4000:]
    assert "=== Stage 1 of 2" in text and "=== Stage 2 of 2" in text and not requeues.exists()
    assert text.count("resume=auto: no unfinished run") == 2, text[-4000:]  # each stage, on its first launch
    whole_sft, whole_dpo = run_dirs(tmp_path / "whole")[::-1]  # dpo_run_... sorts before sft_run_...
    assert whole_sft.name.startswith("sft_run_") and whole_dpo.name.startswith("dpo_run_")

    out = tmp_path / "out"
    job = sbatch_two_stages(env, out)  # warned during stage 1
    wait_after(job, "=== Stage 1 of 2", "[eval] after 0 examples")
    os.kill(job.proc.pid, signal.SIGUSR1)
    code, text = job.finish()
    assert code == 138 and requeues.read_text() == f"requeue {JOB_ID}\n", text[-4000:]
    assert text.count("Received SIGUSR1") == 2, text[-4000:]  # each of the 2 ranks, once
    [sft] = run_dirs(out)
    assert not (sft / "FINISHED").exists() and "=== Stage 2 of 2" not in text
    assert 0 < int(os.readlink(sft / "LATEST").removeprefix("step-")) < 128

    job = sbatch_two_stages(env, out)  # requeued: continues stage 1, then is warned during stage 2
    wait_after(job, "=== Stage 2 of 2", "[eval] after 0 examples")
    os.kill(job.proc.pid, signal.SIGUSR1)
    code, text = job.finish()
    assert code == 138 and requeues.read_text() == f"requeue {JOB_ID}\n" * 2, text[-4000:]
    assert text.count("Received SIGUSR1") == 2, text[-4000:]
    assert f"resume=auto: continuing {sft}" in text and (sft / "FINISHED").exists()
    dpo = next(p for p in run_dirs(out) if p != sft)
    assert f"model.archive={sft}/LATEST/policy.pt" in text and not (dpo / "FINISHED").exists()

    code, text = sbatch_two_stages(env, out).finish(400)  # requeued again: stage 2 continues to the end
    assert code == 0, text[-4000:]
    assert "=== Stage 1 of 2" not in text and f"resume=auto: continuing {dpo}" in text
    assert run_dirs(out) == [dpo, sft] and (dpo / "FINISHED").exists()
    a, b = weights(whole_sft), weights(sft)  # SFT has no rejected log-probs to compare: its weights
    assert set(a) == set(b) and all(torch.allclose(b[k], a[k], rtol=1e-4, atol=5e-5) for k in a)
    assert_same_run(whole_dpo, dpo)


# ---------------------------------------------------------------------------- ray_job.sh


def test_ray_job_submits_train_py_with_the_repository_as_working_dir(tmp_path):
    calls = tmp_path / "ray_calls"
    recording_stand_in(tmp_path / "ray", calls)
    env = base_env(PATH=f"{tmp_path}:{os.environ['PATH']}", RAY_ADDRESS="http://head:8265")
    code, text = Command(
        [str(SCRIPTS / "ray_job.sh"), "output_root=/shared/runs", "ray.num_workers=4"], env, cwd=tmp_path
    ).finish(30)
    assert code == 0, text
    assert calls.read_text().splitlines() == [
        str(REPO),
        *["job", "submit", "--address", "http://head:8265", "--working-dir", ".", "--"],
        *["python", "train.py", "launcher=ray", "ray.address=auto", "trainer=FSDPTrainer"],
        *["output_root=/shared/runs", "ray.num_workers=4"],
    ]


@pytest.mark.parametrize("args", [[], ["output_root=runs"]], ids=["none", "relative"])
def test_ray_job_without_an_absolute_output_root_is_one_sentence(tmp_path, args):
    calls = tmp_path / "ray_calls"
    recording_stand_in(tmp_path / "ray", calls)
    env = base_env(PATH=f"{tmp_path}:{os.environ['PATH']}", RAY_ADDRESS="http://head:8265")
    code, text = Command([str(SCRIPTS / "ray_job.sh"), *args], env).finish(30)
    assert code == 2
    assert text.startswith("Error: output_root is ") and "give an absolute path" in text and text.count("\n") == 1, text
    assert not calls.exists()
