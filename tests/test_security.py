"""Issue 22's security cases: no file a user can be handed runs code when loaded (checkpoints,
``model.archive``, evaluate.py's ``policy=``, the reference cache, FSDP's ``sharded/``), the HTTP
judge follows no redirect and keeps to its timeout, checkpoint folders respect the umask."""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, TINY, compose_config, copy_run
from test_checkpoint_faults import cli, one_error_line
from test_online import LocalChatServer

import train
import utils
from evaluation import rewards, transport
from modeling import models
from runs import checkpoints, checks, resume, setup
from runs.files import open_append

QUICK = ["sample_during_eval=false", "save_hf_export=false", "num_threads=1"]


class Planted:
    """Pickles as a call of ``exec`` that creates the file ``marker``: what a crafted checkpoint holds."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def plant(path: Path, marker: Path, contents: dict | None = None) -> None:
    """Overwrite the torch.save file ``path`` with ``contents`` (default: its own) plus a :class:`Planted`."""
    contents = dict(torch.load(path, weights_only=True) if contents is None else contents)
    contents["x"] = Planted(marker)
    path.unlink()
    torch.save(contents, path)
    restamp(path)


def restamp(path: Path) -> None:
    """Record checkpoint file ``path`` anew in its folder's manifest (if it is in one), as a whole crafted folder would."""
    folder = next((p for p in path.parents if (p / checkpoints.CHECKPOINT_MANIFEST).exists()), None)
    if folder is not None:
        checkpoints.record_in_manifest(str(folder), [str(path.relative_to(folder))])


def test_planted_object_runs_code_when_unpickled_unsafely(tmp_path):
    # The test's own premise: a plain torch.load of a planted file creates the marker.
    marker = tmp_path / "marker"
    torch.save({"x": Planted(marker)}, tmp_path / "f.pt")
    torch.load(tmp_path / "f.pt", weights_only=False)
    assert marker.exists()


@pytest.fixture(scope="module")
def finished(zoo) -> Path:
    """A finished tiny DPO run with checkpoints at 24 and 48 examples (QUICK, keep_checkpoints=0: the zoo's no_export run)."""
    return zoo("no_export")


def checkpoint_of(run: Path, tmp_path: Path, step: int = 24) -> Path:
    """A copy of ``run`` whose LATEST is ``step-<step>``, unfinished; returns the copy."""
    copy = tmp_path / run.name
    shutil.copytree(run, copy, symlinks=True)
    (copy / "LATEST").unlink()
    (copy / "LATEST").symlink_to(f"step-{step}")
    (copy / "FINISHED").unlink(missing_ok=True)
    return copy


# ----------------------------------------------------------------------------- files that run code


