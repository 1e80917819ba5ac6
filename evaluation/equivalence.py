"""The equivalence matrix (issue 37, part 2): every objective on every path, against the one-process padded run.

``python -m evaluation.equivalence [--objectives dpo,ipo] [--cells packed,fsdp] [--merge]`` trains the tiny random model
on the embedded arithmetic pairs for a few fp32 steps per *cell* (a path: packed forward, chunked output layer,
precomputed or Ray-actor reference, gradient accumulation, resume mid-epoch, FSDP, tensor parallelism, 2-D, LoRA) and
compares each with the baseline of the same objective and seed: BasicTrainer in this process with ``trainer.packed =
False``. A cell is the largest |loss difference| over the steps (metrics.jsonl's train records) and the largest |weight
difference| of the policy at the end (LATEST/policy.pt), each against its tolerance; a cell over one fails the command
(exit 1). The cells of several processes run in one launch each for all their objectives (evaluation/equivalence_worker.py).
The table goes to docs/equivalence.md and every entry, with the command that wrote it, to docs/equivalence.json;
``--merge`` starts from that JSON and overwrites only the cells it runs, so the matrix can be filled in parts.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from evaluation import equivalence_worker
from runs import tracking

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "equivalence.md"

# A run of a few seconds: 48 pairs of the embedded arithmetic data, 6 steps of 8, a checkpoint at 24 and 48 (the
# resume cell restarts from 24), fp32 on one thread, no export, samples or plots.
BASE = [
    "batch_size=8",
    "eval_batch_size=8",
    "n_eval_examples=16",
    "n_examples=48",
    "eval_every=24",
    "data.arithmetic.n_train=64",
    "data.arithmetic.n_test=16",
    "progress_bar=false",
    "minimum_log_interval_secs=0",  # a train record per step: the per-step losses
    "warmup_steps=2",
    # SGD: a weight difference is lr x the gradients' difference. RMSprop (the default) and AdamW divide each coordinate
    # by its own RMS and turn 1e-10 of rounding in a near-zero gradient into 1e-4 (the reversed cell's weights, measured)
    "optimizer=SGD",
    "lr=0.1",
    "sft_first.n_examples=null",
    "sample_during_eval=false",
    "eval_reward_functions=null",
    "plot_curves=false",
    "save_hf_export=false",
    "keep_checkpoints=0",  # all kept: the resume cell needs step-24
    "output_layer_chunk=null",  # the baseline takes all logits at once; the chunked cell takes CHUNK at a time
    "num_threads=1",
]
CHUNK = 3  # positions per output-layer call in the chunked cell (the tiny rows are 17-18 long)
RESUME_AT = 24  # the resume cell's checkpoint: mid-epoch, after 3 of 6 steps

LOGGED_PER_MICRO_BATCH = {  # objectives whose logged loss (not their gradient) depends on how the batch is split
    "sft": "its logged loss/train is the mean of each micro-batch's loss per target token (tests/test_metrics.py pins "
    "it), not the whole batch's; its gradient divides by the whole batch's tokens, so the weights agree",
}
NOT_TRAINED = {  # registered objectives the tiny pair runs cannot train, with the reason
    "reward": "it trains a score head (a sequence classifier), not the tiny causal LM",
}


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """The largest |loss difference| and |weight difference| a cell may show, and why."""

    loss: float
    weight: float
    why: str


# Losses, as |difference| / max(1, |loss|), and weights (SGD: lr x the gradients' difference, summed over 6 steps): the
# reversed cell, the same sums in another order, shows at most 6e-7 and 2e-7 over the 23 objectives on seeds 0 and 1
# (fp32 rounding: ~1e-7 relative); 1e-5 leaves a factor 17 and 50. The planted bugs move them by 1e-3 or more.
ONE_PROCESS = Tolerance(1e-5, 1e-5, "one process, the same sums in another order (fp32 rounding; the reversed cell's)")
SPLIT = Tolerance(1e-5, 1e-5, "the batch's sums split over micro-batches or ranks, reduced in another order")


@dataclasses.dataclass(frozen=True)
class Cell:
    """A path compared with the padded one-process baseline: its overrides, forward and how it runs."""

    name: str
    what: str
    overrides: tuple[str, ...] = ()
    packed: bool = False  # the in-process runs' forward (the processes of their own take the packed one)
    how: str = "in_process"  # in_process, reversed, resume, lora or process (train.py in a process of its own)
    tolerance: Tolerance = ONE_PROCESS
    splits_batch: bool = False  # the micro-batch coupled objectives differ by declaration
    needs_reference: bool = False  # not run for an objective without a reference


CELLS = {
    c.name: c
    for c in (
        Cell("reversed", "each batch's pairs in reverse order: the same loss, the rounding floor", how="reversed"),
        Cell("packed", "the packed forward (modeling/packing.py)", packed=True),
        Cell("chunked", f"the output layer {CHUNK} positions at a time", (f"output_layer_chunk={CHUNK}",)),
        Cell("precomputed", "the reference's log-probs precomputed", ("precompute_ref_log_probs=true",)),
        Cell("accum 8x1", "8 micro-batches of 1", ("gradient_accumulation_steps=8",), tolerance=SPLIT, splits_batch=True),
        Cell("accum 2x4", "2 micro-batches of 4", ("gradient_accumulation_steps=2",), tolerance=SPLIT, splits_batch=True),
        Cell("resume", f"stopped after {RESUME_AT} examples (its checkpoint), resumed", how="resume"),
        Cell(
            "lora",
            "LoRA r=4, the reference its adapters off, vs a separate copy of the base",
            ("model.lora.r=4",),
            how="lora",
            needs_reference=True,
        ),
        Cell(
            "fsdp",
            "FSDPTrainer, 2 ranks (gloo), packed",
            ("trainer=FSDPTrainer", "world_size=2"),
            how="process",
            tolerance=SPLIT,
            splits_batch=True,
        ),
        Cell(
            "tp",
            "TensorParallelTrainer, 2 ranks (gloo), packed",
            ("trainer=TensorParallelTrainer", "world_size=2"),
            how="process",
            tolerance=SPLIT,
        ),
        Cell(
            "fsdp x tp",
            "FSDP over 2 groups of 2 tensor-parallel ranks (4 processes), packed",
            ("trainer=FSDPTrainer", "world_size=4", "tensor_parallel_size=2"),
            how="process",
            tolerance=SPLIT,
            splits_batch=True,
        ),
        Cell(
            "ray reference",
            "launcher=ray, the reference on a Ray actor, packed",
            (
                "launcher=ray",
                "ray.reference_workers=1",
                "ray.num_cpus=2",
                "ray.cpus_per_worker=1",
                "ray.reference_resources={CPU: 0.5, GPU: 0}",
            ),
            how="process",
            needs_reference=True,
        ),
    )
}


@dataclasses.dataclass
class Result:
    """One cell of one objective: its differences, or why it has none."""

    loss_diff: float | None = None
    weight_diff: float | None = None
    note: str = ""  # "not run: ...", "failed: ...", or "declared" (differs by declaration)
    over: bool = False
    refusal: str = ""  # the config check's sentence of a refused cell

    @property
    def left_out(self) -> bool:
        """True when the command left it out (--objectives, --cells, --process-objectives): it ran nothing here."""
        return self.note.startswith("not run: left out by ")

    def text(self) -> str:
        """The table's entry."""
        if self.loss_diff is None:
            return self.note
        numbers = f"{self.loss_diff:.1e} / {self.weight_diff:.1e}"
        if self.over:
            return f"**over tolerance**: {numbers}"
        return f"differs by declaration: {numbers}" if self.note else numbers


