"""Model cards for the Hugging Face exports (``<checkpoint>/hf/README.md``) and pushing the final
export to the Hugging Face Hub (``hub.*``)."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil

from omegaconf import DictConfig, OmegaConf

import losses
import objectives  # noqa: F401  (registers the objectives beyond SFT, DPO and IPO)
import utils
from runs import checkpoints, checks, tracking

CURVE_PANELS = ("loss", "accuracy")  # tracking.plot_curves panels copied into each export (curves/<panel>.png)

HUB_DATASETS = {
    "hh": ("Anthropic/hh-rlhf", "local_dir"),
    "shp": ("stanfordnlp/SHP", "path"),
    "se": ("HuggingFaceH4/stack-exchange-preferences", "path"),
    "tldr": ("trl-lib/tldr", "path"),
}
"""Registered datasets read from the hub: name -> (hub id, the ``data.<name>`` key that reads local files instead)."""

COUNT_SUFFIX = "/n"  # a count, not a result (answers_eval/n: the prompts answered): in the card's table only

EVAL_KEY = re.compile(r"_eval/|/eval$|^eval/")  # a key of a held-out (eval) record in metrics.jsonl


class PushError(RuntimeError):
    """The final export could not be pushed to the Hub; the message is one sentence with the command to push it later."""


def is_hub_id(name) -> bool:
    """True if ``name`` is a valid hub repository id (``org/name`` or ``name``), not a local path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(name, str) or checks.looks_local(name) or os.path.exists(os.path.expanduser(name)):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def hub_datasets(config: DictConfig) -> list[str]:
    """The hub ids of the run's datasets read from the hub (a local ``data.*`` path is left out)."""
    found = []
    for name in config.datasets:
        options = config.data.get(name) or {}
        if name == "hf":
            path = options.get("path")
            hub_id = path if isinstance(path, str) and is_hub_id(path) else None
        elif name in HUB_DATASETS and options.get(HUB_DATASETS[name][1]) is None:
            hub_id = HUB_DATASETS[name][0]
        else:
            hub_id = None
        if hub_id is not None and hub_id not in found:
            found.append(hub_id)
    return found


def eval_metrics(run_dir: str, step: int) -> tuple[int | None, dict]:
    """(step, {key: value}) of the latest held-out record in metrics.jsonl at or before ``step`` examples; (None, {}) if none."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return None, {}
    latest = None, {}
    for record in tracking.jsonl_records(path):
        if record.get("step", math.inf) <= step and any(EVAL_KEY.search(k) for k in record):
            latest = record["step"], {k: v for k, v in record.items() if k != "step"}
    return latest


def evaluations(run_dir: str) -> list[tuple[str, dict]]:
    """evaluate.py's results of this run (``<run_dir>/eval/*/results.json``), as (folder name, results), by name."""
    folder = os.path.join(run_dir, "eval")
    found = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        try:
            with open(os.path.join(folder, name, "results.json")) as f:
                found.append((name, json.load(f)))
        except (OSError, ValueError):
            continue
    return found


EVALUATIONS_HEADING = "## Evaluations (evaluate.py)"  # the card's section of evaluate.py's win rates (evaluations_lines)

MADE_HEADING = "## How it was made"  # the card's section after the evaluations: the command and config.yaml


def evaluations_lines(found: list[tuple[str, dict]]) -> list[str]:
    """The card's lines of evaluate.py's results ``found`` (:func:`evaluations`): none when there are none."""
    if not found:
        return []
    lines = ["", EVALUATIONS_HEADING, ""]
    for name, result in found:
        lines += [f"`eval/{name}`: {result.get('policy')} vs {result.get('baseline')}, judge {result.get('judge')}:", ""]
        lines += ["| temperature | win rate | 95% interval | n |", "|---|---|---|---|"]
        for t, r in (result.get("temperatures") or {}).items():
            if r.get("win_rate") is None:
                lines.append(f"| {t} | - | - | 0 |")
            else:
                lines.append(f"| {t} | {r['win_rate']:.3f} | [{r['ci_low']:.3f}, {r['ci_high']:.3f}] | {r['n']} |")
        lines.append("")
    return lines


