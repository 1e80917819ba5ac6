"""Entry point: ``python train.py [key=value ...]`` (Hydra). See README.md.

Checks the config, loads the data, then the policy and (for DPO/IPO) the frozen
reference, and hands off to the trainer named by ``config.trainer``.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import time

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

import preference_datasets
import trainers
import utils
from preference_datasets import DataError, load_examples


def precomputed_reference(reference, train_examples, eval_examples, tokenizer, config, distributed: bool, rank: int) -> dict:
    """Reference log-probs of every train and eval example, from the disk cache or one pass of
    the reference. Under FSDP/TP rank 0 (the only rank holding the reference's weights) computes
    or reads them and sends them to the other ranks."""
    if rank == 0:
        if torch.cuda.is_available():
            reference.to(f"cuda:{torch.cuda.current_device()}")
        cache = trainers.precompute_reference_logps(
            reference, train_examples + eval_examples, tokenizer, config, config.cache_dir
        )
    return utils.broadcast_object(cache if rank == 0 else None) if distributed else cache


def effective_config(config: DictConfig) -> DictConfig:
    """The config to run: with ``resume=<run folder>``, that run's saved config.

    Raises:
        utils.ConfigError: if the resume folder has no LATEST checkpoint or config.yaml.
    """
    resume_dir = config.resume
    if resume_dir is not None:
        saved = os.path.join(resume_dir, "config.yaml")
        if not os.path.exists(os.path.join(resume_dir, "LATEST")) or not os.path.exists(saved):
            raise utils.ConfigError(f"resume={resume_dir} is not a run folder with a LATEST checkpoint and config.yaml.")
        config = OmegaConf.load(saved)
        config.resume = resume_dir
    OmegaConf.resolve(config)
    return config


def load_reference(config: DictConfig, tokenizer, apply_archive: bool = True) -> torch.nn.Module:
    """The frozen reference: the model ``model.*`` describes (a random one is seeded by ``seed``,
    so it equals the policy's start) in ``model.reference_dtype`` (null: the policy's dtype), with
    ``model.archive``'s weights when set and ``apply_archive`` (main() reads the archive once for
    policy and reference). Ray's reference actors (``ray_launcher.ReferenceActor``) load it here too."""
    dtype = utils.get_dtype(config.model.reference_dtype) or utils.get_dtype(config.model.policy_dtype)
    reference = utils.load_model(config.model, tokenizer, dtype, config.seed)
    if apply_archive and config.model.archive is not None:
        reference.load_state_dict(torch.load(config.model.archive, map_location="cpu", weights_only=False)["state"])
    return reference


def load_archive(model: torch.nn.Module, state: dict, path: str) -> None:
    """Load ``state`` (a policy.pt's weights) into ``model``.

    Raises:
        utils.ConfigError: naming the first missing/unexpected/mismatched key when the weights
            are another model's.
    """
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        lines = [line.strip() for line in str(e).splitlines()[1:] if line.strip()]
        detail = (lines[0] if lines else str(e))[:200]
        raise utils.ConfigError(
            f"model.archive={path} holds another model's weights ({detail}); give the policy.pt of a run of this model."
        ) from e