def micro_batch_coupled() -> dict[str, str]:
    """Objective -> why its loss depends on the micro-batch's other pairs (``Objective.couples_micro_batch``): a cell that
    splits the batch (accumulation, data-parallel ranks) changes it by declaration."""
    import losses
    import objectives  # noqa: F401  (registers the objectives beyond SFT, DPO and IPO)

    return {n: o.couples_micro_batch for n, o in sorted(losses.OBJECTIVES.items()) if o.couples_micro_batch}


def trained_objectives() -> list[str]:
    """Every registered objective the tiny pair runs train (SFT on the chosen responses included), sorted."""
    import losses
    import objectives  # noqa: F401  (registers the objectives beyond SFT, DPO and IPO)

    return sorted(n for n in losses.OBJECTIVES if n not in NOT_TRAINED)


# ----------------------------------------------------------------------------- runs


def run_in_process(overrides: list[str], packed: bool, attach: Callable | None = None) -> Path:
    """train.main on ``overrides`` in this process, its forward packed or padded; returns the run folder."""
    import train

    def set_forward(trainer) -> None:
        trainer.packed = packed  # no config key: the baseline's padded forward is set on the trainer
        if attach is not None:
            attach(trainer)

    run_dir, stop_signal = train.main(equivalence_worker.compose(overrides), attach=set_forward)
    assert stop_signal is None, f"the run stopped on signal {stop_signal}"
    return Path(run_dir)