def _number(value) -> str:
    """A metric value for the card's tables (4 significant digits)."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _base(config: DictConfig) -> tuple[str | None, str]:
    """(the hub id the run's model derives from, or None; its description for the card's body)."""
    model = config.model
    name = model.get("name_or_path")
    hub_id = name if is_hub_id(name) else None
    if name is None:
        what = "A randomly initialised model (`model.config`)"
    else:
        what = f"`{name}`"
    if model.archive is not None:
        archive = checkpoints.local_path(model.archive)  # not a LATEST link
        what += f", starting from the policy `{archive}` (`model.archive`, e.g. an SFT run's)"
    return hub_id, what


def build_card(config: DictConfig, run_dir: str, step: int, updates: int, kind: str, curves: list[str] = ()):
    """The ``huggingface_hub.ModelCard`` of checkpoint ``step-<step>``'s export (``kind``: model, adapter or merged)."""
    from huggingface_hub import ModelCard, ModelCardData

    objective = losses.get_objective(config.loss.name)
    hub_base, base_text = _base(config)
    datasets = hub_datasets(config)
    eval_step, metrics = eval_metrics(run_dir, step)
    run_name = os.path.basename(os.path.normpath(run_dir))
    results = _eval_results(config, objective, metrics)
    data = ModelCardData(
        library_name="peft" if kind == "adapter" else "transformers",
        base_model=hub_base,
        tags=list(dict.fromkeys(["dpo", config.loss.name])),
        datasets=datasets or None,
        pipeline_tag="text-classification" if objective.score_head else "text-generation",
        model_name=f"{run_name}/step-{step}" if results else None,
        eval_results=results or None,
    )
    lines = [f"# {run_name} (step-{step})", ""]
    lines += _intro_lines(config, objective, kind)
    lines += ["", "## Base model", "", base_text + ".", "", "## Data", ""]
    lines += _settings_lines(config, objective)
    lines += _training_lines(config, step, updates)
    lines += _metrics_lines(config, eval_step, metrics)
    lines += _curves_lines(curves)
    lines += evaluations_lines(evaluations(run_dir))
    lines += _made_lines(config, run_dir)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines))


def _eval_results(config: DictConfig, objective, metrics: dict) -> list:
    """The card metadata's ``EvalResult`` s: the finite held-out metrics, counts left out."""
    from huggingface_hub import EvalResult

    eval_set = "+".join(config.datasets)
    return [
        EvalResult(
            task_type="text-classification" if objective.score_head else "text-generation",
            dataset_type=eval_set,
            dataset_name=f"{eval_set} (held-out)",
            dataset_split="test",
            metric_type=key,
            metric_name=key,
            metric_value=value,
        )
        for key, value in metrics.items()
        if isinstance(value, (int, float)) and math.isfinite(value) and not key.endswith(COUNT_SUFFIX)
    ]


def _intro_lines(config: DictConfig, objective, kind: str) -> list[str]:
    """The card's opening: what was trained and how the export loads."""
    trained = "a reward model (score head)" if objective.score_head else "a policy"
    lines = [
        f"{trained.capitalize()} trained with `loss={config.loss.name}` ({objective.summary}; {objective.source}) by train.py.",
        "",
    ]
    lora = checks.lora_settings(config.model)
    if kind == "adapter":
        lines.append(
            f"This folder holds LoRA adapters (r={lora.r}, alpha={lora.alpha}); load them onto the base with "
            "`peft.AutoPeftModelForCausalLM.from_pretrained(<this folder>)`."
        )
    elif kind == "merged":
        lines.append(
            f"This folder holds the base with the LoRA adapters (r={lora.r}) merged in; `AutoModelForCausalLM` loads it."
        )
    else:
        auto = "AutoModelForSequenceClassification" if objective.score_head else "AutoModelForCausalLM"
        lines.append(f"`{auto}.from_pretrained(<this folder>)` loads it, with its tokenizer.")
    return lines