def load_models(config: DictConfig, tokenizer, rank: int, distributed: bool) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The policy (a reward model for ``loss=reward``) and, for DPO/IPO with a local reference,
    the frozen reference, both with ``model.archive``'s weights when set (read once).

    Under FSDP/TP only rank 0 reads weights; the other ranks get the architecture on the meta
    device and receive their shards when the trainer shards the models (``utils.rank0_model``).

    Raises:
        utils.ConfigError: if ``model.archive`` cannot be read, holds no weights, or does not
            fit a reward model's body (on every rank under FSDP/TP).
    """
    reward_head = config.loss.name == "reward"
    needs_reference = config.loss.name in ("dpo", "ipo") and not config.loss.get("reference_free", False)
    remote_reference = config.get("launcher") == "ray" and config.ray.reference_workers > 0  # on Ray actors

    @functools.cache
    def archive() -> dict:
        try:
            state = torch.load(config.model.archive, map_location="cpu", weights_only=False)
        except Exception as e:
            raise utils.ConfigError(
                f"model.archive={config.model.archive} could not be read ({type(e).__name__}); give the policy.pt of an earlier run."
            ) from e
        if not isinstance(state, dict) or not isinstance(state.get("state"), dict):
            raise utils.ConfigError(
                f"model.archive={config.model.archive} holds no 'state' dict of weights; give the policy.pt of an earlier run."
            )
        return state

    def build_policy() -> torch.nn.Module:
        policy = utils.load_model(config.model, tokenizer, utils.get_dtype(config.model.policy_dtype), config.seed, reward_head)
        if config.model.archive is None:
            return policy
        state = archive()
        into = "the policy and reference" if needs_reference and not remote_reference else "the policy"
        print(f"Loading {config.model.archive} (after {state.get('step_idx')} examples) into {into}.")
        if reward_head:  # a causal LM's weights under a score head: all but the heads must match
            missing, unexpected = policy.load_state_dict(state["state"], strict=False)
            body = [k for k in missing + unexpected if k.split(".")[0] not in ("score", "lm_head")]
            if body:
                raise utils.ConfigError(f"model.archive={config.model.archive} does not fit this model (e.g. {body[0]!r}).")
        else:
            load_archive(policy, state["state"], config.model.archive)
        return policy

    def build_reference() -> torch.nn.Module:
        reference = load_reference(config, tokenizer, apply_archive=False)
        if config.model.archive is not None:
            load_archive(reference, archive()["state"], config.model.archive)
        return reference

    if config.model.device_map is None and config.trainer == "BasicTrainer" and torch.cuda.device_count() > 1:
        config.model.device_map = "balanced"  # one process, the model split over the local GPUs
    if not distributed:
        return build_policy(), build_reference() if needs_reference and not remote_reference else None
    policy = utils.rank0_model(build_policy, rank, reward_head)
    reference = None
    if needs_reference and not remote_reference:
        reference = utils.rank0_model(build_reference, rank)
    return policy, reference


def main(
    config: DictConfig, run_dir: str | None = None, checkpoint_dir: str | None = None, attach=None
) -> tuple[str, int | None]:
    """Run one training job (one rank of it under FSDP/TP, torchrun or Ray).

    Args:
        config: the composed config.
        run_dir: the run folder when a launcher made it already (Ray); else ``resume``'s or a new one.
        checkpoint_dir: the checkpoint to continue from (Ray's latest reported one); default
            ``<resume>/LATEST`` with ``resume=``, else none.
        attach: called with the trainer before it loads that checkpoint and trains (Ray: the
            remote reference and scorer, checkpoint reports).

    Returns:
        (run folder, None) when training finished, or (run folder, signal number) when
        SIGINT/SIGTERM stopped it after saving a checkpoint.

    Raises:
        utils.ConfigError, DataError: a bad config value or data file (before any model loads).
    """
    config = effective_config(config)
    resume_dir = config.resume
    if checkpoint_dir is None and resume_dir is not None:
        checkpoint_dir = os.path.join(resume_dir, "LATEST")
    distributed = config.trainer != "BasicTrainer"
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    utils.validate_config(config, world_size)
    utils.check_parallel_model(config, world_size)  # under torchrun too: before the run folder
    if config.trainer == "BasicTrainer" and (config.world_size or 1) > 1:
        print(f"Note: world_size={config.world_size} is for FSDPTrainer/TensorParallelTrainer; BasicTrainer uses one process.")
    rank = 0
    if distributed:
        rank = utils.init_distributed()
        if rank != 0:
            import transformers

            transformers.utils.logging.disable_progress_bar()  # one set of loading bars, not one per rank
    utils.set_seed(config.seed)
    utils.set_threads(config.num_threads)

    tokenizer = utils.load_tokenizer(config.model)
    sft_mode = config.loss.name == "sft"
    online = config.online.enabled
    options = OmegaConf.to_container(config.data, resolve=True)
    load = preference_datasets.load_prompt_examples if online else functools.partial(load_examples, sft_mode=sft_mode)
    train_examples = load(list(config.datasets), "train", options, silent=rank != 0)
    eval_examples = load(list(config.datasets), "test", options, silent=rank != 0)
    utils.check_eval_size(config, len(eval_examples))

    scorer = None
    remote_scorer = config.get("launcher") == "ray" and config.ray.reward_workers > 0  # on Ray actors
    if online and not remote_scorer:  # before the run folder: a wrong reward model fails fast
        import rewards

        scorer = rewards.build_scorer(
            config, device=f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        )

    reward_head = config.loss.name == "reward"  # training a reward model: a score head, no reference
    policy, reference = load_models(config, tokenizer, rank, distributed)  # a model that fails leaves no run folder

    run_dir = run_dir or resume_dir
    if run_dir is None and rank == 0:
        run_dir = utils.make_run_dir(config.output_root, config.exp_name)
        OmegaConf.save(config, os.path.join(run_dir, "config.yaml"))
    if distributed:
        run_dir = utils.broadcast_object(run_dir)
    if rank == 0:
        print(f"Run folder: {run_dir}")
    n_params = sum(p.numel() for p in policy.parameters())
    n_eval = utils.n_eval_used(config, len(eval_examples))
    if rank == 0:
        print(
            f"{'Reward model' if reward_head else 'Policy'}: {n_params / 1e6:.2f}M parameters; {len(train_examples)} train / {n_eval} eval examples."
        )

    resume_state = None
    if checkpoint_dir is not None:
        resume_state = torch.load(os.path.join(checkpoint_dir, "trainer_state.pt"), weights_only=False)
    logger = utils.MetricsLogger(run_dir, config, resume_id=resume_state and resume_state["wandb_id"], enabled=rank == 0)
    trainer_cls = getattr(trainers, config.trainer)
    reference_cache = None
    if reference is not None and config.precompute_ref_log_probs:
        reference_cache = precomputed_reference(reference, train_examples, eval_examples, tokenizer, config, distributed, rank)
        reference = None  # not kept in memory
    trainer = trainer_cls(policy, config, run_dir, tokenizer, train_examples, eval_examples, reference, logger)
    trainer.reference_cache = reference_cache
    trainer.scorer = scorer
    if attach is not None:
        attach(trainer)
    if checkpoint_dir is not None:
        trainer.load(checkpoint_dir)
        if rank == 0:
            print(f"Resuming after {trainer.example_counter} examples.")
    stop_signal = trainer.train()
    if distributed:
        import torch.distributed as dist

        dist.destroy_process_group()
    return run_dir, stop_signal


def launch(config: DictConfig) -> int | None:
    """Start one process per GPU (``world_size`` of them on CPU) when FSDP or tensor
    parallelism is asked for and this process was not started by torchrun.

    Each process runs this script with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    ...) and loads what it needs: no model is passed between processes. Each runs in its own
    session, so a Ctrl-C or SIGTERM reaches them once, forwarded from here; they save a
    checkpoint and stop, and this process waits for them. If one fails, the others are stopped.

    Returns:
        The exit code to leave with, or None when this process should train itself.
    """
    if config.trainer == "BasicTrainer" or "RANK" in os.environ:
        return None
    n = config.world_size or torch.cuda.device_count() or 1
    utils.validate_config(config, n)
    utils.check_parallel_model(config, n)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"Starting {n} {config.trainer} processes (gloo on CPU, NCCL on GPUs).")
    procs = []
    for rank in range(n):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n)}
        env |= {"LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
        procs.append(subprocess.Popen([sys.executable, *sys.argv], env=env, start_new_session=True))

    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        codes: dict[int, int] = {}
        while len(codes) < n:
            for rank, p in enumerate(procs):
                if rank not in codes and p.poll() is not None:
                    codes[rank] = p.returncode
                    if p.returncode not in (0, 128 + signal.SIGINT, 128 + signal.SIGTERM):
                        for other in procs:  # the others would wait for it forever
                            if other.poll() is None:
                                other.kill()
            time.sleep(0.1)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    failed = [c for c in codes.values() if c != 0]
    return max(failed, key=lambda c: c not in (-9, 128 + signal.SIGINT, 128 + signal.SIGTERM)) if failed else 0


@hydra.main(version_base="1.3", config_path="config", config_name="config")
def hydra_main(config: DictConfig) -> None:
    """The command line: compose the config, start ranks or Ray if asked, run, and turn errors and signals into exit codes (2 for a config/data error, 128 + signal when interrupted)."""
    rank = int(os.environ.get("RANK", 0))
    try:
        torchrun = "TORCHELASTIC_RUN_ID" in os.environ
        if config.resume is not None and rank == 0 and ("RANK" not in os.environ or torchrun):
            from hydra.core.hydra_config import HydraConfig

            ignored = [o for o in HydraConfig.get().overrides.task if not o.startswith("resume=")]
            if ignored:
                print(f"Note: resume= continues with the run's saved config; ignoring {ignored}.")
        config = effective_config(config)
        if config.get("launcher") == "ray":
            import ray_launcher

            sys.exit(ray_launcher.launch(config))
        code = launch(config)
        if code is not None:
            sys.exit(code)
        _, stop_signal = main(config)
    except (utils.ConfigError, DataError) as e:
        if int(os.environ.get("LOCAL_RANK", rank)) == 0:  # the same sentence on every process: once per node
            print(f"Error: {e}", file=sys.stderr, flush=True)
        else:
            time.sleep(1)  # let the node's first process say it before torchrun stops the group
        sys.exit(2)
    except KeyboardInterrupt:
        if rank == 0:
            print("\nStopped by a second interrupt before the checkpoint was complete.", file=sys.stderr)
        sys.exit(130)
    if stop_signal is not None:
        sys.exit(128 + stop_signal)  # 130 for SIGINT, 143 for SIGTERM, as a shell reports them


if __name__ == "__main__":
    hydra_main()