def cell_ranks(cell: Cell) -> int | None:
    """How many torchrun ranks a cell of processes of its own starts (its ``world_size``; None: the Ray cell's one driver)."""
    sizes = [int(o.split("=", 1)[1]) for o in cell.overrides if o.startswith("world_size=")]
    return sizes[0] if sizes else None


def resumed_copy(run_dir: Path, parent: Path) -> Path:
    """A copy of the finished ``run_dir`` cut back to its step-RESUME_AT checkpoint and resumed to the end."""
    cut = parent / run_dir.name
    shutil.copytree(run_dir, cut, symlinks=True)
    for step in cut.glob("step-*"):
        if int(step.name.removeprefix("step-")) > RESUME_AT:
            shutil.rmtree(step)
    (cut / "FINISHED").unlink(missing_ok=True)
    (cut / "LATEST").unlink()
    (cut / "LATEST").symlink_to(f"step-{RESUME_AT}")
    tracking.rewind_jsonl(str(cut / "metrics.jsonl"), RESUME_AT)  # what the run had logged when it stopped
    return cut


def reverse_batches(trainer) -> None:
    """Have ``trainer`` take each batch's B examples in reverse order (every objective's loss is a sum or mean over them)."""
    step = trainer.train_step

    def reversed_step(batch: dict) -> dict:
        n = len(batch["prompt"])
        flipped = {k: v.flip(0) if torch.is_tensor(v) and v.shape[:1] == (n,) else v for k, v in batch.items()}
        return step({k: v[::-1] if isinstance(v, list) and len(v) == n else v for k, v in flipped.items()})

    trainer.train_step = reversed_step


def separate_reference(trainer) -> None:
    """Give a LoRA trainer a separate copy of its base as the reference (through the remote-reference seam)."""
    import copy

    base = copy.deepcopy(trainer.peft_model).unload()  # the adapters are still zero: the base itself
    base.eval().requires_grad_(False)
    trainer.remote_reference = lambda batch: trainer.concatenated_forward(base, batch)[:2]


# ----------------------------------------------------------------------------- measures


