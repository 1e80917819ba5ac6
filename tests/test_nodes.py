"""Several nodes and schedulers: two torchrun "nodes" on one machine (c10d rendezvous, gloo on
CPU), the config / code / output_root checks across ranks, SIGUSR1 (SLURM's warning before a
time limit), the FINISHED marker and ``resume=auto``.

Every subprocess runs in its own process group with a timeout; on timeout the group is killed,
so no test can hang CI.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import types
import uuid
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY, compose_config, run_train
from omegaconf import OmegaConf
from test_distributed import COMMON, assert_same_run, cli, start_train, weights

import train
import utils
from runs import checkpoints, nodes, setup
from runs.config_text import digest, flat_config

FSDP = [*COMMON, "trainer=FSDPTrainer", "sample_during_eval=false", "save_hf_export=false"]
HOST = socket.gethostname()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(
    args: list[list[str]], roots: list[Path], logs: Path, cwds=(REPO, REPO), timeout: int = 300
) -> list[tuple[int, str]]:
    """Start two ``torchrun --nnodes 2 --nproc_per_node 1`` nodes at once, node i with
    ``args[i]`` and ``output_root=roots[i]`` (in ``cwds[i]``), each in its own process group
    with its output in a file; wait for both; kill both groups on timeout.
    Returns each node's (exit code, output)."""
    port, rdzv_id = free_port(), f"test-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1"]
    launch += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", rdzv_id]
    logs.mkdir(parents=True, exist_ok=True)
    procs, files = [], []
    for i in range(2):
        files.append(open(logs / f"node{i}.txt", "w"))
        cmd = [*launch, "train.py", *args[i], f"output_root={roots[i]}"]
        procs.append(
            subprocess.Popen(cmd, cwd=cwds[i], env=env, stdout=files[i], stderr=subprocess.STDOUT, start_new_session=True)
        )
    deadline, killed = time.time() + timeout, False
    try:
        for p in procs:
            p.wait(timeout=max(1, deadline - time.time()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                killed = True
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for f in files:
            f.close()
    texts = [(logs / f"node{i}.txt").read_text() for i in range(2)]
    if killed:
        pytest.fail(f"the two nodes did not finish in {timeout} s (killed):\n" + "\n-----\n".join(t[-3000:] for t in texts))
    return [(p.returncode, t) for p, t in zip(procs, texts)]


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("Error:")]


def run_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.exists() else []


# ----------------------------------------------------------------------------- two nodes


def test_two_nodes_train_like_one_node_of_two_processes(tmp_path):
    single = cli([*FSDP, "world_size=2"], tmp_path / "single")
    assert single[0] == 0, single[1][-3000:]
    (one,) = run_dirs(tmp_path / "single")
    results = two_nodes([FSDP, FSDP], [tmp_path / "nodes"] * 2, tmp_path / "logs")
    for code, text in results:
        assert code == 0, text[-3000:]
    (run_dir,) = run_dirs(tmp_path / "nodes")
    assert_same_run(one, run_dir)
    assert (run_dir / checkpoints.FINISHED).read_text() == "64\n"  # n_examples
    assert sorted(p.name for p in (run_dir / "LATEST" / "sharded").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not list((tmp_path / "nodes").glob(".shared-*"))  # the marker of the output_root check is gone


def test_two_nodes_with_another_lr_stop_with_one_sentence_naming_lr(tmp_path):
    results = two_nodes([[*FSDP, "lr=0.0002"], [*FSDP, "lr=0.0001"]], [tmp_path / "out"] * 2, tmp_path / "logs", timeout=180)
    sentences = []
    for code, text in results:
        assert code != 0, text[-3000:]
        (line,) = error_lines(text)  # once per node
        sentences.append(line)
    assert sentences[0] == sentences[1]
    h = re.escape(HOST)
    match = re.fullmatch(
        rf"Error: Rank 1 \(host {h}\) was started with lr=(0\.0001|0\.0002), rank 0 \(host {h}\) with lr=(0\.0001|0\.0002); "
        r"start every node with the same command\.",
        sentences[0],
    )
    assert match and match.group(1) != match.group(2), sentences[0]
    assert not run_dirs(tmp_path / "out")  # before any run folder


def test_two_nodes_with_unshared_output_roots_stop_with_one_sentence(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"  # two nodes that do not see each other's output_root
    results = two_nodes([FSDP, FSDP], [a, b], tmp_path / "logs", timeout=180)
    sentences = []
    for code, text in results:
        assert code != 0, text[-3000:]
        (line,) = error_lines(text)
        sentences.append(line)
    assert sentences[0] == sentences[1]
    rank0_root = a if a.exists() else b  # torchrun's rendezvous decides which node is rank 0; only it makes the folder
    other = b if rank0_root == a else a
    assert sentences[0] == (
        f"Error: output_root={rank0_root} is not shared: rank 1 (host {HOST}, looking in output_root={other}) does not see "
        f"the file rank 0 (host {HOST}) wrote there; put output_root on a file system every node mounts at the same path."
    )
    assert list(rank0_root.iterdir()) == []  # the marker removed, no run folder
    assert not other.exists()


def test_a_node_with_other_code_stops_with_one_sentence_naming_the_file(tmp_path):
    checkout = tmp_path / "checkout"  # the same code, train.py changed by one comment line
    checkout.mkdir()
    for path in REPO.glob("*.py"):
        shutil.copy(path, checkout / path.name)
    for package in REPO.glob("*/__init__.py"):
        shutil.copytree(package.parent, checkout / package.parent.name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "config", checkout / "config")
    with open(checkout / "train.py", "a") as f:
        f.write("# changed\n")
    results = two_nodes([FSDP, FSDP], [tmp_path / "out"] * 2, tmp_path / "logs", cwds=(REPO, checkout), timeout=180)
    h = re.escape(HOST)
    for code, text in results:
        assert code != 0, text[-3000:]
        (line,) = error_lines(text)
        assert re.fullmatch(
            rf"Error: Rank 1 \(host {h}\) runs other code than rank 0 \(host {h}\): train\.py differs; "
            r"give every node the same checkout\.",
            line,
        ), line


def test_identity_mismatch_names_the_first_difference():
    def identity(config: dict, code: dict | None = None, host: str = "h1") -> dict:
        code = code or {"train.py": "a", "utils.py": "b"}
        return {
            "host": host,
            "config": config,
            "config_hash": digest(config),
            "code": code,
            "code_hash": digest(code),
        }

    same = {"lr": 0.0002, "datasets": ["hh", "shp"], "loss.beta": 0.1}
    assert nodes.identity_mismatch([identity(same), identity(dict(same), host="h2")]) is None
    other = {**same, "datasets": ["hh"], "loss.beta": 0.2}  # two keys differ: the first in rank 0's order is named
    assert nodes.identity_mismatch([identity(same), identity(same, host="h2"), identity(other, host="h3")]) == (
        "Rank 2 (host h3) was started with datasets=[hh], rank 0 (host h1) with datasets=[hh,shp]; "
        "start every node with the same command."
    )
    added = {**same, "loss.label_smoothing": None}
    assert nodes.identity_mismatch([identity(same), identity(added, host="h2")]) == (
        "Rank 1 (host h2) was started with loss.label_smoothing=null, rank 0 (host h1) without loss.label_smoothing; "
        "start every node with the same command."
    )
    code = {"train.py": "a", "utils.py": "c"}
    assert nodes.identity_mismatch([identity(same), identity(added, code, host="h2")]) == (
        "Rank 1 (host h2) runs other code than rank 0 (host h1): utils.py differs; give every node the same checkout."
    )
    moved = {**same, "resume": "/o/dpo_run_b"}
    assert nodes.identity_mismatch([identity({**same, "resume": "/o/dpo_run_a"}), identity(moved, host="h2")], True) == (
        "resume=auto found resume=/o/dpo_run_b on rank 1 (host h2) but resume=/o/dpo_run_a on rank 0 (host h1); "
        "every node must see the same output_root."
    )


def test_run_identity_covers_every_key_but_output_root(tmp_path):
    base = compose_config(["output_root=/a"])
    assert nodes.run_identity(compose_config(["output_root=/b"]))["config_hash"] == nodes.run_identity(base)["config_hash"]
    flat = flat_config(base)
    assert len(flat) > 100 and flat["loss.beta"] == 0.1 and flat["data.arithmetic.n_train"] == 4000
    for override in ("lr=0.001", "loss.beta=0.2", "data.arithmetic.n_train=7", "world_size=2", "num_threads=3", "datasets=[hh]"):
        assert (
            nodes.run_identity(compose_config(["output_root=/a", override]))["config_hash"]
            != nodes.run_identity(base)["config_hash"]
        ), override
    files = nodes.code_files()
    assert {"train.py", "trainers.py", "utils.py", "runs/checks.py", "config/config.yaml", "config/model/tiny.yaml"} <= set(files)
    assert not any(p.startswith("tests/") for p in files)


# ----------------------------------------------------------------------------- SIGUSR1, FINISHED, resume=auto


def stop_with(args: list[str], out: Path, after_lines: int, signum: int = signal.SIGUSR1) -> tuple[int, str]:
    """Start ``train.py args``, send ``signum`` once its metrics.jsonl has ``after_lines`` lines
    (training steps logged), and wait for it; kill its group on timeout."""
    proc = start_train(args, out)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and proc.poll() is None:
            runs = list(out.glob("*/metrics.jsonl"))
            if runs and sum(1 for _ in runs[0].open()) >= after_lines:
                break
            time.sleep(0.05)
        proc.send_signal(signum)
        text, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return proc.returncode, text


LONG = [
    "batch_size=8",
    "eval_batch_size=8",
    "n_eval_examples=8",
    "data.arithmetic.n_test=8",
    "sample_during_eval=false",
    "save_hf_export=false",
    "progress_bar=false",
    "minimum_log_interval_secs=0",
    "lr_scheduler=linear",
    "keep_checkpoints=0",
    "sft_first.n_examples=null",  # one run, not model=tiny's two stages
]
SIGUSR1_RUNS = {
    "basic": [*LONG, "n_examples=800", "eval_every=400", "data.arithmetic.n_train=200"],  # 100 steps, SIGUSR1 after ~5
    "fsdp": [*LONG, "n_examples=400", "eval_every=200", "data.arithmetic.n_train=200", "trainer=FSDPTrainer", "world_size=2"],
}


@pytest.mark.parametrize("trainer", list(SIGUSR1_RUNS))
def test_sigusr1_checkpoints_exits_138_and_resume_auto_finishes_the_same_run(tmp_path, trainer):
    args = SIGUSR1_RUNS[trainer]
    n = int(next(a for a in args if a.startswith("n_examples="))[len("n_examples=") :])
    code, text = cli(args, tmp_path / "full")
    assert code == 0, text[-3000:]
    (full,) = run_dirs(tmp_path / "full")

    cut_root = tmp_path / "cut"
    code, text = stop_with([*args, "resume=auto"], cut_root, after_lines=6)
    assert code == 128 + signal.SIGUSR1 == 138, text[-3000:]
    assert text.count(f"resume=auto: no unfinished run of exp_name=dpo_run in {cut_root}; starting a fresh run.") == 1
    assert "Received SIGUSR1" in text and text.count("Interrupted after") == 1 and "Traceback" not in text
    (cut,) = run_dirs(cut_root)
    assert not (cut / checkpoints.FINISHED).exists()
    stopped_at = torch.load(cut / "LATEST" / "trainer_state.pt", weights_only=False)["example_counter"]
    assert 0 < stopped_at < n
    if trainer == "fsdp":
        assert len(list((cut / "LATEST" / "sharded").glob("*.distcp"))) == 2
        leftover = subprocess.run(["pgrep", "-f", f"output_root={cut_root}"], capture_output=True, text=True).stdout
        assert not leftover.strip(), "worker processes outlived train.py"

    continuing = f"resume=auto: continuing {cut}, the newest unfinished run of exp_name=dpo_run."
    if trainer == "basic":
        # The same command again continues that run; a SIGTERM (143: a scheduler sees it did not finish) stops it
        # a second time, after a few more steps, and resume=<run> continues it to the end.
        lines = sum(1 for _ in (cut / "metrics.jsonl").open())
        code, text = stop_with([*args, "resume=auto"], cut_root, after_lines=lines + 6, signum=signal.SIGTERM)
        assert code == 128 + signal.SIGTERM == 143, text[-3000:]
        assert text.count(continuing) == 1 and f"Resuming after {stopped_at} examples" in text
        assert "Interrupted after" in text and "Resume with: python train.py resume=" in text and "Traceback" not in text
        stopped_again = torch.load(cut / "LATEST" / "trainer_state.pt", weights_only=False)["example_counter"]
        assert stopped_at < stopped_again < n
        code, text = cli([f"resume={cut}"], tmp_path / "unused")
        assert code == 0, text[-3000:]
        assert f"Resuming after {stopped_again} examples" in text
    else:
        code, text = cli([*args, "resume=auto"], cut_root)  # the same command again: continues that run
        assert code == 0, text[-3000:]
        assert text.count(continuing) == 1
        assert "ignoring" not in text and "Error" not in text  # the same command: the run's own config
        assert f"Resuming after {stopped_at} examples" in text
    assert (cut / checkpoints.FINISHED).read_text() == f"{n}\n"
    a, b = weights(full), weights(cut)
    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6, msg=name)
    if trainer == "basic":
        policy_full, policy_cut = (torch.load(r / "LATEST" / "policy.pt", weights_only=False) for r in (full, cut))
        assert policy_full["step_idx"] == policy_cut["step_idx"] == n
        optim_full, optim_cut = (torch.load(r / "LATEST" / "optimizer.pt", weights_only=False)["state"] for r in (full, cut))
        assert optim_full["state"].keys() == optim_cut["state"].keys()

    # Once finished, resume=auto starts a fresh run, and its overrides apply (n_examples=16).
    code, text = cli([*args, "resume=auto", "n_examples=16"], cut_root)
    assert code == 0, text[-3000:]
    assert "starting a fresh run" in text
    fresh = [d for d in run_dirs(cut_root) if d != cut]
    assert len(fresh) == 1 and (fresh[0] / checkpoints.FINISHED).read_text() == "16\n"


def make_run(root: Path, name: str, *, latest: bool = True, finished: bool = False, lr: float = 0.123) -> Path:
    """A run folder ``root/name`` with a config.yaml (``lr``), and a LATEST checkpoint link / a
    FINISHED marker when asked."""
    run_dir = root / name
    (run_dir / "step-8").mkdir(parents=True)
    OmegaConf.save(compose_config([*TINY, f"output_root={root}", f"lr={lr}"]), run_dir / "config.yaml")
    if latest:
        (run_dir / "LATEST").symlink_to("step-8")
    if finished:
        (run_dir / checkpoints.FINISHED).write_text("8\n")
    return run_dir


def auto(root: Path, *extra: str):
    return setup.effective_config(compose_config([*TINY, f"output_root={root}", "resume=auto", "lr=0.5", *extra]))


def test_resume_auto_picks_the_newest_unfinished_run_with_a_checkpoint(tmp_path, capsys):
    make_run(tmp_path, "dpo_run_2025-01-01_00-00-00_000000", lr=0.5)
    newest_unfinished = make_run(tmp_path, "dpo_run_2025-01-02_00-00-00_000000", lr=0.5)
    make_run(tmp_path, "dpo_run_2025-01-03_00-00-00_000000", finished=True, lr=0.5)
    make_run(tmp_path, "dpo_run_2025-01-04_00-00-00_000000", latest=False, lr=0.5)  # stopped before its first checkpoint
    make_run(tmp_path, "dpo_run_v2_2025-01-05_00-00-00_000000", lr=0.5)  # exp_name=dpo_run_v2
    make_run(tmp_path, "sft_run_2025-01-06_00-00-00_000000", lr=0.5)
    (tmp_path / "dpo_run_2025-01-07_00-00-00_000000").write_text("a file, not a run folder")
    old = time.time() - 3600  # the name's timestamp decides, not the folder's age on disk
    os.utime(newest_unfinished, (old, old))
    config = auto(tmp_path)
    assert config.resume == str(newest_unfinished)
    assert (
        f"resume=auto: continuing {newest_unfinished}, the newest unfinished run of exp_name=dpo_run." in capsys.readouterr().out
    )
    v2 = make_run(tmp_path, "dpo_run_v2_2025-01-08_00-00-00_000000", lr=0.5)
    OmegaConf.save(OmegaConf.merge(OmegaConf.load(v2 / "config.yaml"), {"exp_name": "dpo_run_v2"}), v2 / "config.yaml")
    assert auto(tmp_path, "exp_name=dpo_run_v2").resume == str(v2)


def test_resume_auto_starts_fresh_when_no_run_is_unfinished(tmp_path, capsys):
    make_run(tmp_path, "dpo_run_2025-01-03_00-00-00_000000", finished=True)
    make_run(tmp_path, "dpo_run_2025-01-04_00-00-00_000000", latest=False)
    make_run(tmp_path, "dpo_run_v2_2025-01-05_00-00-00_000000")
    for root in (tmp_path, tmp_path / "absent"):
        config = auto(root)
        assert config.resume is None and config.lr == 0.5  # fresh: the command line's config
        assert f"resume=auto: no unfinished run of exp_name=dpo_run in {root}; starting a fresh run." in capsys.readouterr().out


def test_resume_auto_of_a_folder_a_live_run_holds_is_the_lock_sentence(tmp_path):
    held = make_run(tmp_path, "dpo_run_2025-01-02_00-00-00_000000")
    with checkpoints.lock_run_dir(str(held)):
        with pytest.raises(utils.ConfigError, match=rf"^The run folder {re.escape(str(held))} is in use by a live run \(pid"):
            train.main(compose_config([*TINY, f"output_root={tmp_path}", "resume=auto", "lr=0.123"]))  # make_run's config


def test_finished_is_written_at_the_end_and_for_a_complete_run_without_one(tmp_path):
    run_dir = run_train(["n_examples=8", "eval_every=8", "sample_during_eval=false", "save_hf_export=false"], tmp_path)
    assert (run_dir / checkpoints.FINISHED).read_text() == "8\n"
    (run_dir / checkpoints.FINISHED).unlink()  # a run finished before FINISHED existed
    before = (run_dir / "metrics.jsonl").read_text()
    _, stop_signal = train.main(compose_config([f"resume={run_dir}"]))
    assert stop_signal is None and (run_dir / checkpoints.FINISHED).read_text() == "8\n"
    assert (run_dir / "metrics.jsonl").read_text() == before
    assert checkpoints.resumable_runs(str(tmp_path), "dpo_run") == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_repeated_scheduler_signal_keeps_the_checkpoint_under_way_and_a_second_ctrl_c_stops_at_once(signum):
    # regression: scancel signals every process of a SLURM step and torchrun forwards SIGTERM
    # again, so a rank gets it twice; the second one raised KeyboardInterrupt, losing the checkpoint.
    from runs import ending

    trainer = types.SimpleNamespace(stop_requested=False, stop_signal=None)
    ending.request_stop(trainer, signum, None)
    assert trainer.stop_requested and trainer.stop_signal == signum
    try:
        ending.request_stop(trainer, signum, None)  # ignored: the stop with a checkpoint goes on
    except KeyboardInterrupt:
        pytest.fail(f"a repeated {signal.Signals(signum).name} stopped the rank at once, without its checkpoint")
    assert trainer.stop_signal == signum
    with pytest.raises(KeyboardInterrupt):
        ending.request_stop(trainer, signal.SIGINT, None)  # a person pressing Ctrl-C again
