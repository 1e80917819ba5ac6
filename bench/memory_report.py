"""bench_memory.py's figures and tables (parent side): each side's figures, issue 14's targets judged, results and profile as markdown."""

from __future__ import annotations

SIDES = ("ours", "trl")
GB = 1e9
TARGETS = (  # (config, figure, comparison, bound, text): issue 14's targets on a 2-core CPU
    ("dpo-full", "rss_ratio", "<=", 0.3, "DPO full, no AC: peak RSS <= 0.3x TRL's"),
    ("dpo-full", "speed_ratio", ">=", 4.0, "DPO full, no AC: pairs/s >= 4x TRL's"),
    ("dpo-full-ac", "ours_rss_gb", "<=", 4.0, "DPO full, AC on both: ours <= 4 GB"),
    ("dpo-lora", "speed_ratio", ">=", 3.0, "DPO LoRA: pairs/s >= 3x TRL-with-peft's"),
    ("dpo-lora", "rss_ratio", "<=", 0.3, "DPO LoRA: peak RSS <= 0.3x TRL-with-peft's"),
    ("dpo-lora-ac", "ours_rss_gb", "<=", 2.0, "DPO LoRA, AC: ours <= 2 GB"),
    ("sft", "speed_ratio", ">=", 2.0, "SFT: tokens/s >= 2x TRL SFTTrainer's"),
    ("sft", "rss_ratio", "<=", 0.5, "SFT: peak RSS <= 0.5x TRL SFTTrainer's"),
)


def side_figures(r: dict, task: str, batch_size: int, tokens_per_step: float) -> dict:
    """One side's figures from its worker result: pairs (or sequences) per second and tokens per
    second over the median measured step, peak RSS in MiB (the worker process's own) and GB."""
    return {
        "pairs_per_s": batch_size / r["step_s"],
        "tokens_per_s": tokens_per_step / r["step_s"],
        "per_s": (tokens_per_step if task == "sft" else batch_size) / r["step_s"],
        "step_s": r["step_s"],
        "steps_s": r["steps_s"],
        "rss_peak_mib": r["rss_peak"],
        "rss_peak_gb": r["rss_peak"] * 2**20 / GB,
        "rss_setup_mib": r["rss_setup"],
        "losses": r["losses"],
        "optimizer": r["optimizer"],
        "threads": r["threads"],
        "others_cpu": r["others_cpu"],
        "cpu_util": r["cpu_util"],
        "wall_s": r["wall_s"],
        **{k: r[k] for k in ("n_params", "n_trainable", "malloc_mmap_threshold_mib") if k in r},
    }


def verdicts(rows: list[dict]) -> list[dict]:
    """Issue 14's targets (TARGETS) against the rows: for each target, one entry per row of its
    configuration (ours as configured, then each ``--ours-variant`` row; a target with two figures
    of one configuration is judged on each row alone, so "in one run" holds), each {target, config,
    variant, label, value, bound, verdict}, verdict "pass", "FAIL" or "not measured" (its
    configuration not run, or a side failed)."""
    out = []
    for config, figure, op, bound, text in TARGETS:
        mine = [r for r in rows if r["config"] == config] or [{"label": config, "variant": []}]
        for row in mine:
            value = row.get(figure)
            if value is None:
                verdict = "not measured"
            else:
                verdict = "pass" if (value <= bound if op == "<=" else value >= bound) else "FAIL"
            entry = {"target": text, "config": config, "variant": row["variant"], "label": row["label"], "figure": figure}
            out.append({**entry, "value": value, "bound": bound, "verdict": verdict})
    return out