def train_losses(run_dir: Path) -> dict[int, float]:
    """The run's train loss per step (metrics.jsonl's train records, by examples seen)."""
    records = tracking.jsonl_records(str(run_dir / "metrics.jsonl"))
    return {r["step"]: r["loss/train"] for r in records if "loss/train" in r}


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The policy's weights at the end (LATEST/policy.pt; a LoRA run's: its adapters)."""
    return torch.load(run_dir / "LATEST" / "policy.pt", weights_only=False, map_location="cpu")["state"]


def differences(baseline: Path, other: Path) -> tuple[float, float]:
    """(largest |loss difference| / max(1, |loss|) over the steps, largest |weight difference| at the end) of two runs."""
    a, b = train_losses(baseline), train_losses(other)
    if sorted(a) != sorted(b) or not a:
        raise RuntimeError(f"the runs logged other steps: {sorted(a)} vs {sorted(b)}")
    loss_diff = max(abs(a[s] - b[s]) / max(1.0, abs(a[s])) for s in a)
    wa, wb = final_weights(baseline), final_weights(other)
    if set(wa) != set(wb):
        raise RuntimeError(f"the runs saved other weights: {sorted(set(wa) ^ set(wb))[:3]}")
    weight_diff = max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)
    return loss_diff, weight_diff


# ----------------------------------------------------------------------------- the matrix


def skip_reason(name: str, cell: Cell) -> str | None:
    """Why ``cell`` is not run for objective ``name`` (None: it is)."""
    import losses

    loss_config = {k: v for k, v in equivalence_worker.compose([f"loss={name}"]).loss.items()}
    if cell.needs_reference and not losses.get_objective(name).uses_reference(loss_config):
        return f"not run: loss={name} uses no reference"
    if cell.name == "ray reference":
        try:
            import ray  # noqa: F401
        except ImportError:
            return "not run: ray absent"
    return None


def compare(name: str, cell: Cell, baseline: Path, other: Path) -> Result:
    """Cell ``cell`` of objective ``name``: the run ``other`` against ``baseline``, each difference against its tolerance."""
    loss_diff, weight_diff = differences(baseline, other)
    coupled = micro_batch_coupled()
    declared = cell.splits_batch and name in coupled.keys() | LOGGED_PER_MICRO_BATCH.keys()
    weights_declared = cell.splits_batch and name in coupled
    over = (not declared and loss_diff > cell.tolerance.loss) or (not weights_declared and weight_diff > cell.tolerance.weight)
    return Result(loss_diff, weight_diff, "declared" if declared else "", over)


def failed(e: Exception, what: str = "") -> Result:
    """The entry of a cell whose run (``what``: another run it needs) or comparison raised ``e`` (its traceback printed)."""
    traceback.print_exc()
    return Result(note=f"failed: {what}{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", over=True)


def cell_overrides(name: str, cell: Cell, tmp: Path) -> list[str]:
    """``python train.py``'s overrides of cell ``cell`` of objective ``name``, its runs under ``tmp``."""
    return [*BASE, f"loss={name}", f"output_root={tmp}", f"cache_dir={tmp / 'cache'}", *cell.overrides]


def run_cell(name: str, cell: Cell, baseline: Path, tmp: Path) -> Result:
    """One cell run in this process for objective ``name``: its run(s), compared with the padded baseline (or, LoRA, with
    its own)."""
    import utils

    overrides = cell_overrides(name, cell, tmp)
    try:
        if cell.how in ("in_process", "reversed"):
            other = run_in_process(overrides, cell.packed, reverse_batches if cell.how == "reversed" else None)
        elif cell.how == "resume":
            cut = resumed_copy(baseline, tmp / "cut")
            other = run_in_process([*overrides, f"resume={cut}"], cell.packed)
        else:  # lora
            baseline = run_in_process(overrides, False)  # the reference: the policy with its adapters off
            other = run_in_process(overrides, False, separate_reference)
        return compare(name, cell, baseline, other)
    except utils.ConfigError as e:
        return Result(note="not run: refused", refusal=str(e))
    except Exception as e:  # noqa: BLE001 - a cell that fails is reported, the others still run
        return failed(e)


def run_process_cell(
    cell: Cell, baselines: dict[str, Path], tmp: Path, on_done=None, extra: dict[str, list[str]] | None = None
) -> dict[str, Result]:
    """Cell ``cell`` of processes of its own for each objective of ``baselines`` (objective -> its baseline run), all in
    one launch (evaluation/equivalence_worker.py), an objective's ``extra`` overrides after the cell's: objective ->
    Result, each outcome attributed to its objective."""
    jobs = {n: [*cell_overrides(n, cell, tmp / n), *(extra or {}).get(n, [])] for n in baselines}
    outcomes = equivalence_worker.launch(jobs, cell_ranks(cell), tmp / "launches", on_done=on_done)
    results = {}
    for name, outcome in outcomes.items():
        if outcome.status == "refused":
            results[name] = Result(note="not run: refused", refusal=outcome.text)
        elif outcome.status == "failed":
            results[name] = Result(note=f"failed: {outcome.text}", over=True)
        else:
            try:
                results[name] = compare(name, cell, baselines[name], Path(outcome.text))
            except Exception as e:  # noqa: BLE001 - runs that cannot be compared are reported, the others still are
                results[name] = failed(e)
    return results


