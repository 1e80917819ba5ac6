"""launcher=ray (ray_launcher.py) on a local CPU cluster: the same results as train.py's own
launch, the reference on its own actors, a worker killed and restarted from its checkpoint,
remote scorers and judges, and a missing reference as a clear error.

Every Ray folder (temp, sockets, logs, Ray's checkpoint storage) is under pytest's temp folders,
the local cluster uses a token of its own (RAY_AUTH_TOKEN, so nothing is written to
~/.ray), usage stats and the dashboard are off, each test has a timeout, and the cluster is
shut down by its fixture.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import sys
import time
from pathlib import Path

import pytest

# Ray reads its authentication mode when imported: a token of this session's own, in the
# environment (local clusters use token authentication; none is written to ~/.ray).
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
pytest.importorskip("ray", reason="Ray is optional (launcher=ray): pip install -r requirements-ray.txt")
pytest.importorskip("ray.train.torch", reason="launcher=ray needs Ray Train: pip install -r requirements-ray.txt")

import ray  # noqa: E402
import ray_faults  # noqa: E402
import torch  # noqa: E402
from conftest import REPO, compose_config  # noqa: E402
from test_distributed import COMMON, assert_same_run, cli, evals, weights  # noqa: E402

import train  # noqa: E402
import trainers  # noqa: E402
import utils  # noqa: E402
from evaluation import rewards  # noqa: E402
from modeling import models
from parallel import ray_launcher  # noqa: E402
from runs import setup  # noqa: E402

RUN = [*COMMON, "sample_during_eval=false", "trainer=FSDPTrainer"]  # 64 examples, eval and checkpoint every 32
ON_RAY = [*RUN, "launcher=ray", "ray.num_workers=2"]
TOKEN_FILE = Path.home() / ".ray" / "auth_token"


def ray_environment(monkeypatch: pytest.MonkeyPatch, base: Path) -> None:
    """Keep Ray's files inside ``base`` (its temp root) and make tests/ importable by actors
    (the stub scorers live here)."""
    monkeypatch.setenv("RAY_TMPDIR", str(base))  # short: Ray's socket paths must stay under 107 characters
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH", "")]))


@pytest.fixture(scope="module")
def launch_run(tmp_path_factory) -> Path:
    """What Ray must reproduce: train.py's own launch of 2 FSDP processes (gloo)."""
    out = tmp_path_factory.mktemp("launch")
    code, text = cli([*RUN, "world_size=2"], out)
    assert code == 0, text[-4000:]
    return next(p for p in out.iterdir() if p.is_dir())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A local 2-CPU Ray cluster in this process, shut down after the module's tests."""
    base = tmp_path_factory.mktemp("r")
    patch = pytest.MonkeyPatch()
    ray_environment(patch, base)
    token_existed = TOKEN_FILE.exists()
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(base / "t"), log_to_driver=True)
    try:
        yield
    finally:
        ray.shutdown()
        patch.undo()
    assert token_existed or not TOKEN_FILE.exists(), "Ray wrote ~/.ray/auth_token"


def run_folder(out: Path) -> Path:
    """The one run folder under ``out``."""
    return next(p for p in out.iterdir() if p.is_dir())