def _fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def results_markdown(rows: list[dict], checks: list[dict], title: str) -> str:
    """The table (one row per configuration, both sides and the ratios) and the targets, as markdown."""
    lines = [
        title,
        "",
        "| config | ours speed | TRL speed | speed ours/TRL | ours tokens/s | TRL tokens/s | ours peak RSS MiB | TRL MiB | RSS ours/TRL "
        "| ours GB | step-0 loss ours / TRL | max abs loss diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        o, t = r["ours"], r["trl"]

        def cell(side, key, spec=".2f"):
            if side is None:
                return "-"
            return "failed" if "error" in side else _fmt(side[key], spec)

        unit = " tok/s" if r["task"] == "sft" else " pairs/s"

        def speed(side, unit=unit):
            return cell(side, "per_s", ".3g") + (unit if side is not None and "error" not in side else "")

        loss0 = "-" if r["loss0"] is None else f"{r['loss0'][0]:.6f} / {r['loss0'][1]:.6f}"
        lines.append(
            f"| {r['label']} | {speed(o)} | {speed(t)} | {_fmt(r['speed_ratio'])} "
            f"| {cell(o, 'tokens_per_s', '.0f')} | {cell(t, 'tokens_per_s', '.0f')} | {cell(o, 'rss_peak_mib', '.0f')} "
            f"| {cell(t, 'rss_peak_mib', '.0f')} | {_fmt(r['rss_ratio'])} | {_fmt(r['ours_rss_gb'])} | {loss0} "
            f"| {_fmt(r['max_loss_diff'], '.1e')} |"
        )
    lines += ["", "| target (issue 14) | row | measured | verdict |", "|---|---|---|---|"]
    for c in checks:
        lines.append(f"| {c['target']} | {c['label']} | {_fmt(c['value'])} | {c['verdict']} |")
    failed = [f"{r['label']} {s}: {r[s]['error']}" for r in rows for s in SIDES if r[s] and "error" in r[s]]
    if failed:
        lines += ["", "Failed runs (first line of each error):", *[f"- {f}" for f in failed]]
    return "\n".join(lines) + "\n"


def _mib(n: float) -> str:
    return f"{n / 2**20:9.1f}"


def _held_lines(h: dict) -> list[str]:
    """The tensors held by the trainer (memory_profile.held_tensor_bytes) and their sum, one line each."""
    floor = h["policy_weights"] + h["reference_weights"] + h["gradients"] + h["optimizer_state"]
    return [
        f"{'tensors held by the trainer':50} {'MiB':>9} {'GB':>9}",
        *(
            f"  {label:48} {_mib(n)} {n / GB:9.2f}"
            for label, n in (
                (f"policy weights ({h['policy_params'] / 1e6:.1f}M parameters)", h["policy_weights"]),
                ("reference weights (a model of its own)", h["reference_weights"]),
                (f"gradients ({h['trainable_params'] / 1e6:.2f}M trainable, during a step)", h["gradients"]),
                ("optimizer state (AdamW exp_avg, exp_avg_sq)", h["optimizer_state"]),
                ("sum: the floor", floor),
            )
        ),
    ]


def profile_markdown(name: str, p: dict) -> str:
    """The memory profile of one configuration (memory_profile.worker_profile's result) as text."""
    lines = [
        f"### {name}: where ours' memory goes in one step ({p['tokens']} non-padding tokens, vocabulary {p['vocab']})",
        "",
        "```",
        *_held_lines(p["held"]),
        "",
        f"process RSS, MiB: after set-up {p['rss_setup']:.0f}; before the measured step {p['rss_before_step']:.0f}; "
        f"peak during it {p['rss_peak_step']:.0f} ({p['rss_peak_step'] * 2**20 / GB:.2f} GB; "
        f"+{p['rss_peak_step'] - p['rss_before_step']:.0f} over before); the step took {p['step_s']:.2f} s with the hooks",
    ]
    if p.get("peak_by_category"):
        cats = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in sorted(p["peak_by_category"].items(), key=lambda kv: -kv[1]) if v)
        lines += [
            f"tensor memory at the step's peak (torch.profiler memory timeline, at {p['peak_at_fraction_of_step']:.0%} "
            f"of the step): {p['peak_tensor_bytes'] / 2**20:.0f} MiB = {cats} MiB",
        ]
    else:
        lines.append(f"tensor memory by category: not available ({p.get('peak_by_category_error')})")
    total = max(p["saved_total"], 1)
    lines += ["", f"saved for backward by the policy's forward: {p['saved_total'] / 2**20:.0f} MiB (weights excluded), by part:"]
    for part, n in sorted(p["saved_by_part"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {part:58} {_mib(n)} MiB {n / total:6.1%}")
    lines.append("  largest saved tensors (part, shape, dtype, how many, MiB):")
    for s in p["saved_largest"]:
        wide = "  <- vocabulary-wide" if s["vocab_wide"] else ""
        lines.append(
            f"    {s['part'][:40]:40} {str(s['shape']):22} {s['dtype']:9} x{s['count']:<3} {s['bytes'] / 2**20:9.1f}{wide}"
        )
    if p["masks"]:
        n = sum(m["bytes"] for m in p["masks"])
        lines.append(
            f"attention masks given to the blocks in the policy's forward: {len(p['masks'])} distinct, {n / 2**20:.1f} MiB:"
        )
        for m in p["masks"]:
            lines.append(f"  {m['shape']} {m['dtype']}, {m['bytes'] / 2**20:.1f} MiB, given to {m['blocks_using_it']} blocks")
    else:
        lines.append("attention masks given to the blocks: none as tensors (the attention builds its own causal mask)")
    share = p["vocab_ops_self_cpu_s"] / max(p["ops_self_cpu_s"], 1e-9)
    ops = ", ".join(f"{k} {v:.2f} s" for k, v in p["vocab_ops"].items())
    lines += [
        f"time: ops with a {p['vocab']}-wide operand (output layer, log-softmax, their backward) "
        f"{p['vocab_ops_self_cpu_s']:.2f} s of {p['ops_self_cpu_s']:.2f} s self CPU time ({share:.0%}; that step "
        f"{p['timed_step_s']:.1f} s): {ops}",
        "```",
        "",
    ]
    return "\n".join(lines)