def run_matrix(names: list[str], cells: list[Cell], process_names: list[str] | None = None, progress: bool = True):
    """The cells ``cells`` of every objective in ``names`` (the cells of processes of their own only for
    ``process_names``, None: all): (objective, cell name) -> Result, every cell and objective named. The cells run in this
    process go objective by objective; each cell of processes of its own is one launch for all its objectives."""
    import tqdm

    results = {(n, c): Result(note="not run: left out by --objectives") for n in trained_objectives() for c in CELLS}
    for name in names:
        for cell in CELLS.values():
            left_out = "--process-objectives" if cell in cells else "--cells"
            results[name, cell.name] = Result(note=f"not run: left out by {left_out}")
    here = [c for c in cells if c.how != "process"]
    launched = {c: [n for n in names if process_names is None or n in process_names] for c in cells if c.how == "process"}
    bar = tqdm.tqdm(total=len(names) * len(here) + sum(map(len, launched.values())), unit="cell", disable=not progress)
    with tempfile.TemporaryDirectory(prefix="equivalence-") as folder:
        tmp = Path(folder)
        baselines = {}
        for name in names:
            bar.set_description(f"{name}: baseline")
            try:
                baselines[name] = run_in_process([*BASE, f"loss={name}", f"output_root={tmp / name / 'baseline'}"], False)
            except Exception as e:  # noqa: BLE001 - an objective without a baseline is reported, the others still run
                results.update(dict.fromkeys(((name, c.name) for c in cells), failed(e, "the baseline: ")))
                bar.update(len(here))
                continue
            for i, cell in enumerate(here):
                bar.set_description(f"{name}: {cell.name}")
                reason = skip_reason(name, cell)
                results[name, cell.name] = (
                    Result(note=reason) if reason else run_cell(name, cell, baselines[name], tmp / name / str(i))
                )
                bar.update()
        for i, (cell, cell_names) in enumerate(launched.items()):
            bar.set_description(f"{cell.name}: {len(cell_names)} objectives, one launch")
            reasons = {n: skip_reason(n, cell) for n in cell_names if n in baselines}
            results.update({(n, cell.name): Result(note=why) for n, why in reasons.items() if why})
            runs = {n: baselines[n] for n, why in reasons.items() if why is None}
            bar.update(len(cell_names) - len(runs))  # skipped, or without a baseline
            start = time.time()
            for name, result in run_process_cell(cell, runs, tmp / f"cell-{i}", on_done=lambda _: bar.update()).items():
                results[name, cell.name] = result
            bar.write(f"{cell.name}: {len(runs)} objectives in one launch, {time.time() - start:.0f} s")
    bar.close()
    return results


# ----------------------------------------------------------------------------- the table


