"""Memory and speed on a real vocabulary: this project vs TRL 1.16, DPO (full and LoRA) and SFT, on CPU.

Issue 14's benchmark. SmolLM2-135M-Instruct (49,152-entry vocabulary; build it once with
``bash ../shared/scripts/get-smollm2.sh /tmp/smollm2``), real HH pairs (../shared/data/hh-rlhf),
batch 8, max_length 512, fp32, 2 threads, the SAME token ids on both sides: bench_dpo.py's
pieces, imported (its data preparation and the check that TRL's collator gives our batches,
its workers, its fairness settings: see ``python bench/bench_dpo.py --help``). Configurations
(``--configs``), each side of each in its own subprocess, so the peak RSS (the child's own
``ru_maxrss``) is its own; the parent imports no torch:

  dpo-full      DPO, full fine-tuning, live reference (ours: a second model; TRL: its ref model)
  dpo-full-ac   the same with activation checkpointing on both sides
  dpo-lora      DPO with LoRA r 16 (alpha 32, dropout 0) on q,k,v,o,gate,up,down projections;
                the reference is the base with the adapters disabled on both sides
                (ours ``model.lora.*``; TRL ``peft_config``, the same peft LoraConfig)
  dpo-lora-ac   the same with activation checkpointing
  sft           SFT on the chosen responses: ours ``loss=sft`` vs TRL's SFTTrainer (input_ids
                prompt + chosen, labels -100 on the prompt: the ids and labels of our batches,
                checked batch by batch against TRL's collator); tokens/s
  sft-ac        the same with activation checkpointing (not in the default set)

Equal settings on both sides: AdamW (torch's, unfused; lr --lr, no weight decay), constant
schedule, no warm-up, gradient clipping 1.0, sigmoid DPO loss (beta 0.1), no precompute,
sequential batches; activation checkpointing set explicitly on TRL's side (TRL 1.16's configs
default to ``gradient_checkpointing=True``; transformers 5.24 calls it activation_checkpointing),
non-reentrant on both. Speed: the median step after --warmup steps (pairs/s; SFT tokens/s, the
non-padding tokens of prompt + chosen); memory: peak RSS of the side's process (MiB; the targets
are in GB = 1e9 bytes). The table gives ours/TRL ratios from one run and issue 14's targets,
pass or fail; it is also written as results.md and results.json into --out. Each configuration
also gets a row of ours run again with ``--ours-variant`` (default ``malloc_mmap_threshold_mib=1``,
the CPU memory setting: utils.set_malloc_mmap_threshold) and, with ``--ours-preload LIBRARY``, a
row of ours with ``LD_PRELOAD=LIBRARY`` (tcmalloc, jemalloc), against the same TRL run; each
target is judged on each row alone.

``--profile``: where ours' memory goes in one step, for each chosen configuration (ours only):
the tensors held across steps (weights, reference, AdamW state; gradients during the step) and
their sum (the floor), process RSS before and at the peak of one step, tensor memory at that peak
by category (torch.profiler's memory timeline), what the policy's forward saves for backward by
where it is saved (output layer and log-probs, attention, MLP, blocks' norms, embeddings), the
attention masks given to the blocks, and the share of the step's op time in ops with a
vocabulary-sized operand (a light profiler over the same step). Written as profile.md and profile.json into --out.

    python bench/bench_memory.py                                   # all default configs, about 20 min
    python bench/bench_memory.py --configs dpo-full,sft --steps 2 --warmup 1
    python bench/bench_memory.py --ours-overrides output_layer_chunk=null   # ours on the previous path
    python bench/bench_memory.py --ours-variant                     # no second row of ours
    python bench/bench_memory.py --ours-preload /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4   # and a tcmalloc row
    python bench/bench_memory.py --profile --configs dpo-full,dpo-full-ac
    python bench/bench_memory.py --model ../shared/models/stories260K --batch-size 2 --max-length 128   # mechanics
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_dpo  # noqa: E402
import dpo_report  # noqa: E402
from dpo_prepare import HH, SHARED  # noqa: E402
from memory_profile import PROFILE_BATCHES, worker_profile  # noqa: E402
from memory_report import SIDES, profile_markdown, results_markdown, side_figures, verdicts  # noqa: E402
from memory_workers import worker_ours, worker_prepare, worker_trl, worker_trl_sft  # noqa: E402

DEFAULT_MODEL_DIRS = (Path("/tmp/smollm2"), SHARED / "models" / "smollm2-135m-instruct")
LORA = {  # issue 14: r 16 on the attention and MLP projections; dropout 0 (TRL disables dropout)
    "r": 16,
    "alpha": 32,
    "dropout": 0.0,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
CONFIGS = {  # name -> (task, LoRA, activation checkpointing)
    "dpo-full": ("dpo", False, False),
    "dpo-full-ac": ("dpo", False, True),
    "dpo-lora": ("dpo", True, False),
    "dpo-lora-ac": ("dpo", True, True),
    "sft": ("sft", False, False),
    "sft-ac": ("sft", False, True),
}
DEFAULT_CONFIGS = ["dpo-full", "dpo-full-ac", "dpo-lora", "dpo-lora-ac", "sft"]
OURS_VARIANT = ("malloc_mmap_threshold_mib=1",)  # the memory setting (utils.set_malloc_mmap_threshold): a row of its own


# ============================================================================ specs


def config_spec(base: dict, name: str, side: str, ours_overrides: list[str]) -> dict:
    """The worker spec of one side of configuration ``name``: ``base`` plus the task, LoRA and
    activation checkpointing (for ours as Hydra overrides of the project's config, for TRL as
    spec keys that trl_worker._trl_trainer / memory_workers._trl_sft_trainer read)."""
    task, lora, ac = CONFIGS[name]
    spec = {**base, "config": name, "task": task, "side": side, "mode": "live", "activation_checkpointing": ac}
    spec["lora"] = dict(LORA, r=base.get("lora_r", LORA["r"])) if lora else None
    if side == "ours":
        spec["loss"] = task  # our_worker._our_trainer: loss=<task> (and loss.beta for dpo)
        overrides = [f"activation_checkpointing={str(ac).lower()}"]
        if lora:
            targets = ",".join(spec["lora"]["target_modules"])
            overrides += [
                f"model.lora.r={spec['lora']['r']}",
                f"model.lora.alpha={spec['lora']['alpha']}",
                f"model.lora.dropout={spec['lora']['dropout']}",
                f"model.lora.target_modules=[{targets}]",
            ]
        spec["overrides"] = [*overrides, *ours_overrides]
    return spec


WORKERS = {
    "prepare": worker_prepare,
    "ours": worker_ours,
    "trl": worker_trl,
    "trl_sft": worker_trl_sft,
    "profile": worker_profile,
}


def compare(name: str, ours: dict | None, trl: dict | None, variant: list[str] | None = None) -> dict:
    """A table row: both sides' figures and the ratios ours / TRL (speed: pairs/s, or tokens/s for
    SFT; peak RSS), None where a side was not measured. ``variant``: the extra overrides ours ran
    with in this row (``--ours-variant``; TRL's side is the configuration's one TRL run)."""
    task, lora, ac = CONFIGS[name]
    label = " + ".join([name, *(variant or [])])
    row = {"config": name, "variant": list(variant or []), "label": label, "task": task, "lora": lora}
    row.update({"activation_checkpointing": ac, "ours": ours, "trl": trl})
    both = ours is not None and trl is not None and "error" not in ours and "error" not in trl
    row["speed_ratio"] = ours["per_s"] / trl["per_s"] if both else None
    row["rss_ratio"] = ours["rss_peak_mib"] / trl["rss_peak_mib"] if both else None
    row["ours_rss_gb"] = ours["rss_peak_gb"] if ours is not None and "error" not in ours else None
    row["loss0"] = [ours["losses"][0], trl["losses"][0]] if both else None
    row["max_loss_diff"] = max(abs(a - b) for a, b in zip(ours["losses"], trl["losses"])) if both else None
    return row


# ============================================================================ parent


def find_model(path: str | None) -> Path:
    """The SmolLM2 folder: ``path``, else the first of DEFAULT_MODEL_DIRS holding a config.json.

    Raises:
        SystemExit: one sentence naming the folder looked at and how to build it.
    """
    candidates = [Path(path)] if path else list(DEFAULT_MODEL_DIRS)
    for c in candidates:
        if (c / "config.json").is_file():
            return c
    where = candidates[0]
    raise SystemExit(
        f"Error: no model at {where} (no config.json there): build SmolLM2-135M-Instruct with "
        f"`bash {SHARED / 'scripts' / 'get-smollm2.sh'} {where}` (about a minute, 540 MB) or give --model DIR."
    )


def parse_configs(text: str) -> list[str]:
    """``--configs``: comma-separated names of CONFIGS, in the order given.

    Raises:
        argparse.ArgumentTypeError: naming an unknown configuration and the known ones.
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown configuration {unknown[0] if unknown else text!r}; choose from {', '.join(CONFIGS)}"
        )
    return names


