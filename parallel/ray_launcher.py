"""Ray: ``train.main`` on N Ray Train workers, the reference and reward models on Ray actors of their own.

``python train.py launcher=ray ray.num_workers=N ...``; see docs/ray.md. Ray is imported only here
and only on this path (``pip install -r requirements-ray.txt``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import math
import os
import sys

import torch
from omegaconf import DictConfig, OmegaConf

import losses
import objectives  # noqa: F401  (registers the objectives beyond SFT, DPO and IPO)
import trainers
import utils
from evaluation import rewards
from export import modelcard
from modeling import models
from runs import checkpoints, checks, trainer_checkpoint

# ----------------------------------------------------------------------------- config


def check_config(config: DictConfig) -> None:
    """Check the ``ray:`` section with the rest of the config before Ray starts; utils.ConfigError names the first bad key."""
    n = checks.ray_num_workers(config)
    checks.validate_config(config, n)
    models.check_parallel_model(config, n)
    checks.validate_ray(config)


def import_ray():
    """The ``ray`` module (with Ray Train); utils.ConfigError if Ray is not installed."""
    try:
        import ray
        import ray.train.torch  # noqa: F401
    except ImportError as e:
        raise utils.ConfigError(
            f"launcher=ray needs Ray Train, which is not installed ({e.name}); pip install -r requirements-ray.txt."
        ) from None
    return ray


def _actor_options(resources) -> dict:
    """Ray actor options from a ``{CPU: x, GPU: y, <custom>: z}`` mapping."""
    resources = dict(resources)
    options = {"num_cpus": resources.pop("CPU", 1), "num_gpus": resources.pop("GPU", 0)}
    if resources:
        options["resources"] = resources
    return options


def required_resources(config: DictConfig) -> dict:
    """CPUs and GPUs the policy workers and the actors ask for together, e.g. ``{"CPU": 4, "GPU": 16}``."""
    ray_cfg = config.ray
    need = {"CPU": ray_cfg.num_workers * ray_cfg.cpus_per_worker, "GPU": ray_cfg.num_workers if ray_cfg.use_gpu else 0}
    for count, resources in (
        (ray_cfg.reference_workers, ray_cfg.reference_resources),
        (ray_cfg.reward_workers, ray_cfg.reward_resources),
    ):
        options = _actor_options(resources)
        need["CPU"] += count * options["num_cpus"]
        need["GPU"] += count * options["num_gpus"]
    return need


# ----------------------------------------------------------------------------- the driver


def launch(config: DictConfig, main) -> int:
    """Run ``main`` (``train.main``, passed in as train.py imports this module) on Ray; returns the exit status.

    A cluster this process is already connected to is used and left running; one it starts, it
    shuts down. Ray ends the workers and actors if this process dies. The status: 0 done, 1 failed
    after ``ray.max_failures`` restarts, 130 after Ctrl-C. utils.ConfigError (before any worker
    starts): a bad config, Ray missing, a cluster too small, or ``resume=`` of a folder a live run holds.
    """
    check_config(config)
    ray = import_ray()
    config = copy.deepcopy(config)
    ray_cfg = config.ray
    need = required_resources(config)
    held = contextlib.ExitStack()  # the run folder's lock (checkpoints.lock_run_dir), held by this driver until it returns
    started = not ray.is_initialized()
    actors = []
    try:
        if config.resume is not None:  # before Ray starts: refused while a live run holds the folder
            held.enter_context(checkpoints.lock_run_dir(config.resume))
        if started:
            init_ray(ray, ray_cfg, need)
        _check_cluster(ray, need)
        run_dir = _open_run_dir(config, held)
        reference, scorer = _start_remote_models(config, actors)
        payload = {
            "config": OmegaConf.to_container(config, resolve=True),
            "run_dir": run_dir,
            "cwd": os.getcwd(),
            "reference": reference,
            "scorer": scorer,
            "main": main,
        }
        os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")  # else Ray Train prints each worker line twice
        trainer = _torch_trainer(config, payload)
        try:
            result = trainer.fit()
        except (KeyboardInterrupt, SystemExit):  # Ray Train's Ctrl-C handler aborts the run and exits
            print(f"\nInterrupted. Continue from the last checkpoint Ray recorded with: python train.py resume={run_dir}")
            return 130
        except Exception as e:  # Ray's TrainingFailedError and friends: the workers' error is in the text
            print(f"Error: training on Ray failed after ray.max_failures={ray_cfg.max_failures} restarts: {e}")
            return 1
        return _finish(config, run_dir, result)
    finally:
        for actor in actors:
            ray.kill(actor)
        if started and ray.is_initialized():
            ray.shutdown()
        held.close()  # after the workers are gone


def init_ray(ray, ray_cfg: DictConfig, need: dict) -> None:
    """Connect to ``ray.address``, or start a local cluster of ``ray.num_cpus`` CPUs (at least ``need["CPU"]``)."""
    if ray_cfg.address is None:
        ray.init(num_cpus=max(ray_cfg.num_cpus or os.cpu_count() or 1, math.ceil(need["CPU"])))
    else:
        try:
            ray.init(address=ray_cfg.address)
        except ConnectionError as e:
            raise utils.ConfigError(
                f"No Ray cluster at ray.address={ray_cfg.address} ({e}); start one with `ray start --head`, "
                "or leave ray.address=null for a local cluster."
            ) from None


def _check_cluster(ray, need: dict) -> None:
    """Raise utils.ConfigError if the cluster has fewer CPUs or GPUs than ``need`` (:func:`required_resources`)."""
    have = ray.cluster_resources()
    short = [k for k in ("CPU", "GPU") if need[k] > have.get(k, 0)]
    if short:
        raise utils.ConfigError(
            f"The Ray cluster has {have.get(short[0], 0):g} {short[0]}s and this run asks for {need[short[0]]:g} "
            "(ray.num_workers, ray.cpus_per_worker, ray.use_gpu and the actors' resources); ask for less or add nodes."
        )


def _open_run_dir(config: DictConfig, held: contextlib.ExitStack) -> str:
    """The run folder (a new one, locked on ``held``, or ``resume``'s), with ``ray.storage_path`` and ``ray.name`` set."""
    ray_cfg = config.ray
    fresh = config.resume is None
    run_dir = os.path.abspath(checkpoints.make_run_dir(config.output_root, config.exp_name) if fresh else config.resume)
    if fresh:
        held.enter_context(checkpoints.lock_run_dir(run_dir))
    ray_cfg.storage_path = os.path.abspath(ray_cfg.storage_path or os.path.join(run_dir, "ray"))
    ray_cfg.name = ray_cfg.name or os.path.basename(run_dir)
    if fresh:  # what resume= reads, with Ray's storage folder and run name, so a resubmitted run finds them
        checkpoints.save_run_config(config, os.path.join(run_dir, "config.yaml"))
        if config.model.archive is not None:  # the file it names now (LATEST moves on), which the workers load
            pin = checkpoints.archive_pin(config.model.archive)
            checkpoints.write_archive_pin(run_dir, pin)
            config.model.archive = pin["path"]
    print(f"Run folder: {run_dir}")
    return run_dir


def _start_remote_models(config: DictConfig, actors: list) -> tuple:
    """(remote reference, remote scorer), each None when not asked for; their actors are added to ``actors`` as they start."""
    reference = scorer = None
    if config.ray.reference_workers > 0:
        reference = start_reference(config)
        actors += reference.actors
    if config.ray.reward_workers > 0:
        scorer = start_scorer(config)
        actors += scorer.actors
    return reference, scorer


def _torch_trainer(config: DictConfig, payload: dict):
    """The ``TorchTrainer`` that runs :func:`train_worker` on ``ray.num_workers`` workers."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray_cfg = config.ray
    worker_resources = {"CPU": ray_cfg.cpus_per_worker, **({"GPU": 1} if ray_cfg.use_gpu else {})}
    keep = config.keep_checkpoints if config.keep_checkpoints and config.keep_checkpoints > 0 else None
    return TorchTrainer(
        train_worker,
        train_loop_config=payload,
        scaling_config=ScalingConfig(
            num_workers=ray_cfg.num_workers, use_gpu=ray_cfg.use_gpu, resources_per_worker=worker_resources
        ),
        run_config=RunConfig(
            name=ray_cfg.name,
            storage_path=ray_cfg.storage_path,
            failure_config=FailureConfig(max_failures=ray_cfg.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=keep),
        ),
    )


def _finish(config: DictConfig, run_dir: str, result) -> int:
    """Say where the finished run is and push its final export if ``hub.push``; the exit status (1: the push failed)."""
    where = f"; Ray's copy: {result.checkpoint.path}" if result.checkpoint is not None else ""
    print(f"Ray run {config.ray.name} done: run folder {run_dir}{where}.")
    if config.hub.push:  # from the driver: a failed push must not restart the workers
        try:
            print(modelcard.push_final(run_dir, config))
        except modelcard.PushError as e:
            print(f"Error: {e}", file=sys.stderr, flush=True)
            return 1
    return 0


# ----------------------------------------------------------------------------- the workers


def train_worker(payload: dict) -> None:
    """What each Ray Train worker runs: ``payload["main"]`` as one rank, from Ray's latest checkpoint if any."""
    import ray.train
    import ray.train.torch

    if os.path.isdir(payload["cwd"]):
        os.chdir(payload["cwd"])  # Ray starts workers in a folder of its own
    if torch.cuda.is_available():
        # Ray's GPU index need not be the local rank; the trainers read LOCAL_RANK as the CUDA device
        os.environ["LOCAL_RANK"] = str(ray.train.torch.get_device().index)
    config = OmegaConf.create(payload["config"])
    checkpoint = ray.train.get_checkpoint()
    from_scratch = checkpoint is None and config.resume is None
    attach = functools.partial(_attach, payload, from_scratch)
    with checkpoint.as_directory() if checkpoint is not None else contextlib.nullcontext() as checkpoint_dir:
        payload["main"](config, run_dir=payload["run_dir"], checkpoint_dir=checkpoint_dir, attach=attach)


def _attach(payload: dict, from_scratch: bool, trainer) -> None:
    """Put the remote reference and scorer behind the trainer's seams and report each checkpoint it saves to Ray.

    Rank 0 reports the folder (every rank's shard); the others report none, as ``ray.train.report``
    is a barrier. ``from_scratch``: an earlier attempt's logs in the run folder are dropped.
    """
    import ray.train

    dropped = trainer_checkpoint.rewind_logs(trainer, -1) if from_scratch else 0
    if dropped:
        print(f"metrics.jsonl: removed {dropped} records of a Ray attempt that ended before its first checkpoint.")
    if payload["reference"] is not None:
        trainer.remote_reference = payload["reference"]
    if payload["scorer"] is not None:
        trainer.scorer = payload["scorer"]
    save = trainer.save

    def save_and_report() -> str:
        path = save()
        checkpoint = ray.train.Checkpoint.from_directory(path) if trainer.dist.is_main else None
        ray.train.report({"examples": trainer.example_counter, "updates": trainer.batch_counter}, checkpoint=checkpoint)
        return path

    trainer.save = save_and_report


# ----------------------------------------------------------------------------- remote reference


class ReferenceActor:
    """A Ray actor holding the frozen reference (``models.load_reference`` of the config as a plain dict), on its GPU if any."""

    def __init__(self, config: dict):
        config = OmegaConf.create(config)
        utils.set_threads(config.num_threads)
        utils.set_malloc_mmap_threshold(config.malloc_mmap_threshold_mib)
        tokenizer = models.load_tokenizer(config.model)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = models.load_reference(config, tokenizer).to(self.device)
        self.model.eval()
        self.model.requires_grad_(False)
        self.average_log_prob = losses.get_objective(config.loss.name).averages(config.loss)
        self.output_layer_chunk = config.output_layer_chunk
        self.packed, self.max_forward_chunks = trainers.BasicTrainer.packed, None  # what concatenated_forward reads
        weights = losses.get_objective(config.loss.name).token_weights
        self.token_weight = weights(config.loss) if weights is not None else None

    def ready(self) -> bool:
        """True once the model is loaded (a call that waits for ``__init__``)."""
        return True

    @torch.inference_mode()
    def logps(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) reference log-probs, each (B,) float32 on the CPU, of ``REFERENCE_KEYS`` tensors (B, T)."""
        # the trainer's forward, so a remote reference computes what a colocated one would
        chosen, rejected, _ = trainers.BasicTrainer.concatenated_forward(self, self.model, batch)
        return chosen.float().cpu(), rejected.float().cpu()


REFERENCE_KEYS = tuple(f"{side}_{key}" for side in ("chosen", "rejected") for key in ("input_ids", "attention_mask", "labels"))


def _slices(n: int, k: int) -> list[tuple[int, int]]:
    """Up to ``k`` contiguous, non-empty (lo, hi) slices of range(n), sizes differing by at most one."""
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]


def _unreachable(what: str, error: Exception) -> RuntimeError:
    return RuntimeError(
        f"The {what} on Ray actors is unreachable ({utils.failure_reason(error)}); "
        f"training stops rather than go on without it. Check the actors' logs, then resume the run."
    )


class RemoteReference:
    """Reference log-probs from K :class:`ReferenceActor` s, one contiguous slice of the batch each, concatenated in order."""

    def __init__(self, actors: list):
        if not actors:
            raise RuntimeError("No reference actors: the loss needs a reference, and the policy is never used as its own.")
        self.actors = list(actors)

    def __call__(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) reference log-probs, each (B,) float32 on the CPU, in batch order."""
        import ray

        n = batch["chosen_input_ids"].shape[0]
        futures = [
            actor.logps.remote({k: batch[k][lo:hi] for k in REFERENCE_KEYS})
            for actor, (lo, hi) in zip(self.actors, _slices(n, len(self.actors)))
        ]
        try:
            results = ray.get(futures)
        except ray.exceptions.RayError as e:
            raise _unreachable("reference model", e) from e
        return torch.cat([c for c, _ in results]), torch.cat([r for _, r in results])


def _start_actors(config: DictConfig, cls: type, count: int, resources, probe: str, *args) -> tuple[list, list]:
    """Start ``count`` actors ``cls(config as a dict, *args)`` and wait for each one's ``probe()``; returns (actors, answers)."""
    import ray

    restarts = max(config.ray.max_failures, 0)
    remote = ray.remote(cls).options(max_restarts=restarts, max_task_retries=restarts, **_actor_options(resources))
    plain = OmegaConf.to_container(config, resolve=True)
    actors = [remote.remote(plain, *args) for _ in range(count)]
    try:
        answers = ray.get([getattr(actor, probe).remote() for actor in actors])
    except ray.exceptions.RayError as e:
        for actor in actors:
            ray.kill(actor)
        raise RuntimeError(f"A {cls.__name__} failed to start: {e}") from e
    print(f"{cls.__name__}: {count} Ray actor(s), {_actor_options(resources)} each.")
    return actors, answers


def start_reference(config: DictConfig) -> RemoteReference:
    """Start ``ray.reference_workers`` :class:`ReferenceActor` s and wait until each has loaded the reference."""
    actors, _ = _start_actors(config, ReferenceActor, config.ray.reference_workers, config.ray.reference_resources, "ready")
    return RemoteReference(actors)


# ----------------------------------------------------------------------------- remote scorer


class ScorerActor:
    """A Ray actor holding online DPO's scorer or judge, built by ``build`` ("module.function") on its GPU if any."""

    def __init__(self, config: dict, build: str = "evaluation.rewards.build_scorer"):
        module, name = build.rsplit(".", 1)
        config = OmegaConf.create(config)
        utils.set_threads(config.num_threads)
        utils.set_malloc_mmap_threshold(config.malloc_mmap_threshold_mib)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.scorer = getattr(importlib.import_module(module), name)(config, device=device)

    def kind(self) -> tuple[str, bool]:
        """("score", True) for a scorer, ("judge", whether it wraps a ``.scorer``) for a judge."""
        if hasattr(self.scorer, "score"):
            return "score", True
        return "judge", hasattr(self.scorer, "scorer")

    def score(self, prompts: list[str], completions: list[str], fields: list[dict] | None = None) -> torch.Tensor:
        """The scorer's (or the judge's inner scorer's) scores, (N,) float32 on the CPU; ``fields``: one dict per text."""
        scorer = self.scorer if hasattr(self.scorer, "score") else self.scorer.scorer
        return scorer.score(prompts, completions, **rewards.field_columns(fields or [])).float().cpu()

    def judge(self, prompts: list[str], pairs: list[tuple[str, str]]) -> tuple[list, int, list[str]]:
        """The judge's ``judge``, with the failures this call added and their reasons."""
        before = self.scorer.failures
        results = list(self.scorer.judge(prompts, pairs))
        return results, self.scorer.failures - before, list(getattr(self.scorer, "last_errors", []))

    def state_dict(self) -> dict | None:
        """The judge's ``state_dict`` (e.g. the HTTP judge's order-shuffling RNG), or None when it keeps none."""
        state_dict = getattr(self.scorer, "state_dict", None)
        return state_dict() if callable(state_dict) else None

    def load_state_dict(self, state: dict | None) -> None:
        """Restore what :meth:`state_dict` returned."""
        if state is not None:
            self.scorer.load_state_dict(state)


class _RemoteScoring:
    """What :class:`RemoteScorer` and :class:`RemoteJudge` share: the actors and the fan-out."""

    def __init__(self, actors: list):
        if not actors:
            raise RuntimeError("No scorer actors: online DPO needs its reward model or judge.")
        self.actors = list(actors)

    def _map(self, method: str, *columns: list) -> list:
        import ray

        n = len(columns[0])
        calls = [
            getattr(actor, method).remote(*(c[lo:hi] for c in columns))
            for actor, (lo, hi) in zip(self.actors, _slices(n, len(self.actors)))
        ]
        try:
            return ray.get(calls)
        except ray.exceptions.RayError as e:
            raise _unreachable("reward model or judge", e) from e


class RemoteScorer(_RemoteScoring):
    """A scorer on K :class:`ScorerActor` s, used as a local ``rewards`` scorer is."""

    def score(self, prompts: list[str], completions: list[str], **fields) -> torch.Tensor:
        """Reward of each ``prompts[i] + completions[i]``: (N,) float32 on the CPU, in input order."""
        if len(prompts) != len(completions) or any(len(v) != len(prompts) for v in fields.values()):
            raise ValueError(f"score() got {len(prompts)} prompts and {len(completions)} completions; pass one of each per text.")
        if not prompts:
            return torch.zeros(0, dtype=torch.float32)
        rows = [[dict(zip(fields, values)) for values in zip(*fields.values())]] if fields else []  # sliced as the texts
        return torch.cat(self._map("score", list(prompts), list(completions), *rows)).float()


class RemoteJudge(_RemoteScoring):
    """A pairwise judge on K :class:`ScorerActor` s, used as a local ``rewards`` judge is."""

    def __init__(self, actors: list, has_scorer: bool = False):
        super().__init__(actors)
        self.failures = 0
        self.last_errors: list[str] = []
        self.scorer = RemoteScorer(actors) if has_scorer else None

    def judge(self, prompts: list[str], pairs: list[tuple[str, str]]) -> list[int | None]:
        """One judgement per (prompt, pair), in input order: 0, 1, a tie, or None (failed, counted in ``failures``)."""
        if len(prompts) != len(pairs):
            raise ValueError(f"judge() got {len(prompts)} prompts and {len(pairs)} pairs; pass one pair per prompt.")
        self.last_errors = []
        results: list[int | None] = []
        if not prompts:
            return results
        for part, failed, errors in self._map("judge", list(prompts), list(pairs)):
            results.extend(part)
            self.failures += failed
            self.last_errors.extend(errors)
        return results

    def state_dict(self) -> dict:
        """``failures`` and each actor's judge state (:meth:`ScorerActor.state_dict`), in actor order, for a resume."""
        import ray

        return {"failures": self.failures, "actors": ray.get([actor.state_dict.remote() for actor in self.actors])}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned; with another number of actors their judges start afresh."""
        import ray

        self.failures = int(state["failures"])
        if len(state["actors"]) == len(self.actors):
            ray.get([actor.load_state_dict.remote(s) for actor, s in zip(self.actors, state["actors"])])


def start_scorer(config: DictConfig, build: str = "evaluation.rewards.build_scorer") -> RemoteScorer | RemoteJudge:
    """Start ``ray.reward_workers`` :class:`ScorerActor` s: a :class:`RemoteScorer`, or a :class:`RemoteJudge` for a judge."""
    actors, kinds = _start_actors(config, ScorerActor, config.ray.reward_workers, config.ray.reward_resources, "kind", build)
    kind, has_scorer = kinds[0]
    return RemoteScorer(actors) if kind == "score" else RemoteJudge(actors, has_scorer)