def commit() -> str:
    """The repository's commit (with "+changes" when its tracked files differ from it)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=REPO, capture_output=True, text=True).stdout
    return head.strip() + (" +changes" if dirty.strip() else "")


def provenance(command: str, seconds: float) -> dict:
    """What docs/equivalence.json says of a command that wrote part of the matrix: its line, date, commit and time."""
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return {"command": command, "date": date, "commit": commit(), "seconds": round(seconds, 1)}


def merge(results: dict, command: dict, previous: dict | None = None) -> dict:
    """The matrix's JSON document: ``results`` ((objective, cell) -> Result) written by ``command`` (:func:`provenance`),
    over ``previous`` (a document; None: nothing): an entry this command left out (--objectives, --cells,
    --process-objectives) keeps the previous one's, with its command; every other entry is this command's.

    The document: ``{"commands": [provenance, ...], "results": {objective: {cell: {Result's fields, "by": the index of
    the command that wrote it, or None for an entry no command ran}}}}``, only the commands some entry names."""
    old = (previous or {}).get("results", {})
    commands = [*(previous or {}).get("commands", []), command]  # in the order they ran
    entries = {}
    for (name, cell), result in results.items():
        kept = old.get(name, {}).get(cell) if result.left_out else None
        entries[name, cell] = kept or {**dataclasses.asdict(result), "by": None if result.left_out else len(commands) - 1}
    used = sorted({e["by"] for e in entries.values() if e["by"] is not None})
    index = {old_index: new_index for new_index, old_index in enumerate(used)}
    document = {"commands": [commands[i] for i in used], "results": {}}
    for (name, cell), entry in entries.items():
        by = None if entry["by"] is None else index[entry["by"]]
        document["results"].setdefault(name, {})[cell] = {**entry, "by": by}
    return document


def json_text(document: dict) -> str:
    """A :func:`merge` document as JSON, one line per command and per entry (a merge's diff shows the entries it wrote)."""
    commands = ",\n".join(f"  {json.dumps(c)}" for c in document["commands"])
    objectives = ",\n".join(
        f"  {json.dumps(name)}: {{\n" + ",\n".join(f"   {json.dumps(c)}: {json.dumps(e)}" for c, e in cells.items()) + "\n  }"
        for name, cells in document["results"].items()
    )
    return f'{{\n "commands": [\n{commands}\n ],\n "results": {{\n{objectives}\n }}\n}}\n'


def read_json(path: Path) -> dict:
    """The document :func:`merge` wrote to ``path``; ValueError in one sentence if it is not one."""
    try:
        document = json.loads(path.read_text())
        for cells in document["results"].values():
            for entry in cells.values():
                Result(**{k: v for k, v in entry.items() if k != "by"})  # a TypeError names a field it does not know
        if not all(isinstance(c["command"], str) for c in document["commands"]):
            raise TypeError("a command is not a string")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not a matrix the command wrote ({e}); run the command once without --merge.") from None
    return document


def results_of(document: dict) -> tuple[dict, dict]:
    """((objective, cell) -> Result, (objective, cell) -> the index of its command or None) of a :func:`merge` document,
    for every trained objective and cell (an entry it lacks: not run)."""
    results, by = {}, {}
    for name in trained_objectives():
        for cell in CELLS:
            entry = document["results"].get(name, {}).get(cell, {"note": "not run: left out by --objectives", "by": None})
            results[name, cell] = Result(**{k: v for k, v in entry.items() if k != "by"})
            by[name, cell] = entry["by"]
    return results, by


def what_it_wrote(by: dict, index: int) -> str:
    """The cells command ``index`` wrote, each group of cells with the objectives it wrote them for."""
    everyone = trained_objectives()
    groups: dict[tuple, list[str]] = {}
    for cell in CELLS:
        names = tuple(n for n in everyone if by[n, cell] == index)
        if names:
            groups.setdefault(names, []).append(cell)
    parts = [
        f"{', '.join(cells)}: {f'all {len(everyone)} objectives' if list(names) == everyone else ', '.join(names)}"
        for names, cells in groups.items()
    ]
    return "; ".join(parts) or "nothing shown now"


def largest(results: dict, cell: str) -> str:
    """The largest loss and weight differences of ``cell`` over the objectives (declared differences left out)."""
    measured = [r for (_, c), r in results.items() if c == cell and r.loss_diff is not None and not r.note]
    if not measured:
        return "-"
    return f"{max(r.loss_diff for r in measured):.1e} / {max(r.weight_diff for r in measured):.1e}"


def write_table(document: dict, path: Path) -> None:
    """docs/equivalence.md from a :func:`merge` document: the objective x cell table, the tolerances, and each command
    that wrote part of it with its date and commit."""
    results, by = results_of(document)
    lines = [
        "# The equivalence matrix",
        "",
        "Every objective on every path against the one-process padded run of the same objective and seed (BasicTrainer",
        "with `trainer.packed = False`): the tiny random model on 48 arithmetic pairs, 6 SGD steps of 8 at lr 0.1, fp32 on",
        "CPU. Each cell is the largest |loss difference| over the steps (divided by max(1, |loss|): IPO's and SPPO's squared",
        "losses start at 25-50) / the largest |weight difference| of the policy at the end (a LoRA cell: of the adapters,",
        "against the LoRA run whose reference is a separate copy of the base). SGD, because its weight difference is lr x",
        "the gradients' difference: RMSprop and AdamW divide each coordinate by its own RMS, and the reversed cell (the same",
        "sums in another order) then differs by up to 1.3e-4 in the weights, hiding a path's error below that (SGD's steps",
        "2-6 move dpo's weights by up to 1.2e-2). The reversed cell is the floor: what fp32 rounding alone gives.",
        "",
        f"Written by these commands (the cells: [evaluation/equivalence.py](../evaluation/equivalence.py); every entry and "
        f"the command that wrote it: [{path.with_suffix('.json').name}]({path.with_suffix('.json').name}); `--merge` "
        "runs some cells again over it):",
        "",
    ]
    for i, c in enumerate(document["commands"]):
        took = f"{c['seconds'] / 60:.0f} minutes" if c["seconds"] >= 90 else f"{c['seconds']:.0f} s"
        lines.append(f"- `{c['command']}` on {c['date']} at commit {c['commit']} in {took}: {what_it_wrote(by, i)}.")
    lines += [
        "",
        "| cell | path | tolerance (loss / weight) | why | largest (loss / weight) |",
        "|---|---|---|---|---|",
    ]
    cells = list(CELLS.values())
    for c in cells:
        t = c.tolerance
        lines.append(f"| {c.name} | {c.what} | {t.loss:.0e} / {t.weight:.0e} | {t.why} | {largest(results, c.name)} |")
    lines += ["", "| objective | " + " | ".join(c.name for c in cells) + " |", "|---" * (len(cells) + 1) + "|"]
    for name in trained_objectives():
        lines.append(f"| {name} | " + " | ".join(results[name, c.name].text() for c in cells) + " |")
    lines += [""] + [f"- {n}: not run: {why}." for n, why in NOT_TRAINED.items()]
    lines += [f"- {n}, {c}: refused: {r.refusal}" for (n, c), r in results.items() if r.refusal]
    lines += [f"- {n}: differs by declaration where a cell splits the batch: {why}." for n, why in micro_batch_coupled().items()]
    lines += [
        f"- {n}: its loss differs by declaration where a cell splits the batch ({why})."
        for n, why in LOGGED_PER_MICRO_BATCH.items()
    ]
    lines.append("")
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    """The command line; exit 1 when a cell it ran is over its tolerance or failed."""
    parser = argparse.ArgumentParser(prog="python -m evaluation.equivalence", description=__doc__.split("\n")[0])
    parser.add_argument("--objectives", help="comma-separated objectives (default: every one the tiny runs train)")
    parser.add_argument("--cells", help=f"comma-separated cells (default: all: {', '.join(CELLS)})")
    parser.add_argument("--process-objectives", help="the objectives of the cells of processes of their own (default: all)")
    parser.add_argument("--out", default=str(DOC), help="where the table goes (default: docs/equivalence.md, and .json beside)")
    parser.add_argument(
        "--merge", action="store_true", help="start from the .json beside --out and overwrite only the cells this command runs"
    )
    args = parser.parse_args(argv)
    known = trained_objectives()
    names = args.objectives.split(",") if args.objectives else known
    process_names = args.process_objectives.split(",") if args.process_objectives else None
    cells = args.cells.split(",") if args.cells else list(CELLS)
    unknown = [x for x in [*names, *(process_names or [])] if x not in known] + [c for c in cells if c not in CELLS]
    if unknown:
        parser.error(f"unknown objectives or cells: {', '.join(unknown)}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    previous = None
    if args.merge:
        if not out.with_suffix(".json").exists():
            parser.error(f"--merge starts from {out.with_suffix('.json')}, which does not exist; run once without --merge.")
        try:
            previous = read_json(out.with_suffix(".json"))
        except ValueError as e:
            parser.error(str(e))
    start = time.time()
    results = run_matrix(names, [CELLS[c] for c in cells], process_names)
    command = shlex.join(["python", "-m", "evaluation.equivalence", *(argv if argv is not None else sys.argv[1:])])
    document = merge(results, provenance(command, time.time() - start), previous)
    out.with_suffix(".json").write_text(json_text(document))
    write_table(document, out)
    bad = [(n, c, r.text()) for (n, c), r in results.items() if r.over]
    for n, c, text in bad:
        print(f"loss={n}, {c}: {text}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    import data  # noqa: F401  (registers the datasets, as train.py does)

    sys.exit(main())