def _settings_lines(config: DictConfig, objective) -> list[str]:
    """The card's ``data.*`` of each dataset and the Objective section (``loss.*``, with each key's doc)."""
    lines = []
    for name in config.datasets:
        options = OmegaConf.to_container(config.data.get(name) or OmegaConf.create({}), resolve=True)
        lines.append(f"- `{name}`: `data.{name}` = `{json.dumps(options)}`")
    lines += ["", "## Objective", "", f"`loss={config.loss.name}`:", ""]
    for key, value in OmegaConf.to_container(config.loss, resolve=True).items():
        if key != "name":
            doc = objective.keys[key].doc if key in objective.keys else ""
            lines.append(f"- `loss.{key}` = `{value}`" + (f": {doc}" if doc else ""))
    return lines


def _training_lines(config: DictConfig, step: int, updates: int) -> list[str]:
    """The card's Training section (``step``: examples trained on, ``updates``: optimizer steps)."""
    return [
        "",
        "## Training",
        "",
        f"- examples trained on: {step}",
        f"- optimizer steps: {updates} (batch_size={config.batch_size} pairs a step)",
        f"- lr={config.lr}, optimizer={config.optimizer}, lr_scheduler={config.lr_scheduler}, warmup_steps={config.warmup_steps}, seed={config.seed}",
    ]


def _metrics_lines(config: DictConfig, eval_step: int | None, metrics: dict) -> list[str]:
    """The card's Held-out metrics section: the table of the eval at ``eval_step``."""
    lines = ["", "## Held-out metrics", ""]
    if metrics:
        lines += [
            f"The eval after {eval_step} examples (`n_eval_examples={config.n_eval_examples}` held-out examples at most):",
            "",
        ]
        lines += ["| metric | value |", "|---|---|"]
        lines += [f"| {key} | {_number(value)} |" for key, value in metrics.items()]
    else:
        lines.append("No eval had run at or before this step.")
    return lines


def _curves_lines(curves: list[str]) -> list[str]:
    """The card's Training curves section: the export's ``curves/<panel>.png``."""
    lines = ["", "## Training curves", ""]
    if curves:
        lines += [f"![{p}](curves/{p}.png)" for p in curves]
        lines.append("")
        lines.append("Every panel is in the run folder's `curves/` (x axis: examples seen).")
    else:
        lines.append("Not enough points for a curve yet; the run folder's `curves/` has them once training ends.")
    return lines


def _made_lines(config: DictConfig, run_dir: str) -> list[str]:
    """The card's How it was made section: the recorded command and config.yaml."""
    command = checkpoints.read_command(run_dir)
    lines = ["", MADE_HEADING, ""]
    if command is not None:
        lines += ["```bash", command, "```", ""]
    lines += ["The run's whole configuration (its `config.yaml`):", "", "<details>", "", "```yaml"]
    lines += [OmegaConf.to_yaml(config).rstrip("\n"), "```", "", "</details>", ""]
    return lines


def write_cards(folder: str, config: DictConfig, run_dir: str, step: int, updates: int, adapter: bool) -> None:
    """Write the card (README.md) and the curves so far (``curves/``) into the export ``folder`` and its ``merged/`` if any."""
    saved = os.path.join(run_dir, "config.yaml")
    run_config = checkpoints.load_run_config(saved) if os.path.exists(saved) else config
    curves_dir = os.path.join(folder, "curves")
    plotted = tracking.plot_curves(run_dir, out_dir=curves_dir, panels=CURVE_PANELS) if config.get("plot_curves", True) else []
    curves = [os.path.basename(f)[: -len(".png")] for f in plotted]
    if not curves:
        shutil.rmtree(curves_dir, ignore_errors=True)
    targets = [(folder, "adapter" if adapter else "model")]
    if os.path.isdir(os.path.join(folder, "merged")):
        targets.append((os.path.join(folder, "merged"), "merged"))
    for target, kind in targets:
        build_card(run_config, run_dir, step, updates, kind, curves).save(os.path.join(target, "README.md"))
        if curves and target != folder:
            shutil.copytree(curves_dir, os.path.join(target, "curves"))