def records(run_dir: Path) -> list[dict]:
    """Every record of the run's metrics.jsonl, in order."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- training on Ray


@pytest.mark.timeout(420)
def test_two_ray_workers_match_the_launch_run(launch_run, tmp_path_factory, monkeypatch):
    # The user's command, end to end: train.py starts a local cluster and shuts it down.
    base = tmp_path_factory.mktemp("r")
    ray_environment(monkeypatch, base)
    token_existed = TOKEN_FILE.exists()
    out = base / "out"
    code, text = cli([*ON_RAY, "ray.num_cpus=2"], out, timeout=360)
    assert code == 0, text[-4000:]
    run_dir = run_folder(out)
    assert_same_run(launch_run, run_dir)
    assert "Ray run" in text and "done" in text
    # Ray's copies of the two reported checkpoints are in the run folder, with every rank's shard.
    copies = sorted(p for p in (run_dir / "ray" / run_dir.name).glob("checkpoint_*") if p.is_dir())
    assert len(copies) == 2
    assert sorted(p.name for p in (copies[-1] / "sharded").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert token_existed or not TOKEN_FILE.exists()


@pytest.mark.timeout(400)
def test_reference_on_actors_and_a_killed_worker_restarted_from_its_checkpoint_end_as_colocated(
    cluster, launch_run, tmp_path, capfd
):
    # One Ray run shows both (each Ray Train run costs ~20 s of start-up here): the reference on 2
    # actors of its own, and rank 1 exiting after the first checkpoint; the actors outlive it.
    marker = tmp_path / "rank1-exited"
    on_actors = ["ray.reference_workers=2", "ray.reference_resources={CPU: 0.5, GPU: 0}", "ray.cpus_per_worker=0.5"]
    config = compose_config([*ON_RAY, *on_actors, "ray.max_failures=1", f"output_root={tmp_path / 'out'}"])
    exiting = functools.partial(ray_faults.exit_after_first_report, str(marker))  # rank 1: os._exit(1) after the first checkpoint
    assert ray_launcher.launch(config, exiting) == 0
    assert "ReferenceActor: 2 Ray actor(s)" in capfd.readouterr().out
    assert marker.exists()
    run_dir = run_folder(tmp_path / "out")
    recs = records(run_dir)
    # The restarted workers continued after 32 examples (the eval there came before that
    # checkpoint, so it is not done again): no step before it was trained twice, and every step
    # after it was trained once.
    assert [r["step"] for r in recs if "loss/eval" in r] == [0, 32, 64]
    assert [r["counters/examples"] for r in recs if "counters/examples" in r] == [8, 16, 24, 32, 40, 48, 56, 64]
    state = torch.load(run_dir / "LATEST" / "trainer_state.pt", weights_only=False)
    assert state["example_counter"] == 64
    # ... and ended where the uninterrupted run with a colocated reference did. (The policy
    # workers load no reference, so every reference log-prob came from the actors.)
    by_step = {r["step"]: r for r in evals(run_dir)}
    for ra in evals(launch_run):
        for key in ("loss/eval", "logps_eval/chosen", "logps_eval/rejected"):
            assert by_step[ra["step"]][key] == pytest.approx(ra[key], rel=1e-4, abs=1e-5), key
    for name, value in weights(launch_run).items():
        torch.testing.assert_close(weights(run_dir)[name], value, rtol=1e-4, atol=5e-5, msg=name)

    # Resubmitted (resume=): the same run folder and Ray storage; Ray hands the workers its
    # latest checkpoint, after which nothing is left to train.
    resumed = compose_config([f"resume={run_dir}"])
    capfd.readouterr()
    assert ray_launcher.launch(setup.effective_config(resumed), train.main) == 0
    assert [p.name for p in (tmp_path / "out").iterdir()] == [run_dir.name]
    assert records(run_dir) == recs
    assert wait_for_output(capfd, "Nothing to do: this run is complete (64/64 examples)")


def wait_for_output(capfd, text: str, seconds: float = 20) -> bool:
    """True once ``text`` was printed here (workers' lines reach the driver with a delay)."""
    seen = ""
    deadline = time.time() + seconds
    while time.time() < deadline:
        seen += capfd.readouterr().out
        if text in seen:
            return True
        time.sleep(0.5)
    return False


def kinds(run_dir: Path) -> list[tuple[int, str]]:
    """(step, what) of each metrics.jsonl record: an eval, a train log or the peak memory."""
    return [(r["step"], "eval" if "loss/eval" in r else "train" if "loss/train" in r else "memory") for r in records(run_dir)]


@pytest.mark.timeout(300)
def test_a_ray_restart_from_scratch_drops_what_the_failed_attempt_logged_and_the_driver_pushes_once(
    cluster, tmp_path, monkeypatch
):
    # Rank 0 exits once as it is about to write its first checkpoint, having logged the evals (and
    # 2 samples each) at 0 and 8 examples and the train record between them; no checkpoint was
    # reported, so Ray restarts the worker from scratch in the same run folder. The run pushes to the
    # hub (a stub): the driver pushes once, the final export, however many times a worker started.
    from huggingface_hub import HfApi

    calls = []
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: calls.append(("create_repo", repo_id, kw)) or "url")
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, **kw: calls.append(("upload_folder", kw["repo_id"], kw)))
    marker = tmp_path / "exited"
    run = ["n_examples=16", "eval_every=8", "batch_size=8", "eval_batch_size=8", "n_eval_examples=8", "n_eval_model_samples=2"]
    run += ["progress_bar=false", "minimum_log_interval_secs=0", "data.arithmetic.n_train=16", "data.arithmetic.n_test=8"]
    run += ["launcher=ray", "ray.num_workers=1", "ray.max_failures=1", "ray.cpus_per_worker=1"]
    run += ["hub.push=true", "hub.model_id=me/ray-dpo"]
    exiting = functools.partial(ray_faults.exit_before_first_save, str(marker))
    assert ray_launcher.launch(compose_config([*run, f"output_root={tmp_path / 'out'}"]), exiting) == 0
    assert marker.exists()
    run_dir = run_folder(tmp_path / "out")
    # What an uninterrupted run logs, each once: the eval at 0 examples, then for each batch of 8
    # its train record and the eval after it, then the peak memory.
    assert kinds(run_dir) == [(0, "eval"), (8, "train"), (8, "eval"), (16, "train"), (16, "eval"), (16, "memory")]
    samples = [json.loads(line)["step"] for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples == [0, 0, 8, 8, 16, 16]  # 2 prompts' samples at each eval
    sections = [line for line in (run_dir / "samples.md").read_text().splitlines() if line.startswith("## ")]
    assert sections == ["## after 0 examples", "## after 8 examples", "## after 16 examples"]
    # the workers are other processes (the stub is the driver's): one create and one upload means the driver pushed
    assert [(c[0], c[1]) for c in calls] == [("create_repo", "me/ray-dpo"), ("upload_folder", "me/ray-dpo")]
    assert calls[0][2]["private"] is True
    assert Path(calls[1][2]["folder_path"]).resolve() == (run_dir / "step-16" / "hf").resolve()
    assert (Path(calls[1][2]["folder_path"]) / "README.md").is_file()


@pytest.mark.timeout(300)
def test_online_dpo_with_reference_and_reward_model_on_actors_matches_the_local_run(cluster, tmp_path):
    from test_online import ONLINE, save_tiny_reward_model

    rm = save_tiny_reward_model(tmp_path / "rm")
    args = [*ONLINE, f"reward_model.name_or_path={rm}", "n_examples=16", "eval_every=8", "n_eval_examples=8"]
    args += ["batch_size=8", "eval_batch_size=8", "data.arithmetic.n_train=32", "data.arithmetic.n_test=8", "progress_bar=false"]
    args += ["minimum_log_interval_secs=0"]  # a train record per step: which steps are logged is not a matter of speed
    local_dir, _ = train.main(compose_config([*args, f"output_root={tmp_path / 'local'}"]))
    on_actors = ["launcher=ray", "ray.reference_workers=1", "ray.reward_workers=1", "ray.cpus_per_worker=1"]
    on_actors += ["ray.reference_resources={CPU: 0.5, GPU: 0}", "ray.reward_resources={CPU: 0.5, GPU: 0}"]
    config = compose_config([*args, *on_actors, f"output_root={tmp_path / 'ray'}"])
    assert ray_launcher.launch(config, train.main) == 0
    # The same completions were sampled, scored by the same reward model and trained on.
    # (accuracies count rewards strictly above others: at step 0 the rewards are 0 up to float
    # noise, which a reference computed elsewhere may flip; the rewards themselves are compared.)
    timing = ("examples_per_second", "tokens_per_second", "memory/")
    local, remote = records(Path(local_dir)), records(run_folder(tmp_path / "ray"))
    assert [r["step"] for r in remote] == [r["step"] for r in local]
    for a, b in zip(local, remote):
        for key, value in a.items():
            if isinstance(value, float) and not key.startswith(timing) and not key.endswith("accuracies"):
                assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    for name, value in weights(Path(local_dir)).items():
        torch.testing.assert_close(weights(run_folder(tmp_path / "ray"))[name], value, rtol=1e-4, atol=5e-5, msg=name)


def test_a_cluster_too_small_is_one_sentence_before_any_worker_starts(cluster, tmp_path):
    config = compose_config([*ON_RAY, "ray.use_gpu=true", f"output_root={tmp_path}"])
    with pytest.raises(utils.ConfigError, match="The Ray cluster has 0 GPUs and this run asks for 2 "):
        ray_launcher.launch(config, train.main)
    assert not any(tmp_path.iterdir())  # no run folder either


# ----------------------------------------------------------------------------- remote reference


def tiny_batch(config, n: int) -> tuple[list[dict], dict]:
    """The first ``n`` arithmetic pairs, and the same as one collated batch."""
    from data.loading import load_examples
    from preference_datasets import get_batch_iterator

    tokenizer = models.load_tokenizer(config.model)
    examples = load_examples(["arithmetic"], "test", {"arithmetic": {"n_train": 8, "n_test": 16}}, False, silent=True)[:n]
    batches = get_batch_iterator(examples, tokenizer, n, config.max_length, config.max_prompt_length, shuffle=False, n_epochs=1)
    return examples, next(batches)


@pytest.mark.timeout(240)
def test_remote_reference_keeps_order_and_dtype_and_a_dead_actor_is_an_error(cluster, tmp_path):
    config = compose_config(["launcher=ray", "ray.reference_workers=2", "ray.reference_resources={CPU: 0.5, GPU: 0}"])
    examples, batch = tiny_batch(config, 5)  # odd: the actors get 3 and 2 pairs
    reference = ray_launcher.start_reference(config)
    chosen, rejected = reference(batch)

    tokenizer = models.load_tokenizer(config.model)
    policy = models.load_model(config.model, tokenizer, None, config.seed)
    trainer = trainers.BasicTrainer(
        policy, config, str(tmp_path), tokenizer, examples, examples, models.load_reference(config, tokenizer)
    )
    want_chosen, want_rejected = trainer.reference_logps(batch)  # the colocated reference
    assert chosen.dtype == rejected.dtype == torch.float32 and chosen.shape == rejected.shape == (5,)
    torch.testing.assert_close(chosen, want_chosen, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rejected, want_rejected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(chosen, chosen.flip(0))  # distinct values, so the order is checked

    trainer.reference_model = None
    trainer.remote_reference = reference
    torch.testing.assert_close(trainer.reference_logps(batch)[0], want_chosen, rtol=1e-5, atol=1e-5)
    ray.kill(reference.actors[1])
    with pytest.raises(RuntimeError, match="reference model on Ray actors is unreachable"):
        trainer.reference_logps(batch)
    ray.kill(reference.actors[0])
    with pytest.raises(RuntimeError, match="No reference actors"):
        ray_launcher.RemoteReference([])


# ----------------------------------------------------------------------------- remote scorer


class StubScorer:
    """A scorer whose scores tell each text apart: len(prompt) + 1000 * len(completion)."""

    def score(self, prompts, completions):
        return torch.tensor([len(p) + 1000 * len(c) for p, c in zip(prompts, completions)], dtype=torch.float64)


class StubJudge:
    """The longer completion wins; an empty first completion is a failed judgement."""

    def __init__(self):
        self.failures = 0
        self.last_errors = []

    def judge(self, prompts, pairs):
        self.last_errors = []
        out = []
        for a, b in pairs:
            if not a:
                self.failures += 1
                self.last_errors.append("empty")
                out.append(None)
            else:
                out.append(0 if len(a) >= len(b) else 1)
        return out


def build_stub(config, device=None):
    """Stands in for rewards.build_scorer in the actors."""
    return StubJudge() if config.online.scorer == "http_judge" else StubScorer()


SCORER_RUN = ["online.enabled=true", "launcher=ray", "ray.reward_workers=2", "ray.reward_resources={CPU: 0.5, GPU: 0}"]
PROMPTS = [f"Q{'?' * i}" for i in range(7)]  # 7 texts over 2 actors: slices of 4 and 3
COMPLETIONS = [" a" * (7 - i) for i in range(7)]


@pytest.mark.timeout(180)
def test_remote_scorer_and_judge_keep_order_dtype_and_failures(cluster):
    scorer = ray_launcher.start_scorer(compose_config(SCORER_RUN), build="test_ray.build_stub")
    assert isinstance(scorer, ray_launcher.RemoteScorer) and not hasattr(scorer, "judge")
    got = scorer.score(PROMPTS, COMPLETIONS)
    assert got.dtype == torch.float32 and got.tolist() == StubScorer().score(PROMPTS, COMPLETIONS).tolist()
    assert scorer.score([], []).shape == (0,)
    with pytest.raises(ValueError, match="2 prompts and 1 completions"):
        scorer.score(["a", "b"], ["c"])

    judge = ray_launcher.start_scorer(compose_config([*SCORER_RUN, "online.scorer=http_judge"]), build="test_ray.build_stub")
    assert isinstance(judge, ray_launcher.RemoteJudge) and not hasattr(judge, "score") and judge.scorer is None
    pairs = [("", "x"), ("long", "s"), ("s", "long"), ("a", "b"), ("", "")]
    assert judge.judge(PROMPTS[:5], pairs) == [None, 0, 1, 0, None]
    assert judge.failures == 2 and judge.last_errors == ["empty", "empty"]
    for actor in scorer.actors + judge.actors:
        ray.kill(actor)
    with pytest.raises(RuntimeError, match="reward model or judge on Ray actors is unreachable"):
        scorer.score(PROMPTS, COMPLETIONS)


@pytest.mark.timeout(180)
def test_a_remote_http_judge_resumes_its_order_shuffling_and_failures(cluster):
    # The server prefers whatever it is shown first, and fails a request whose text has a "!",
    # so the answers depend on each actor's shuffling RNG; actors restored from state_dict()
    # judge the next batch as the first ones do (fresh actors would repeat the first batch's draws).
    from test_online import ScriptedJudgeServer, http_judge

    server = ScriptedJudgeServer(lambda n, content: "?" if "!" in content else "0")
    actors = []
    try:
        config = compose_config([*SCORER_RUN, *http_judge(server)])
        first = ray_launcher.start_scorer(config)
        actors += first.actors
        pairs = [(f"a{i}", f"b{i}!" if i % 3 == 0 else f"b{i}") for i in range(8)]
        first.judge(PROMPTS[:1] * 8, pairs)
        state = first.state_dict()
        assert state["failures"] == 3 and len(state["actors"]) == 2  # pairs 0, 3 and 6
        expected = first.judge(PROMPTS[:1] * 8, pairs)
        second = ray_launcher.start_scorer(config)
        actors += second.actors
        second.load_state_dict(state)
        assert second.judge(PROMPTS[:1] * 8, pairs) == expected and second.failures == first.failures == 6
        assert second.state_dict() == first.state_dict()
    finally:
        for actor in actors:
            ray.kill(actor)
        server.close()


@pytest.mark.timeout(180)
def test_remote_reward_model_scores_as_the_local_one(cluster, tmp_path):
    from test_rewards import tiny_llama
    from transformers import ByT5Tokenizer

    tiny_llama(384, pad_token_id=0).save_pretrained(tmp_path / "rm")
    ByT5Tokenizer().save_pretrained(tmp_path / "rm")
    # The judge over a reward model: its pairwise answers, and its scorer's scores (what the online
    # loop logs), from the same actors.
    config = compose_config([*SCORER_RUN, "online.scorer=reward_model_judge", f"reward_model.name_or_path={tmp_path / 'rm'}"])
    local = rewards.build_scorer(config, device="cpu")
    remote = ray_launcher.start_scorer(config)
    assert isinstance(remote, ray_launcher.RemoteJudge) and isinstance(remote.scorer, ray_launcher.RemoteScorer)
    got = remote.scorer.score(PROMPTS, COMPLETIONS)
    assert got.dtype == torch.float32 and got.shape == (7,)
    torch.testing.assert_close(got, local.scorer.score(PROMPTS, COMPLETIONS), rtol=1e-5, atol=1e-5)
    pairs = list(zip(COMPLETIONS, reversed(COMPLETIONS)))
    assert remote.judge(PROMPTS, pairs) == local.judge(PROMPTS, pairs)
    for actor in remote.actors:
        ray.kill(actor)


# ----------------------------------------------------------------------------- config (no cluster)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer=BasicTrainer", "ray.num_workers=2"], "trainer=BasicTrainer is one process"),
        (["trainer=FSDPTrainer", "ray.num_workers=3"], "must be divisible by the number of processes \\(3\\)"),
        (["loss=sft", "ray.reference_workers=1"], "loss=sft uses no reference; set ray.reference_workers=0"),
        (["ray.reference_workers=1", "precompute_ref_log_probs=true"], "set ray.reference_workers=0 with it"),
        (["ray.reward_workers=1"], "set online.enabled=true or ray.reward_workers=0"),
        (["ray.reference_resources={CPU: -1}"], "ray.reference_resources.CPU must be a number >= 0"),
        (["ray.num_workers=0"], "ray.num_workers must be a whole number >= 1"),
        (["launcher=slurm"], "launcher=slurm is unknown"),
    ],
)
def test_bad_ray_settings_are_one_sentence_before_ray_starts(overrides, message):
    config = compose_config(["launcher=ray", *overrides])
    with pytest.raises(utils.ConfigError, match=message):
        ray_launcher.check_config(config)


def test_missing_ray_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if not installed
    with pytest.raises(utils.ConfigError, match="pip install -r requirements-ray.txt"):
        ray_launcher.import_ray()