def test_a_planted_model_archive_runs_nothing_and_is_one_sentence(finished, tmp_path):
    archive = tmp_path / "policy.pt"
    shutil.copy(finished / "LATEST" / "policy.pt", archive)
    marker = tmp_path / "marker"
    plant(archive, marker)
    done = cli([*TINY, *QUICK, f"model.archive={archive}"], tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert one_error_line(done) == (
        f"Error: model.archive={archive} holds more than tensors and plain values (e.g. exec), and is not "
        "loaded because unpickling it could run code; give the policy.pt of an earlier run."
    )
    assert not marker.exists()
    with pytest.raises(utils.ConfigError, match=r"\(e\.g\. exec\)"):  # the reference's own read (models.load_reference)
        models.load_reference(
            compose_config([*TINY, f"model.archive={archive}"]), models.load_tokenizer(compose_config(TINY).model)
        )
    assert not marker.exists()


@pytest.mark.parametrize("name", ["policy.pt", "optimizer.pt", "scheduler.pt", "trainer_state.pt"])
def test_resume_from_a_planted_checkpoint_file_runs_nothing_and_is_one_sentence(finished, tmp_path, name):
    run = checkpoint_of(finished, tmp_path)
    marker = tmp_path / "marker"
    plant(run / "step-24" / name, marker)
    done = cli([f"resume={run}"], tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert one_error_line(done) == (
        f"Error: The checkpoint file {run / 'step-24' / name} holds more than tensors and plain values (e.g. "
        "exec), and is not loaded because unpickling it could run code; resume only from checkpoints "
        "written by this repository's train.py."
    )
    assert not marker.exists()


def test_evaluate_of_a_planted_policy_runs_nothing_and_is_one_sentence(finished, tmp_path):
    run = checkpoint_of(finished, tmp_path)
    weights = run / "step-24" / "policy.pt"
    marker = tmp_path / "marker"
    plant(weights, marker)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [f"policy={weights}", "datasets=[arithmetic]", "data.arithmetic.n_test=4", "n_prompts=2", "progress_bar=false"]
    args += ["judge=http_judge", "judge.base_url=http://127.0.0.1:9/v1", "judge.model=m"]  # never reached
    done = subprocess.run([sys.executable, "evaluate.py", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert errors == [
        f"Error: The weights file {weights} holds more than tensors and plain values (e.g. exec), and is not "
        "loaded because unpickling it could run code; give a checkpoint written by train.py."
    ], done.stderr[-3000:]
    assert not marker.exists()


def test_a_planted_reference_cache_in_cache_dir_runs_nothing_and_is_one_sentence(tmp_path, capsys):
    cache_dir = tmp_path / "cache"
    args = [*TINY, *QUICK, "precompute_ref_log_probs=true", f"cache_dir={cache_dir}", "n_examples=8"]
    train.main(compose_config([*args, f"output_root={tmp_path / 'first'}"]))
    (path,) = cache_dir.glob("reference_logps-*.pt")  # the name a second run of the same inputs looks for
    cache = torch.load(path, weights_only=True)
    assert len(cache) == 64 + 16 and all(isinstance(v, tuple) and len(v) == 2 for v in cache.values())
    marker = tmp_path / "marker"
    plant(path, marker)
    done = cli(args, tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert one_error_line(done) == (
        f"Error: The reference log-prob cache {path} holds more than tensors and plain values (e.g. exec), "
        "and is not loaded because unpickling it could run code; delete that file (this run then computes the "
        "log-probs again) and check who else can write to cache_dir."
    )
    assert not marker.exists()


def test_a_file_that_is_no_checkpoint_at_all_could_not_be_read(tmp_path):
    (tmp_path / "policy.pt").write_text("not a checkpoint")
    with pytest.raises(utils.ConfigError) as got:
        resume.read_checkpoint_file(str(tmp_path), "policy.pt")
    assert str(got.value) == (
        f"The checkpoint file {tmp_path / 'policy.pt'} could not be read (UnpicklingError); resume only from "
        "checkpoints written by this repository's train.py."
    )


# ----------------------------------------------------------------------------- NumPy's RNG state


def test_numpy_rng_state_is_saved_as_plain_values_and_restored_exactly(tmp_path):
    np.random.seed(7)
    np.random.standard_normal()  # a cached second gaussian: has_gauss=1
    torch.save({"numpy": resume.numpy_rng_state()}, tmp_path / "s.pt")
    after = np.random.standard_normal(3), np.random.random(3)
    assert torch.serialization.get_unsafe_globals_in_checkpoint(str(tmp_path / "s.pt")) == []
    resume.set_numpy_rng_state(torch.load(tmp_path / "s.pt", weights_only=True)["numpy"])
    again = np.random.standard_normal(3), np.random.random(3)
    assert all(np.array_equal(a, b) for a, b in zip(after, again))


def test_an_earlier_versions_trainer_state_with_a_numpy_array_still_loads_and_restores(tmp_path):
    np.random.seed(11)
    np.random.standard_normal()
    torch.save({"rng": {"numpy": np.random.get_state()}}, tmp_path / "trainer_state.pt")  # the old format
    expected = np.random.random(4)
    np.random.seed(0)
    state = resume.read_checkpoint_file(str(tmp_path), "trainer_state.pt")
    resume.set_numpy_rng_state(state["rng"]["numpy"])
    assert np.array_equal(np.random.random(4), expected)
    os.replace(tmp_path / "trainer_state.pt", tmp_path / "policy.pt")  # only trainer_state.pt may hold the array
    with pytest.raises(utils.ConfigError, match=r"\(e\.g\. numpy\._core\.multiarray\._reconstruct\)|\(e\.g\. numpy\.core"):
        resume.read_checkpoint_file(str(tmp_path), "policy.pt")


def test_resume_from_an_earlier_versions_checkpoint_is_bit_exact(finished, tmp_path):
    run = checkpoint_of(finished, tmp_path)
    path = run / "step-24" / "trainer_state.pt"
    state = torch.load(path, weights_only=True)
    new = state["rng"]["numpy"]
    key = new["state"]["key"].numpy().astype(np.uint32)
    state["rng"]["numpy"] = ("MT19937", key, new["state"]["pos"], new["has_gauss"], new["gauss"])  # as np.random.get_state()
    torch.save(state, path)
    restamp(path)
    assert "numpy.ndarray" in torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    train.main(compose_config([f"resume={run}"]))
    a = torch.load(finished / "step-48" / "policy.pt", weights_only=True)["state"]
    b = torch.load(run / "step-48" / "policy.pt", weights_only=True)["state"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- FSDP's sharded/ (DCP)


def dcp_save(state: dict, folder: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(folder))


def test_a_sharded_checkpoint_reads_back_tensors_and_plain_values(tmp_path):
    saved = {"w": torch.arange(6.0).reshape(2, 3), "groups": {"lr": 0.5, "betas": (0.9, 0.99), "name": "a", "n": None}}
    dcp_save(saved, tmp_path / "sharded")
    state = {"w": torch.zeros(2, 3), "groups": {"lr": 0.0, "betas": None, "name": None, "n": 1}}
    resume.read_sharded_checkpoint(state, str(tmp_path / "sharded"))
    assert torch.equal(state["w"], saved["w"]) and state["groups"] == {"lr": 0.5, "betas": (0.9, 0.99), "name": "a", "n": None}


def test_a_planted_sharded_metadata_runs_nothing_and_is_one_sentence(tmp_path):
    import pickle

    dcp_save({"w": torch.ones(2)}, tmp_path / "sharded")
    marker = tmp_path / "marker"
    (tmp_path / "sharded" / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    with pytest.raises(utils.ConfigError) as got:
        resume.read_sharded_checkpoint({"w": torch.zeros(2)}, str(tmp_path / "sharded"))
    assert str(got.value) == (
        f"The sharded checkpoint {tmp_path / 'sharded'} holds more than tensors and plain values (e.g. builtins.exec), "
        "and is not loaded because unpickling it could run code; resume only from checkpoints written by this "
        "repository's train.py."
    )
    assert not marker.exists()


def test_a_planted_sharded_entry_runs_nothing_and_is_one_sentence(tmp_path):
    marker = tmp_path / "marker"
    dcp_save({"w": torch.ones(2), "extra": Planted(marker)}, tmp_path / "sharded")  # a non-tensor entry: torch.save'd bytes
    assert not marker.exists()
    with pytest.raises(utils.ConfigError, match=r"holds more than tensors and plain values \(e\.g\. the entry extra\)"):
        resume.read_sharded_checkpoint({"w": torch.zeros(2), "extra": 0}, str(tmp_path / "sharded"))
    assert not marker.exists()


def test_fsdp_resume_from_a_planted_sharded_metadata_is_one_sentence_on_both_ranks(zoo, tmp_path):
    import pickle

    run = copy_run(zoo("fsdp"), tmp_path / "first")  # FSDP, save_hf_export=false: sharded checkpoints at 8 and 16
    (run / "FINISHED").unlink(missing_ok=True)
    sharded = (run / "LATEST" / "sharded").resolve()
    marker = tmp_path / "marker"
    (sharded / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    restamp(sharded / ".metadata")
    done = cli([f"resume={run}"], tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert one_error_line(done) == (
        f"Error: The sharded checkpoint {sharded} holds more than tensors and plain values "
        "(e.g. builtins.exec), and is not loaded because unpickling it could run code; resume only from checkpoints "
        "written by this repository's train.py."
    )
    assert not marker.exists()


# ----------------------------------------------------------------------------- the HTTP judge


class CountingServer(LocalChatServer):
    """Answers "0" to every POST or GET, counting them and those that carry an Authorization header."""

    def __init__(self):
        self.with_key = self.hits = 0
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):  # also GET: urllib turned a POST redirected by 301/302 into a GET
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                server.hits += 1
                server.with_key += "Authorization" in self.headers
                data = json.dumps({"choices": [{"message": {"role": "assistant", "content": "0"}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST

        self.serve(Handler)


class RedirectServer(LocalChatServer):
    """Answers every request with ``code`` and ``Location: <target>``."""

    def __init__(self, target: str, code: int = 302):
        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.send_response(code)
                self.send_header("Location", target)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.serve(Handler)


@pytest.mark.parametrize("code", [301, 302, 307, 308])
def test_the_http_judge_follows_no_redirect_and_sends_its_key_nowhere_else(monkeypatch, code):
    monkeypatch.setenv("TEST_JUDGE_KEY", "secret")
    other = CountingServer()
    redirect = RedirectServer(f"{other.url}/chat/completions", code)
    try:
        judge = rewards.HTTPJudge(redirect.url, "m", api_key_env="TEST_JUDGE_KEY", max_retries=2, backoff=0.0, timeout=5)
        assert judge.judge(["p"] * 4, [("a", "b")] * 4) == [None] * 4
    finally:
        redirect.close()
        other.close()
    assert other.hits == other.with_key == 0
    assert judge.last_errors[0] == (
        f"HTTP {code} from {redirect.url}/chat/completions, a redirect to {other.url}/chat/completions that is not "
        "followed (give judge.base_url the address it names if you trust it) (after 1 attempts)"
    )


class TricklingServer(LocalChatServer):
    """Sends a valid answer one byte every 0.5 s (no single read waits long)."""

    def __init__(self):
        self.done = threading.Event()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                data = json.dumps({"choices": [{"message": {"role": "assistant", "content": "0"}}]}).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    for i in range(len(data)):
                        if server.done.wait(0.5):
                            return
                        self.wfile.write(data[i : i + 1])
                        self.wfile.flush()
                except OSError:  # the client left
                    pass

        self.serve(Handler)

    def close(self):
        self.done.set()
        super().close()


def test_the_judge_timeout_bounds_the_whole_request_of_a_trickling_server():
    server = TricklingServer()
    try:
        judge = rewards.HTTPJudge(server.url, "m", max_retries=0, backoff=0.0, timeout=2)
        start = time.monotonic()
        assert judge.judge(["p"], [("a", "b")]) == [None]
        took = time.monotonic() - start
    finally:
        server.close()
    assert took < 3.0, took  # about 30 bytes at 2 per second: 15 s if each read had its own 2 s
    assert judge.last_errors[0] == (
        f"TimeoutError from {server.url}/chat/completions: timed out: no whole response within judge.timeout=2 s "
        "(after 1 attempts)"
    )


def test_post_returns_the_body_well_within_the_deadline():
    server = CountingServer()
    try:
        start = time.monotonic()
        body = transport.post(f"{server.url}/chat/completions", b"{}", {"Content-Type": "application/json"}, timeout=1.0)
        assert json.loads(body)["choices"][0]["message"]["content"] == "0"
        time.sleep(1.2)  # the deadline passes after the request ended: nothing happens
    finally:
        server.close()
    assert server.hits == 1 and time.monotonic() - start < 5


# ----------------------------------------------------------------------------- the umask


@pytest.mark.parametrize("umask", [0o077, 0o022])
def test_checkpoint_folders_get_the_mode_mkdir_gives_under_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        path = checkpoints.save_checkpoint_dir(str(tmp_path), "step-8", lambda tmp: Path(tmp, "f.pt").write_bytes(b"x"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o777 & ~umask  # 0o700 and 0o755
    assert stat.S_IMODE(os.stat(Path(path, "f.pt")).st_mode) == 0o666 & ~umask


# ----------------------------------------------------------------------------- files never written through a link


def test_write_atomic_replaces_a_link_and_leaves_its_target(tmp_path):
    target, link = tmp_path / "users_file", tmp_path / "config.yaml"
    target.write_text("a user's file\n")
    link.symlink_to(target)
    (tmp_path / f"config.yaml.tmp-{os.getpid()}").symlink_to(target)  # a link planted at the temporary name too
    utils.write_atomic(str(link), "new\n")
    assert not link.is_symlink() and link.read_text() == "new\n"
    assert target.read_text() == "a user's file\n"


def test_appending_to_a_link_is_refused_and_leaves_its_target(tmp_path):
    target, link = tmp_path / "users_file", tmp_path / "metrics.jsonl"
    target.write_text("a user's file\n")
    link.symlink_to(target)
    with pytest.raises(utils.ConfigError) as e:
        open_append(str(link))
    assert str(e.value) == (
        f"{link} is a symbolic link (to {target}), and files are never written through one: remove it, or put a copy "
        "of the file it points at in its place, then try again."
    )
    assert target.read_text() == "a user's file\n"
    with open_append(str(tmp_path / "plain")) as f:  # a plain file is appended to
        f.write("a\n")
    with open_append(str(tmp_path / "plain")) as f:
        f.write("b\n")
    assert (tmp_path / "plain").read_text() == "a\nb\n"


def test_a_link_anywhere_a_run_writes_is_refused_before_anything_is_written(finished, tmp_path):
    # Regression (issue 34): resume wrote through links in the run folder, truncating their targets.
    run = checkpoint_of(finished, tmp_path)
    written = sorted(
        str(p.relative_to(run)) for p in [*run.iterdir(), *(run / "curves").iterdir()] if p.is_file() and not p.is_symlink()
    )
    assert {".lock", "config.yaml", "metrics.jsonl", "curves/loss.png"} <= set(written), written
    target = tmp_path / "users_file"
    for name in [*written, "extensions.log", "curves"]:  # extensions.log: what an extension appends to
        copy = tmp_path / "copy"
        shutil.copytree(run, copy, symlinks=True)
        target.write_text("a user's file\n")
        if (copy / name).is_dir():
            shutil.rmtree(copy / name)
        (copy / name).unlink(missing_ok=True)
        (copy / name).symlink_to(target)
        with pytest.raises(utils.ConfigError) as e:
            checkpoints.lock_run_dir(str(copy))
        assert str(e.value) == (
            f"The folder {copy} holds a symbolic link where it writes its own files, {name} (to {target}), and files "
            "are never written through a link: remove each (or put a copy of the file it points at in its place), "
            "then try again."
        ), name
        assert target.read_text() == "a user's file\n", name
        shutil.rmtree(copy)
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(target)
    done = cli([f"resume={run}", "n_examples=72"], tmp_path)  # resumed and extended through the command line
    assert done.returncode == 2, done.stderr[-3000:]
    assert one_error_line(done).startswith(f"Error: The folder {run} holds a symbolic link where it writes")
    assert target.read_text() == "a user's file\n"
    assert os.readlink(run / "LATEST") == "step-24"  # nothing trained


def test_plots_replace_a_link_and_a_linked_curves_folder_is_refused(finished, tmp_path):
    from runs import tracking

    run = checkpoint_of(finished, tmp_path)
    target = tmp_path / "users_file"
    target.write_text("a user's file\n")
    (run / "curves" / "loss.png").unlink()
    (run / "curves" / "loss.png").symlink_to(target)
    tracking.plot_curves(str(run))
    assert not (run / "curves" / "loss.png").is_symlink() and target.read_text() == "a user's file\n"
    shutil.rmtree(run / "curves")
    (run / "curves").symlink_to(tmp_path)
    with pytest.raises(utils.ConfigError, match=r"curves is a symbolic link .* never written through one"):
        tracking.plot_curves(str(run))


# ----------------------------------------------------------------------------- a handed run folder's config (issue 34)


def handed_copy(finished: Path, tmp_path: Path, **values) -> Path:
    """An unfinished copy of ``finished`` whose config.yaml sets ``values`` (dotted keys, ``__`` for ``.``)."""
    from omegaconf import OmegaConf

    run = checkpoint_of(finished, tmp_path)
    saved = OmegaConf.load(run / "config.yaml")
    for key, value in values.items():
        OmegaConf.update(saved, key.replace("__", "."), value)
    OmegaConf.save(saved, run / "config.yaml")
    return run


def test_a_handed_run_folder_imports_nothing_and_sends_no_key_unless_the_command_gives_them(finished, tmp_path, monkeypatch):
    # The folder's config.yaml names a module beside it (importable: the current directory is on sys.path), a URL
    # and an environment variable to send there; resume stops before anything is imported, loaded or sent.
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "marker"
    (tmp_path / "handed_helper.py").write_text(
        f"open({str(marker)!r}, 'w').close()\ndef f(prompts, completions):\n    return [0.0] * len(prompts)\n"
    )
    handed = {
        "eval_reward_functions": ["handed_helper:f"],
        "judge__base_url": "http://127.0.0.1:9/v1",
        "judge__api_key_env": "AWS_SECRET_ACCESS_KEY",
    }
    run = handed_copy(finished, tmp_path, **handed)
    with pytest.raises(utils.ConfigError) as e:
        train.main(compose_config([f"resume={run}"]))
    assert str(e.value) == (
        f"resume={run}: its config.yaml names code, a secret or an address to send to (eval_reward_functions=[handed_helper:f], "
        "judge.base_url=http://127.0.0.1:9/v1, judge.api_key_env=AWS_SECRET_ACCESS_KEY), which a folder alone never decides, "
        "since it may have been handed to you; if you trust them, give them on the command line too: python train.py "
        f"resume={run} 'eval_reward_functions=[handed_helper:f]' judge.base_url=http://127.0.0.1:9/v1 "
        "judge.api_key_env=AWS_SECRET_ACCESS_KEY"
    )
    assert not marker.exists()
    given = [
        "eval_reward_functions=[handed_helper:f]",
        "judge.base_url=http://127.0.0.1:9/v1",
        "judge.api_key_env=AWS_SECRET_ACCESS_KEY",
    ]
    config = setup.effective_config(compose_config([f"resume={run}", *given]))  # given again: taken
    assert list(config.eval_reward_functions) == ["handed_helper:f"] and config.judge.api_key_env == "AWS_SECRET_ACCESS_KEY"


def test_a_run_folders_registered_reward_functions_and_default_keys_are_taken_without_being_given(finished, tmp_path):
    run = handed_copy(finished, tmp_path, eval_reward_functions=["arithmetic", "length"], reward_functions=["length"])
    config = setup.effective_config(compose_config([f"resume={run}"]))
    assert list(config.eval_reward_functions) == ["arithmetic", "length"] and list(config.reward_functions) == ["length"]
    assert config.judge.api_key_env == "OPENAI_API_KEY"  # the saved default: what this command gives too


def test_a_handed_evaluation_folder_sends_nothing_unless_the_command_gives_its_judge(tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from evaluation import evaluate

    folder = tmp_path / "eval"
    folder.mkdir()
    judge = {"name": "reward_function", "base_url": "http://127.0.0.1:9/v1", "model": "m"}
    OmegaConf.save(
        OmegaConf.create({"policy": "x", "judge": judge, "reward_functions": ["length", "mine:f"]}), folder / "config.yaml"
    )

    def composed(extra):
        with initialize_config_dir(config_dir=str(REPO / "config"), version_base="1.3"):
            return compose(config_name="evaluate", overrides=[f"resume={folder}", *extra])

    with pytest.raises(utils.ConfigError) as e:
        evaluate.effective_config(composed([]))
    assert str(e.value) == (
        f"resume={folder}: its config.yaml names code, a secret or an address to send to (reward_functions=[length,mine:f], "
        "judge.base_url=http://127.0.0.1:9/v1), which a folder alone never decides, since it may have been handed to you; "
        f"if you trust them, give them on the command line too: python evaluate.py resume={folder} "
        "'reward_functions=[length,mine:f]' judge.base_url=http://127.0.0.1:9/v1"
    )
    config = evaluate.effective_config(composed(["reward_functions=[length,mine:f]", "judge.base_url=http://127.0.0.1:9/v1"]))
    assert config.judge.base_url == "http://127.0.0.1:9/v1" and config.output_dir == str(folder)


# ----------------------------------------------------------------------------- model folders: no custom code, no pickles (issue 34)


def tiny_model_folder(path: Path, auto_map: dict | None = None) -> Path:
    """A 1-layer Llama's config.json in ``path`` (with ``auto_map`` naming custom code when given)."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    config.save_pretrained(path)
    if auto_map is not None:
        fields = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**fields, "auto_map": auto_map}))
    return path


def test_a_model_folder_naming_custom_code_is_one_sentence_before_anything_loads(tmp_path):
    from omegaconf import OmegaConf

    folder = tiny_model_folder(tmp_path / "remote", {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    sentence = (
        f"model.name_or_path={folder} names custom code (config.json's auto_map: modeling_evil.EvilForCausalLM), which this "
        "project never runs; give a folder that transformers' own classes load (no auto_map), e.g. one saved by "
        "save_pretrained of a built-in model."
    )
    assert models.custom_code_problem(str(folder)) == sentence
    assert models.custom_code_problem(str(tiny_model_folder(tmp_path / "plain"))) is None
    with pytest.raises(utils.ConfigError) as e:  # a RULES row: before data or models load
        checks.validate_config(compose_config(["model=blank_model", f"model.name_or_path={folder}"]))
    assert str(e.value) == sentence
    with pytest.raises(utils.ConfigError) as e:  # evaluate.py's and make_pairs.py's loads too
        models.load_model(OmegaConf.create({"name_or_path": str(folder), "config": None}), None, None, 0)
    assert str(e.value) == sentence


def test_a_pickled_pytorch_model_bin_runs_nothing_and_is_one_sentence(tmp_path):
    from omegaconf import OmegaConf

    folder = tiny_model_folder(tmp_path / "pickled")
    marker = tmp_path / "marker"
    torch.save({"x": Planted(marker)}, folder / "pytorch_model.bin")  # no model.safetensors: transformers unpickles this
    with pytest.raises(utils.ConfigError) as e:
        models.load_model(OmegaConf.create({"name_or_path": str(folder), "config": None}), None, None, 0)
    assert str(e.value) == (
        f"model.name_or_path={folder} holds a pickled weights file with more than tensors (e.g. exec), and it is "
        "not loaded because unpickling it could run code; give the model as safetensors (model.safetensors, from "
        "save_pretrained) from a source you trust."
    )
    assert not marker.exists()


def recording_from_pretrained(asked: list, name: str):
    """A stand-in ``from_pretrained`` of class ``name`` that appends (name, its trust_remote_code) to ``asked`` and stops."""

    def from_pretrained(path, **kwargs):
        asked.append((name, kwargs.get("trust_remote_code", "not passed")))
        raise OSError("stopped here")

    return from_pretrained


def test_every_load_from_a_folder_or_hub_id_refuses_remote_code(tmp_path, monkeypatch):
    import transformers
    from omegaconf import OmegaConf

    asked = []
    record = functools.partial(recording_from_pretrained, asked)
    for cls in ("AutoTokenizer", "AutoConfig", "AutoModelForCausalLM"):
        monkeypatch.setattr(getattr(transformers, cls), "from_pretrained", record(cls))
    model = OmegaConf.create({"name_or_path": "org/name", "config": None, "tokenizer_name_or_path": None})
    for load in (models.load_tokenizer, models.transformers_config, lambda m: models.load_model(m, None, None, 0)):
        with contextlib.suppress(utils.ConfigError, OSError):
            load(model)
    assert asked == [("AutoTokenizer", False), ("AutoConfig", False), ("AutoModelForCausalLM", False)]


def test_a_reward_model_folder_naming_custom_code_is_one_sentence_and_no_load_trusts_remote_code(tmp_path, monkeypatch):
    import transformers

    from evaluation import rewards

    folder = tiny_model_folder(tmp_path / "rm", {"AutoModelForSequenceClassification": "modeling_evil.EvilRM"})
    with pytest.raises(utils.ConfigError) as e:  # online DPO's and evaluate.py's check, before any weight is read
        rewards.check_reward_model_config(str(folder))
    assert str(e.value) == (
        f"reward_model.name_or_path={folder} names custom code (config.json's auto_map: modeling_evil.EvilRM), which this "
        "project never runs; give a folder that transformers' own classes load (no auto_map), e.g. one saved by "
        "save_pretrained of a built-in model."
    )
    asked = []
    record = functools.partial(recording_from_pretrained, asked)
    for cls in ("AutoConfig", "AutoModelForSequenceClassification"):
        monkeypatch.setattr(getattr(transformers, cls), "from_pretrained", record(cls))
    with contextlib.suppress(OSError):
        rewards.RewardModelScorer("org/reward-model")
    assert asked == [("AutoConfig", False)]
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda path, **kwargs: transformers.LlamaConfig())
    with contextlib.suppress(OSError):
        rewards.RewardModelScorer("org/reward-model")
    assert asked == [("AutoConfig", False), ("AutoModelForSequenceClassification", False)]
