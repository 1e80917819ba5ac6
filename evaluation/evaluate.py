"""Win rates as the DPO paper measured them (Rafailov et al. 2023, Figs. 2-3); usage and outputs: docs/win-rates.md."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import sys

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

import preference_datasets
import utils
from data.chat import stop_token_ids
from data.loading import load_dataset_dict
from evaluation import judging, report, rewards, sampling
from evaluation.cache import Cache
from losses import IGNORE_INDEX
from modeling import models
from modeling.forward import response_logps
from parallel import process_group
from runs import checkpoints, checks, saved_config
from runs.config_text import digest
from runs.overrides import override_error
from utils import ConfigError, DataError


# ----------------------------------------------------------------------------- models
def kl_reference(config: DictConfig, policy: sampling.Source) -> tuple[sampling.Source | None, str | None]:
    """The model KL(A || reference) is measured against (``reference=`` or the policy run's start), else None and why."""
    if config.reference is not None:
        return sampling.resolve_source(config.reference, config, "reference"), None
    if policy.run_config is None:
        return (
            None,
            f"{policy.label} is not a run folder or checkpoint of train.py (whose start is the reference); give reference=<folder or hub id>",
        )
    try:
        return sampling.reference_source(policy), None
    except ConfigError as e:
        return None, str(e)


def check_same_vocabulary(policy: sampling.Source, reference: sampling.Source) -> None:
    """Raise ConfigError unless ``reference``'s tokenizer has ``policy``'s vocabulary (the KL compares the same token ids)."""
    if models.load_tokenizer(policy.model_config).get_vocab() != models.load_tokenizer(reference.model_config).get_vocab():
        raise ConfigError(
            f"reference={reference.label} has another vocabulary than the policy {policy.label}, so KL(policy || reference) "
            "over token ids is undefined; give a reference with the policy's tokenizer."
        )


# ----------------------------------------------------------------------------- prompts
def training_overlap(items: list[dict], policy: sampling.Source) -> dict[str, int]:
    """``{dataset: count}`` of ``items``' judge prompts in the policy run's training split (read with its ``data.*``)."""
    run = policy.run_config
    if run is None:
        return {}
    options = OmegaConf.to_container(run.data, resolve=True)
    overlap = {}
    for name in sorted({it["dataset"] for it in items} & set(run.datasets)):
        if name not in preference_datasets.registered("pairs"):
            continue
        try:
            train = load_dataset_dict(name, "train", options.get(name), silent=True)
        except (DataError, OSError):
            continue  # its training data is not readable here: nothing to compare with
        seen = {
            sampling.messages_text(p) if isinstance(p, list) else p
            for p in (e.get("prompt_messages", k) for k, e in train.items())
        }
        count = sum(it["judge_prompt"] in seen for it in items if it["dataset"] == name)
        if count:
            overlap[name] = count
    return overlap


# ----------------------------------------------------------------------------- samples and log-probs, cached


def sample_key(source: sampling.Source, side: str, temperature: float, config, batch_digest: str, i: int) -> str:
    """The cache key of a batch's ``i``-th sample: model, side, temperature, generation settings and the batch's prompts."""
    settings = [config.seed, config.max_new_tokens, config.top_k, config.top_p, config.max_prompt_length, config.max_length]
    return digest([source.fingerprint, side, float(temperature), settings, batch_digest, i])


def batch_seed(config, side: str, temperature: float, batch_digest: str) -> int:
    """The seed of one batch's ``generate`` call from ``seed``, side, temperature and prompts (not the rank)."""
    return int(digest([config.seed, side, float(temperature), batch_digest])[:15], 16)


def sample_all(
    source: sampling.Source,
    side: str,
    batches: list[list[dict]],
    config,
    cache: Cache,
    device,
    show: bool,
    need_tokens: bool = False,
) -> dict:
    """{(item id, temperature): sample record} of ``source``, cached or generated; ``need_tokens`` resamples tokenless ones."""
    temps = [float(t) for t in config.temperatures]
    digests = [digest([json.dumps(it["prompt"]) for it in batch]) for batch in batches]
    keys = {
        (b, t): [sample_key(source, side, t, config, digests[b], i) for i in range(len(batch))]
        for b, batch in enumerate(batches)
        for t in temps
    }
    missing = lambda k: cache.get(k) is None or (need_tokens and "tokens" not in cache.get(k))  # noqa: E731
    todo = [(b, t) for (b, t), ks in keys.items() if any(missing(k) for k in ks)]
    if todo:
        model, tokenizer = sampling.load_source(source, device)
        stop_ids = stop_token_ids(tokenizer)
        ids = {b: sampling.prompt_ids(batches[b], tokenizer, config) for b in sorted({b for b, _ in todo})}
        from tqdm import tqdm

        for b, t in tqdm(todo, desc=f"sampling {side}: {source.label}", disable=not show, leave=False):
            samples = sampling.generate_batch(
                model, tokenizer, stop_ids, ids[b], t, config, batch_seed(config, side, t, digests[b])
            )
            records = [
                {"key": k, "side": side, "id": it["id"], "temperature": t, **s}
                for k, it, s in zip(keys[(b, t)], batches[b], samples)
                if missing(k)
            ]
            cache.put(records)
        del model
    return {(it["id"], t): cache.get(keys[(b, t)][i]) for (b, t) in keys for i, it in enumerate(batches[b])}


def completion_logps(model, prompts: list[list[int]], completions: list[list[int]]) -> torch.Tensor:
    """log p(completion | prompt) summed over the completion, ``model``'s own distribution: (N,) float32 on the CPU."""
    rows = [list(p) + list(c) for p, c in zip(prompts, completions)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)  # the prompt and the padding
    for i, (p, r) in enumerate(zip(prompts, rows)):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
        labels[i, len(p) : len(r)] = torch.tensor(r[len(p) :], dtype=torch.long)
    device = next(model.parameters()).device
    inputs = {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}
    with torch.inference_mode():
        logps, _ = response_logps(model, inputs, average_log_prob=False)
    return logps.cpu()


def logps_all(
    source: sampling.Source, batches: list[list[dict]], samples: dict, prompts: dict, config, cache: Cache, device, show: bool
) -> dict:
    """{(item id, temperature): log-prob in nats} of A's ``samples`` under ``source``; ``prompts(b)``: batch b's prompt ids."""
    temps = [float(t) for t in config.temperatures]
    key = lambda it, t: digest(["logp", source.fingerprint, samples[(it["id"], t)]["key"]])  # noqa: E731
    todo = [(b, t) for b, batch in enumerate(batches) for t in temps if any(cache.get(key(it, t)) is None for it in batch)]
    if todo:
        model, _ = sampling.load_source(source, device)
        from tqdm import tqdm

        for b, t in tqdm(todo, desc=f"log-probs: {source.label}", disable=not show, leave=False):
            tokens = [samples[(it["id"], t)]["tokens"] for it in batches[b]]
            logps = completion_logps(model, prompts(b), tokens).tolist()
            cache.put([{"key": key(it, t), "logp": lp} for it, lp in zip(batches[b], logps)])
        del model
    return {(it["id"], t): cache.get(key(it, t))["logp"] for batch in batches for it in batch for t in temps}


# ----------------------------------------------------------------------------- the command
class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during an evaluation; ``output_dir`` is the folder to resume."""

    def __init__(self, output_dir: str):
        super().__init__(output_dir)
        self.output_dir = output_dir


def check_config(config: DictConfig) -> None:
    """Raise ConfigError (one sentence) for a missing policy or a bad temperatures, sizes, max_failure_rate, datasets or judge."""
    if OmegaConf.is_missing(config, "policy") or config.policy is None:
        raise ConfigError("Give the policy to evaluate: policy=<run folder | checkpoint | hf folder | hub id>.")
    temps = config.temperatures
    if not OmegaConf.is_list(temps) or not len(temps) or not all(isinstance(t, (int, float)) and t >= 0 for t in temps):
        raise ConfigError(
            f"temperatures must be a list of numbers >= 0 (0: greedy), e.g. temperatures=[0.25,0.5,0.75,1.0]; got {temps}."
        )
    if len({float(t) for t in temps}) != len(temps):
        raise ConfigError(f"temperatures={list(temps)} repeats a temperature; give each once.")
    for key in ("n_prompts", "max_new_tokens", "generate_batch_size"):
        if not isinstance(config[key], int) or config[key] < 1:
            raise ConfigError(f"{key} must be an integer >= 1, got {config[key]}.")
    checks.validate_fraction(config.max_failure_rate, "max_failure_rate")
    problem = checks.sampling_problem(config)
    if problem is not None:
        raise ConfigError(problem)
    if config.datasets is not None and (not OmegaConf.is_list(config.datasets) or not len(config.datasets)):
        raise ConfigError(f"datasets must be a non-empty list: write datasets=[{config.datasets}].")
    problem = checks.scorer_error(config.judge.get("name"), config, "judge")
    if problem is not None:
        raise ConfigError(problem)


def effective_config(config: DictConfig) -> DictConfig:
    """The config to run: with ``resume=<evaluation folder>``, the one saved there, that folder its ``output_dir`` (ConfigError
    when it names code or an endpoint ``config`` does not: :func:`saved_config.handed_error`)."""
    if config.resume is None:
        return config
    folder = str(config.resume)
    saved = os.path.join(folder, "config.yaml")
    run_config = checkpoints.load_run_config(saved) if os.path.isfile(saved) else None
    if run_config is None or "policy" not in run_config:
        raise ConfigError(
            f"resume={folder} is not an evaluation folder (no config.yaml of evaluate.py in it); give the folder evaluate.py printed."
        )
    problem = saved_config.handed_error(folder, run_config, config, "evaluate.py")  # its code and endpoints: only if given too
    if problem is not None:
        raise ConfigError(problem)
    config = run_config
    config.resume, config.output_dir = folder, folder
    return config


RESULT_FREE_KEYS = ("num_threads", "progress_bar", "dist_timeout_minutes", "malloc_mmap_threshold_mib", "output_dir", "plot_with")
"""Keys an evaluation continued with ``output_dir=`` may change: how it runs or is drawn, not what it samples or judges."""


def output_dir_problem(config: DictConfig) -> str | None:
    """One sentence when ``output_dir`` is a file, or a folder holding anything but this same evaluation (call it once
    ``datasets`` is settled)."""
    if config.resume is not None or not config.output_dir:
        return None
    out = os.path.expanduser(str(config.output_dir))
    if not os.path.lexists(out):
        return None
    if not os.path.isdir(out):
        return f"output_dir={config.output_dir} is a file; give a new or empty folder."
    names = sorted(n for n in os.listdir(out) if n != checkpoints.RUN_LOCK)
    if not names:
        return None
    saved = os.path.join(out, "config.yaml")
    try:
        other = checkpoints.load_run_config(saved) if os.path.isfile(saved) else None
    except Exception:  # not a config evaluate.py wrote
        other = None
    if other is None or "policy" not in other:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        return f"output_dir={config.output_dir} is a folder with other files in it ({shown}); give a new or empty folder."
    differences = [
        d for d in saved_config.config_differences(other, config) if not any(d[0].split(".")[0] == k for k in RESULT_FREE_KEYS)
    ]
    if not differences:
        return None  # the same evaluation, continued: nothing finished is redone
    return (
        f"output_dir={config.output_dir} holds another evaluation ({saved_config.describe_differences(differences)}); give a new "
        f"folder, or continue that one with python evaluate.py resume={config.output_dir}."
    )


DEFAULT_DATASETS = ["hh"]  # datasets=null's prompts for a policy without a run folder to name its own


def settle_datasets(config: DictConfig, policy: sampling.Source, say: bool) -> None:
    """With ``datasets=null`` take the policy run's datasets and ``data.*`` (else :data:`DEFAULT_DATASETS`), printed if ``say``."""
    if config.datasets is not None:
        return
    run = policy.run_config
    if run is None and policy.run_dir is not None:  # an hf/ export inside a run folder
        run = checkpoints.load_run_config(os.path.join(policy.run_dir, "config.yaml"))
    if run is None or not run.datasets:
        config.datasets = list(DEFAULT_DATASETS)
        if say:
            print(
                f"Note: policy={config.policy} has no run folder naming its datasets, so the prompts are the held-out split of "
                f"datasets={list(config.datasets)}; give datasets=[...] to choose.",
                flush=True,
            )
        return
    config.datasets = list(run.datasets)
    with open_dict(config.data):
        for name in run.datasets:
            if name in run.data:
                config.data[name] = run.data[name]
    if say:
        print(f"Prompts: the held-out split of {policy.label}'s datasets={list(config.datasets)}, read with its data.* settings.")


def default_output_dir(config: DictConfig, policy: sampling.Source, baseline_label: str) -> str:
    """``<policy's run folder or output_root>/eval/<name>_<timestamp>``; ``name`` defaults to ``vs_<baseline>_<judge>``."""
    name = config.name or f"vs_{baseline_label}_{config.judge.name}"
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")[:80]
    root = os.path.join(policy.run_dir if policy.run_dir else config.output_root, "eval")
    os.makedirs(root, exist_ok=True)
    return checkpoints.make_run_dir(root, name)


def resolve_baseline(config: DictConfig, policy: sampling.Source) -> tuple[sampling.Source | None, str]:
    """The model B is sampled from (None for ``baseline=chosen``: the dataset's chosen responses) and its label."""
    if config.baseline == "chosen":
        baseline, baseline_label = None, "chosen"
    elif config.baseline == "reference":
        baseline, baseline_label = sampling.reference_source(policy), "reference"
    else:
        baseline = sampling.resolve_source(config.baseline, config, "baseline")
        baseline_label = baseline.label
    return baseline, config.baseline_label or baseline_label


def load_prompts(config: DictConfig, policy: sampling.Source, judge: judging.Judge, rank: int) -> list[dict]:
    """The held-out prompts to sample on; DataError when there are none or some are in the policy run's training data."""
    items = sampling.load_items(config, silent=rank != 0)
    if not items:
        raise DataError(f"datasets={list(config.datasets)} gave no prompts; give a dataset with a held-out split.")
    if judge.kind == "reward_function":  # a column the functions cannot take: one sentence before sampling
        rewards.field_columns([it["fields"] for it in items])
    overlap = training_overlap(items, policy)
    if overlap:
        name, count = next(iter(overlap.items()))
        fraction = (policy.run_config.data.get(name) or {}).get("holdout_fraction")
        raise DataError(
            f"{count} of the {sum(it['dataset'] == name for it in items)} evaluation prompts of {name} are in the training data of "
            f"{policy.label} (read with its run's data.{name} settings); evaluate on its held-out split"
            + (f", e.g. data.{name}.holdout_fraction={fraction} as the run had." if fraction else ".")
        )
    return items


def hold_output_dir(config: DictConfig, policy: sampling.Source, baseline_label: str, rank: int, world: int) -> tuple:
    """Rank 0 makes and locks the evaluation folder (its config.yaml written unless resumed); every rank gets (folder, lock)."""
    out, refusal, lock = None, None, None
    if rank == 0:
        try:
            out = config.output_dir or default_output_dir(config, policy, baseline_label)
            os.makedirs(out, exist_ok=True)
            lock = checkpoints.lock_run_dir(out)
            if config.resume is None:
                utils.write_atomic(os.path.join(out, "config.yaml"), OmegaConf.to_yaml(config))
        except (ConfigError, OSError) as e:
            refusal = str(e)
    if world > 1:
        out, refusal = utils.broadcast_object((out, refusal))
    if refusal is not None:
        raise ConfigError(refusal)
    if rank == 0:
        print(f"Evaluation folder: {out}", flush=True)
    return out, lock


def main(config: DictConfig) -> str:
    """Run one evaluation (one rank under torchrun) and return its folder; a stop raises :class:`Interrupted` once saved."""
    config = effective_config(config)
    check_config(config)
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = process_group.init_distributed(config.dist_timeout_minutes) if world > 1 else 0
    utils.set_threads(config.num_threads)
    utils.set_malloc_mmap_threshold(config.malloc_mmap_threshold_mib)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    policy = sampling.resolve_source(config.policy, config, "policy")
    policy.label = config.label or policy.label
    baseline, baseline_label = resolve_baseline(config, policy)
    settle_datasets(config, policy, say=rank == 0)  # datasets=null: the policy run's own
    problem = output_dir_problem(config)  # before any sample is drawn
    if problem is not None:
        raise ConfigError(problem)
    if config.reference is None and config.baseline == "reference":  # the same model: its archive checked once
        reference, no_reference = baseline, None
    else:
        reference, no_reference = kl_reference(config, policy)
    if reference is not None:
        check_same_vocabulary(policy, reference)
    judge = judging.Judge(config)  # its settings checked before any folder is made
    items = load_prompts(config, policy, judge, rank)
    out, lock = hold_output_dir(config, policy, baseline_label, rank, world)
    try:
        if rank == 0 and no_reference is not None:
            print(f"kl_mean is null: {no_reference}", flush=True)
        return _evaluate(config, out, rank, world, device, policy, baseline, baseline_label, items, judge, reference)
    except KeyboardInterrupt:
        raise Interrupted(out) from None
    finally:
        if lock is not None:
            lock.release()


def _evaluate(config, out, rank, world, device, policy, baseline, baseline_label, items, judge, reference=None) -> str:
    """main()'s work once the folder is held: sample, log-probs for the KL, judge, gather, write, report."""
    samples = Cache(out, "samples", rank)
    judge.cache = Cache(out, "judgements", rank)
    size = config.generate_batch_size
    batches = [items[i : i + size] for i in range(0, len(items), size)]
    mine = [b for k, b in enumerate(batches) if k % world == rank]
    show = rank == 0 and bool(config.progress_bar)
    a = sample_all(policy, "A", mine, config, samples, device, show, need_tokens=reference is not None)
    b = sample_all(baseline, "B", mine, config, samples, device, show) if baseline is not None else None
    kl = _kl_logps(config, out, rank, device, policy, reference, mine, a, show) if reference is not None else {}
    rows = _rows(config, mine, a, b, kl)
    judge.judge_all(rows)
    errors = judge.errors
    if world > 1:
        gathered = utils.all_gather_object((rows, errors[:5]))
        rows = [r for part, _ in gathered for r in part]
        errors = [e for _, part in gathered for e in part]
    rows.sort(key=lambda r: (r["temperature"], r["index"]))
    results = report.summarize(rows, config, policy, baseline_label, reference)
    if rank == 0:
        report.write_and_report(config, out, rows, results, errors, policy, baseline_label)
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    if rows and all(r["verdict"] == "failed" for r in rows):
        why = f"; e.g. {errors[0]}" if errors else ""
        raise ConfigError(
            f"Every judgement failed ({len(rows)} of {len(rows)}{why}); results.json records it: fix the judge, then "
            f"python evaluate.py resume={out} asks again without resampling."
        )
    return out


def _kl_logps(config, out, rank, device, policy: sampling.Source, reference: sampling.Source, mine, a: dict, show: bool) -> dict:
    """{(item id, temperature): (log pi_A, log pi_ref)} of A's samples ``a``, each in nats, cached in ``logps-rank<r>.jsonl``."""
    logps = Cache(out, "logps", rank)
    tokenizer = functools.cache(lambda: models.load_tokenizer(policy.model_config))
    prompts = functools.cache(lambda k: sampling.prompt_ids(mine[k], tokenizer(), config))  # the prompt tokens A sampled after
    a_logps = logps_all(policy, mine, a, prompts, config, logps, device, show)
    ref_logps = logps_all(reference, mine, a, prompts, config, logps, device, show)
    return {k: (a_logps[k], ref_logps[k]) for k in a_logps}


def _rows(config, mine: list[list[dict]], a: dict, b: dict | None, kl: dict) -> list[dict]:
    """One row to judge per item of ``mine`` and temperature: A's response, B's (the chosen one when ``b`` is None), the KL terms."""
    rows = []
    for batch in mine:
        for it in batch:
            for t in (float(x) for x in config.temperatures):
                sa, (a_logp, ref_logp) = a[(it["id"], t)], kl.get((it["id"], t), (None, None))
                text_b = it["chosen"] if b is None else sampling.judged_response(b[(it["id"], t)]["text"], it["conversation"])
                rows.append(
                    {
                        "id": it["id"],
                        "index": it["index"],
                        "dataset": it["dataset"],
                        "temperature": t,
                        "judge_prompt": it["judge_prompt"],
                        "a": sampling.judged_response(sa["text"], it["conversation"]),
                        "b": text_b,
                        "a_ended": sa["ended"],
                        "a_tokens": sa["n_tokens"],
                        "a_logp": a_logp,
                        "ref_logp": ref_logp,
                        "kl": a_logp - ref_logp if kl else None,
                        **({"fields": it["fields"]} if it["fields"] else {}),
                    }
                )
    return rows


def _stop(signum, frame):
    raise KeyboardInterrupt


def command(config: DictConfig) -> None:
    """``python evaluate.py``'s body: exit 2 for bad input, 128 + the signal on Ctrl-C / SIGTERM after printing how to resume."""
    from runs import processes

    rank = int(os.environ.get("RANK", 0))
    got = {}
    signal.signal(signal.SIGTERM, lambda s, f: (got.setdefault("signal", s), _stop(s, f)))
    try:
        main(config)
    except (ConfigError, DataError) as e:
        processes.say_once_per_node(e, rank)
        sys.exit(2)
    except Interrupted as e:
        if rank == 0:
            print(
                f"\nInterrupted; python evaluate.py resume={e.output_dir} continues without redoing finished samples and judgements.",
                file=sys.stderr,
            )
        sys.exit(128 + got.get("signal", signal.SIGINT))


def cli(hydra_main) -> None:
    """Run ``hydra_main`` (evaluate.py's) as a command: the overrides checked first, each rank ending as a torchrun rank."""
    from runs import processes

    processes.die_with_launcher()  # a torchrun rank dies with torchrun, even by kill -9
    overrides = sys.argv[1:]
    problem = None if any(a.startswith("-") for a in overrides) else override_error(overrides, config_name="evaluate")
    if problem is not None:
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            print(f"Error: {problem}", file=sys.stderr, flush=True)
        sys.exit(2)
    if "RANK" not in os.environ:
        hydra_main()
    else:
        processes.exit_rank(hydra_main)