def parse_sides(text: str) -> list[str]:
    """``--sides``: ours, trl or both (comma-separated)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in SIDES for n in names):
        raise argparse.ArgumentTypeError(f"--sides takes ours, trl or ours,trl, not {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    """The command line (defaults: issue 14's settings, sized to about 20 minutes in all)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="SmolLM2-135M-Instruct folder (default /tmp/smollm2; see get-smollm2.sh)")
    parser.add_argument(
        "--configs", type=parse_configs, default=DEFAULT_CONFIGS, help=f"comma-separated subset of {', '.join(CONFIGS)}"
    )
    parser.add_argument("--sides", type=parse_sides, default=list(SIDES), help="ours, trl or ours,trl (default both)")
    parser.add_argument(
        "--steps", type=int, default=2, help="measured steps per run (default 2: TRL takes about a minute a step)"
    )
    parser.add_argument("--warmup", type=int, default=1, help="steps run first, not measured (default 1)")
    parser.add_argument("--batch-size", type=int, default=8, help="pairs per step (default 8)")
    parser.add_argument("--max-length", type=int, default=512, help="prompt + response tokens (default 512)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, both sides (default 2)")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate, both sides (default 1e-4)")
    parser.add_argument("--beta", type=float, default=0.1, help="DPO beta (default 0.1)")
    parser.add_argument("--lora-r", type=int, default=LORA["r"], help="LoRA rank of the lora configs (default 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trl-optim", default="adamw_torch", help="TRL's optim (default adamw_torch = ours)")
    parser.add_argument(
        "--ours-variant",
        nargs="*",
        default=list(OURS_VARIANT),
        help="Hydra overrides of an extra row per configuration: ours again with them, against the same TRL run "
        f"(default {' '.join(OURS_VARIANT)}; give the flag alone for no such row)",
    )
    parser.add_argument(
        "--ours-preload",
        metavar="LIBRARY",
        help="another row per configuration: ours with LD_PRELOAD=LIBRARY (e.g. tcmalloc or jemalloc: docs/models.md, "
        "'Memory on CPU'), against the same TRL run",
    )
    parser.add_argument(
        "--ours-overrides", nargs="*", default=[], help="extra Hydra overrides for our side, e.g. output_layer_chunk=null"
    )
    parser.add_argument("--out", default="/tmp/bench_memory", help="folder for results.md / .json, profile.md / .json")
    parser.add_argument("--profile", action="store_true", help="instead of the benchmark: where ours' memory goes in one step")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds allowed to each worker process (default 1800)")
    parser.add_argument("--wait-quiet", type=float, default=30, help="before each run, wait up to this long for idle CPUs (s)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser


def spawn(role: str, spec: dict, tmp: Path, timeout: int) -> dict:
    """One worker of this file in a fresh interpreter (bench_dpo.spawn); a failed worker gives
    ``{"error": its last lines}`` instead of ending the benchmark."""
    try:
        return bench_dpo.spawn(role, spec, tmp, timeout=timeout, script=str(Path(__file__).resolve()))
    except SystemExit as e:
        text = str(e).strip().splitlines()
        errors = [line for line in text if "Error" in line or "error" in line.split(":")[0]]
        return {"error": (errors or text or ["unknown"])[-1][:300], "log": "\n".join(text[-40:])}


def check_inputs(args) -> Path:
    """The model folder (:func:`find_model`), after checking --ours-preload's library and the HH data exist.

    Raises:
        SystemExit: one sentence naming what is missing.
    """
    model = find_model(args.model)
    if args.ours_preload and not Path(args.ours_preload).is_file():
        raise SystemExit(
            f"Error: --ours-preload {args.ours_preload}: no such file; e.g. apt install libtcmalloc-minimal4 gives "
            "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4."
        )
    if not HH.exists():
        raise SystemExit(f"Error: {HH} is absent: this benchmark reads ../shared (the folder beside the repository).")
    return model


def run_profiles(args, base: dict, tmp: Path, out_dir: Path, setting: str) -> int:
    """--profile: ours' memory profile of each configuration, printed and written as profile.md / .json; the exit status."""
    text, profiles = [f"## bench_memory.py --profile: {setting}", ""], {}
    for name in args.configs:
        bench_dpo.wait_quiet(args.wait_quiet)
        r = spawn("profile", config_spec(base, name, "ours", args.ours_overrides), tmp, args.timeout)
        if "error" in r:
            print(f"profile {name}: FAILED: {r['error']}\n{r['log']}", flush=True)
            text.append(f"### {name}: failed: {r['error']}\n")
        else:
            r.pop("log", None)
            text.append(profile_markdown(name, r))
            print(text[-1], flush=True)
        profiles[name] = r
    (out_dir / "profile.md").write_text("\n".join(text))
    (out_dir / "profile.json").write_text(json.dumps({"args": vars(args), "setting": setting, "profiles": profiles}, indent=1))
    print(f"written: {out_dir / 'profile.md'}, {out_dir / 'profile.json'}")
    return 1 if any("error" in r for r in profiles.values()) else 0


def run_sides(args, base: dict, tmp: Path, name: str, per_step: float) -> dict:
    """Each of --sides of configuration ``name`` in its own worker, printed; {side: figures, or {"error"}, or None}."""
    task = CONFIGS[name][0]
    figures = {"ours": None, "trl": None}
    for side in args.sides:
        waited, _ = bench_dpo.wait_quiet(args.wait_quiet)
        role = "trl_sft" if (side, task) == ("trl", "sft") else side
        r = spawn(role, config_spec(base, name, side, args.ours_overrides), tmp, args.timeout)
        if "error" in r:
            figures[side] = {"error": r["error"]}
            print(f"{name:12} {side:4} FAILED: {r['error']}\n{r['log']}", flush=True)
            continue
        f = figures[side] = side_figures(r, task, args.batch_size, per_step)
        f["waited_s"] = waited
        unit = "tokens/s" if task == "sft" else "pairs/s"
        print(
            f"{name:12} {side:4} {f['per_s']:9.3f} {unit}, peak RSS {f['rss_peak_mib']:.0f} MiB ({f['rss_peak_gb']:.2f} GB), "
            f"steps {', '.join(f'{s:.1f}' for s in f['steps_s'])} s, step-0 loss {f['losses'][0]:.6f}, "
            f"other processes {f['others_cpu']:.2f} CPUs, run {f['wall_s']:.0f} s",
            flush=True,
        )
    return figures


def run_variant(args, base: dict, tmp: Path, name: str, extra: list[str], per_step: float) -> dict:
    """Ours of configuration ``name`` again with ``extra`` (--ours-variant's overrides, or LD_PRELOAD=...), printed; its figures."""
    task = CONFIGS[name][0]
    bench_dpo.wait_quiet(args.wait_quiet)
    preload = extra[0].startswith("LD_PRELOAD=")
    spec = config_spec(base, name, "ours", args.ours_overrides if preload else [*args.ours_overrides, *extra])
    if preload:
        spec["env"] = {"LD_PRELOAD": str(Path(args.ours_preload).resolve())}
    r = spawn("ours", spec, tmp, args.timeout)
    label = " + ".join([name, *extra])
    if "error" in r:
        print(f"{label} ours FAILED: {r['error']}\n{r['log']}", flush=True)
        return {"error": r["error"]}
    variant = side_figures(r, task, args.batch_size, per_step)
    unit = "tokens/s" if task == "sft" else "pairs/s"
    print(
        f"{label} ours {variant['per_s']:9.3f} {unit}, peak RSS {variant['rss_peak_mib']:.0f} MiB "
        f"({variant['rss_peak_gb']:.2f} GB), steps {', '.join(f'{s:.1f}' for s in variant['steps_s'])} s, "
        f"other processes {variant['others_cpu']:.2f} CPUs, run {variant['wall_s']:.0f} s",
        flush=True,
    )
    return variant


def run_configs(args, base: dict, tmp: Path, dpo_tokens: list[int], sft_tokens: list[int]) -> list[dict]:
    """Each configuration's sides, then its variants of ours; the table rows (:func:`compare`)."""
    rows = []
    for name in args.configs:
        tokens = sft_tokens if CONFIGS[name][0] == "sft" else dpo_tokens
        per_step = sum(tokens) / len(tokens)
        figures = run_sides(args, base, tmp, name, per_step)
        rows.append(compare(name, figures["ours"], figures["trl"]))
        variants = [args.ours_variant] if args.ours_variant else []
        variants += [[f"LD_PRELOAD={Path(args.ours_preload).name}"]] if args.ours_preload else []
        for extra in variants if "ours" in args.sides else []:
            rows.append(compare(name, run_variant(args, base, tmp, name, extra, per_step), figures["trl"], extra))
    return rows


def write_results(args, rows: list[dict], setting: str, prep: dict, out_dir: Path, started: float, code_before: str) -> int:
    """The table and the targets, printed and written as results.md / .json; the exit status."""
    checks = verdicts(rows)
    title = (
        f"## bench_memory.py, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs: ours vs TRL "
        f"{_version_or_absent('trl')} (peft {_version_or_absent('peft')}), {setting}"
    )
    text = results_markdown(rows, checks, title)
    if dpo_report._code_hash() != code_before:
        text += "\nWARNING: the project's code changed on disk during this run.\n"
    text += f"\ntotal wall time {time.time() - started:.0f} s\n"
    print("\n" + text)
    (out_dir / "results.md").write_text(text)
    (out_dir / "results.json").write_text(
        json.dumps({"args": vars(args), "setting": setting, "prepare": prep, "rows": rows, "targets": checks}, indent=1)
    )
    print(f"written: {out_dir / 'results.md'}, {out_dir / 'results.json'}")
    return 1 if any(r[s] and "error" in r[s] for r in rows for s in SIDES) else 0


def main(argv: list[str] | None = None) -> int:
    """Run the chosen configurations (or the profile) and write the tables; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.worker:
        bench_dpo.run_worker(args.worker, args.spec, args.result, workers=WORKERS)
        return 0
    model = check_inputs(args)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    n_batches = max(args.warmup + args.steps, PROFILE_BATCHES if args.profile else 1)
    n_pairs = n_batches * args.batch_size
    started, code_before = time.time(), dpo_report._code_hash()
    setting = (
        f"{model.name}, batch {args.batch_size}, max_length {args.max_length}, fp32, {args.threads} threads, "
        f"{args.steps} measured steps after {args.warmup}; {dpo_report._code_state()}"
        + (f"; ours with {' '.join(args.ours_overrides)}" if args.ours_overrides else "")
    )
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        base = bench_dpo.base_spec(args, tmp, n_pairs, lora_r=args.lora_r, model_dir=str(model), tokenizer_dir=str(model))
        prep = spawn("prepare", base, tmp, args.timeout)
        if "error" in prep:
            raise SystemExit(f"Error: preparing the pairs failed: {prep['error']}\n{prep['log']}")
        measured = slice(args.warmup, args.warmup + args.steps)
        dpo_tokens = prep["tokens_per_batch"][measured]
        sft_tokens = prep["sft_tokens_per_batch"][measured]
        print(
            f"{setting}\npairs: {prep['n_fitting']} of {prep['n_hh_pairs']} HH pairs fit max_length {args.max_length} "
            f"untruncated; {n_pairs} used; per measured batch {sum(dpo_tokens) / len(dpo_tokens):.0f} DPO tokens "
            f"(chosen + rejected), {sum(sft_tokens) / len(sft_tokens):.0f} SFT tokens (prompt + chosen); "
            "TRL's collators give our exact batches (checked).",
            flush=True,
        )
        if args.profile:
            return run_profiles(args, base, tmp, out_dir, setting)
        rows = run_configs(args, base, tmp, dpo_tokens, sft_tokens)
    return write_results(args, rows, setting, prep, out_dir, started, code_before)


def _version_or_absent(pkg: str) -> str:
    """The installed version of ``pkg``, or "absent"."""
    try:
        return dpo_report._version(pkg)
    except Exception:  # noqa: BLE001 - PackageNotFoundError
        return "absent"


if __name__ == "__main__":
    sys.exit(main())