def with_evaluations(text: str, found: list[tuple[str, dict]]) -> str:
    """The card ``text`` (of :func:`build_card`) with its evaluations section replaced by one of ``found``, all else kept."""
    made = text.find(f"\n\n{MADE_HEADING}\n")
    if made < 0:  # not a card of build_card's: the section goes at its end
        made = len(text.rstrip("\n"))
    start = text.find(f"\n\n{EVALUATIONS_HEADING}\n")
    if 0 <= start < made:
        text, made = text[:start] + text[made:], start
    return text[:made] + "\n".join(["", *evaluations_lines(found)]) + text[made:]


def add_evaluation(checkpoint: str, run_dir: str, output_dir: str) -> list[str]:
    """Rewrite ``checkpoint``'s cards and manifest with evaluate.py's results (run_dir, output_dir); returns the cards' paths."""
    found = evaluations(run_dir)
    folder = os.path.realpath(output_dir)
    if not any(os.path.realpath(os.path.join(run_dir, "eval", name)) == folder for name, _ in found):
        with open(os.path.join(folder, "results.json")) as f:  # output_dir= outside the run's eval/
            found.append((os.path.basename(folder), json.load(f)))
    written = []
    for name in ("hf/README.md", "hf/merged/README.md"):
        path = os.path.join(checkpoint, name)
        if not os.path.isfile(path):
            continue
        with open(path, newline="", encoding="utf-8") as f:  # the newlines as ModelCard.save wrote them
            text = f.read()
        new = with_evaluations(text, found)
        with utils.replacing(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
            f.write(new)
        written.append(name)
    if written and os.path.isfile(os.path.join(checkpoint, checkpoints.CHECKPOINT_MANIFEST)):
        checkpoints.record_in_manifest(checkpoint, written)
    return [os.path.join(checkpoint, name) for name in written]


def export_to_push(checkpoint: str, config: DictConfig) -> str:
    """The folder ``hub.push`` uploads: the checkpoint's ``hf/``, or ``hf/merged`` with ``model.lora.export_merged``."""
    lora = checks.lora_settings(config.model)
    merged = lora is not None and lora.export_merged
    return os.path.join(os.path.realpath(checkpoint), "hf", "merged" if merged else "")


def push_command(model_id: str, folder: str, private: bool) -> str:
    """The command line that uploads ``folder`` as the model repository ``model_id``."""
    return (
        f"hf upload {shlex.quote(model_id)} {shlex.quote(folder.rstrip(os.sep))} . {'--private' if private else '--no-private'}"
    )


def push(checkpoint: str, config: DictConfig) -> str:
    """Upload ``checkpoint``'s final export to the Hub as ``hub.model_id``; returns its URL, PushError when it cannot."""
    from huggingface_hub import HfApi

    hub = config.hub
    folder = export_to_push(checkpoint, config).rstrip(os.sep)
    later = push_command(hub.model_id, folder, hub.private)
    if not os.path.isfile(os.path.join(folder, "README.md")):
        raise PushError(
            f"Could not push to the Hub as {hub.model_id}: the final export {folder} was not written (the warning above says why); "
            "the run is finished and kept, and its checkpoint loads with model.archive=<it>/policy.pt."
        )
    run_dir, step = os.path.split(os.path.realpath(checkpoint))
    message = hub.commit_message or f"train.py: {os.path.basename(run_dir)} {step}"
    try:
        api = HfApi()
        url = api.create_repo(hub.model_id, private=hub.private, repo_type="model", exist_ok=True)
        api.upload_folder(repo_id=hub.model_id, folder_path=folder, repo_type="model", commit_message=message)
    except Exception as e:  # no network, no token, no rights: the run is finished all the same
        raise PushError(
            f"Could not push {folder} to the Hub as {hub.model_id} ({utils.failure_reason(e)}); the run is finished and kept: "
            f"push it later with: {later}"
        ) from e
    return str(url)


def push_final(run_dir: str, config: DictConfig) -> str:
    """Push the final export of ``run_dir``'s LATEST checkpoint (:func:`push`); returns the line that says where it went."""
    checkpoint = os.path.join(run_dir, "LATEST")
    url = push(checkpoint, config)
    return f"Pushed {export_to_push(checkpoint, config).rstrip(os.sep)} to {url}"
