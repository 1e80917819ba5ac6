"""evaluate.py's outputs: results.json's content, the printed table, samples.html, the two plots and the model card."""

from __future__ import annotations

import html
import json
import os

from omegaconf import DictConfig

import utils
from evaluation import rewards, sampling
from evaluation.statistics import INTERVAL, KL_OF, MEAN_INTERVAL, mean_interval, win_rate_stats
from export import modelcard
from runs import checkpoints
from utils import ConfigError


def temperature_key(t: float) -> str:
    """A temperature as results.json's key: ``"0.25"``, ``"1"``, ``"0"`` (greedy)."""
    return f"{float(t):g}"


def summarize(
    rows: list[dict], config, policy: sampling.Source, baseline_label: str, reference: sampling.Source | None = None
) -> dict:
    """results.json's content: the settings and per temperature the win rates, a_ended, a_tokens, reward and KL intervals."""
    kind, temperatures = config.judge.name, {}
    for t in config.temperatures:
        mine = [r for r in rows if r["temperature"] == float(t)]
        stats = win_rate_stats([r["verdict"] for r in mine], config.max_failure_rate)
        stats["a_ended"] = sum(r["a_ended"] for r in mine) / len(mine) if mine else None
        stats["a_tokens"] = sum(r["a_tokens"] for r in mine) / len(mine) if mine else None
        # a judge that scores each response writes score_a and score_b (None where it failed); a pairwise one does not
        for side, prefix in (("score_a", "reward"), ("score_b", "baseline_reward")):
            scores = [x for x in ((r.get("detail") or {}).get(side) for r in mine) if x is not None]
            stats[f"{prefix}_mean"], stats[f"{prefix}_ci_low"], stats[f"{prefix}_ci_high"] = mean_interval(scores)
            stats[f"{prefix}_n"] = len(scores)
        kls = [r["kl"] for r in mine if r.get("kl") is not None]
        stats["kl_mean"], stats["kl_ci_low"], stats["kl_ci_high"] = mean_interval(kls)
        stats["kl_n"] = len(kls)
        temperatures[temperature_key(t)] = stats
    return {
        "policy": policy.label,
        "policy_path": source_path(policy),
        "baseline": baseline_label,
        "judge": kind,
        "reward_model": checkpoints.local_path(config.reward_model.name_or_path)
        if kind in ("reward_model", "reward_model_judge")
        else None,
        "reward_functions": list(config.reward_functions) if kind == "reward_function" else None,
        "reward_weights": list(config.reward_weights) if kind == "reward_function" and config.reward_weights else None,
        "judge_model": config.judge.model if kind == "http_judge" else None,
        "datasets": list(config.datasets),
        "n_prompts": config.n_prompts,
        "seed": config.seed,
        "max_new_tokens": config.max_new_tokens,
        "interval": INTERVAL,
        "reference": None if reference is None else reference.label,
        "kl_of": KL_OF,
        "mean_interval": MEAN_INTERVAL,
        "max_failure_rate": config.max_failure_rate,
        "temperatures": temperatures,
    }


def source_path(source: sampling.Source) -> str:
    """Where ``source``'s weights are: its checkpoint, hf or adapter folder (links resolved), or its hub id."""
    if source.weights is not None:
        return os.path.dirname(checkpoints.local_path(source.weights))
    return checkpoints.local_path(source.adapter or source.model_config.name_or_path)


def _with_interval(mean, low, high) -> str:
    """``mean [low, high]`` to 3 decimals; ``-`` for none, no interval for one value."""
    if mean is None:
        return "-"
    return f"{mean:.3f}" + ("" if low is None else f" [{low:.3f}, {high:.3f}]")


def results_table(results: dict) -> str:
    """The per-temperature results as a Markdown table."""
    lines = [
        "| temperature | win rate | 95% interval | tie rate | loss rate | n | failed | baseline reward [95%] | reward [95%] | KL [95%] |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t, r in results["temperatures"].items():
        baseline, reward, kl = (
            _with_interval(r.get(f"{k}_mean"), r.get(f"{k}_ci_low"), r.get(f"{k}_ci_high"))
            for k in ("baseline_reward", "reward", "kl")
        )
        if r["win_rate"] is None:
            rate = "- | - | - | - | 0"
        else:
            rate = (
                f"{r['win_rate']:.3f} | [{r['ci_low']:.3f}, {r['ci_high']:.3f}] | {r['tie_rate']:.3f} | {r['loss_rate']:.3f}"
                f" | {r['n']}"
            )
        lines.append(f"| {t} | {rate} | {r['failed']} | {baseline} | {reward} | {kl} |")
    return "\n".join(lines)


def plot_series(results: dict, others: list) -> list[dict]:
    """This evaluation's line and those of the evaluation folders (or results.json files) in ``plot_with``."""
    series = [{"label": results["policy"], "temperatures": results["temperatures"]}]
    for other in others:
        path = os.path.join(other, "results.json") if os.path.isdir(other) else other
        if not os.path.isfile(path):
            raise ConfigError(f"plot_with={other} holds no results.json; give the folders of finished evaluations.")
        with open(path) as f:
            got = json.load(f)
        label = got["policy"] + ("" if got["baseline"] == results["baseline"] else f" (vs {got['baseline']})")
        series.append({"label": label, "temperatures": got["temperatures"]})
    return series


def judge_text(config: DictConfig) -> str:
    """The judge as the plot names it: ``reward_model <folder>``, ``http_judge <model>`` or ``reward_function <a+b>``."""
    kind = config.judge.name
    if kind in ("reward_model", "reward_model_judge"):
        path = checkpoints.local_path(config.reward_model.name_or_path)
        if os.path.isdir(path):
            run_dir = sampling._enclosing_run(path)
            path = f"{os.path.basename(run_dir)}/{os.path.relpath(path, run_dir)}" if run_dir else os.path.basename(path)
        return f"{kind} {path}"
    if kind == "http_judge":
        return f"{kind} {config.judge.model}"
    return f"{kind} {'+'.join(str(f) for f in config.reward_functions)}"


def win_rates_title(n_prompts: int, judge: str) -> str:
    """win_rates.png's title: how many prompts and which judge (:func:`judge_text`)."""
    return f"{n_prompts} prompts, judge: {judge}\n(bands: 95% Wilson interval)"


def plot_win_rates(series: list[dict], path: str, baseline: str, title: str) -> str:
    """Draw win rate against temperature to ``path``: a line and 95% band per series, 0.5 dashed; returns the drawn title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    for s in series:
        points = sorted((float(t), r) for t, r in s["temperatures"].items() if r.get("win_rate") is not None)
        if not points:
            continue
        xs = [t for t, _ in points]
        (line,) = ax.plot(xs, [r["win_rate"] for _, r in points], marker="o", label=s["label"])
        ax.fill_between(
            xs, [r["ci_low"] for _, r in points], [r["ci_high"] for _, r in points], color=line.get_color(), alpha=0.2
        )
    ax.axhline(0.5, color="gray", linestyle="--", linewidth=0.8)
    ax.set_ylim(0, 1)
    ax.set_xlabel("sampling temperature (0 = greedy)")
    others = any(s["label"].endswith(")") and " (vs " in s["label"] for s in series)  # plot_with lines of another baseline
    ax.set_ylabel(f"win rate vs {baseline}" + (" (or as named)" if others else ""))
    ax.set_title(title, fontsize=9)
    shown = ax.get_title()
    if any(line.get_label() and not line.get_label().startswith("_") for line in ax.get_lines()):
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    with utils.replacing(path) as tmp:  # a link at path is replaced, not written through
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    return shown


def _bar(r: dict, name: str, end: str) -> float:
    """An error bar's length: from ``<name>_mean`` to its interval's ``end`` (0 without an interval)."""
    bound = r.get(f"{name}_ci_{end}")
    return 0.0 if bound is None else abs(bound - r[f"{name}_mean"])


def plot_reward_kl(series: list[dict], path: str, judge: str) -> None:
    """Draw A's mean reward against its KL to ``path``: a point with 95% bars per series and temperature that has both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    drawn = 0
    for s in series:
        points = sorted(
            (float(t), r)
            for t, r in s["temperatures"].items()
            if r.get("reward_mean") is not None and r.get("kl_mean") is not None
        )
        if not points:
            continue
        xs, ys = [r["kl_mean"] for _, r in points], [r["reward_mean"] for _, r in points]
        xerr, yerr = ([[_bar(r, name, end) for _, r in points] for end in ("low", "high")] for name in ("kl", "reward"))
        ax.errorbar(xs, ys, xerr=xerr, yerr=yerr, fmt="o", capsize=2, label=s["label"])
        for (t, _), x, y in zip(points, xs, ys):
            ax.annotate(f"T={t:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        drawn += len(points)
    if not drawn:
        why = "no point: the reward (pairwise judge) or the KL (no reference) is null"
        ax.text(0.5, 0.5, why, ha="center", fontsize=8, transform=ax.transAxes)
    ax.set_xlabel("KL(policy || reference), nats (mean over samples)")
    ax.set_ylabel(f"mean reward ({judge})")
    ax.set_title("reward against KL (bars: 95% t intervals over prompts)", fontsize=9)
    if drawn:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    with utils.replacing(path) as tmp:  # a link at path is replaced, not written through
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)


def write_html(rows: list[dict], path: str, title: str) -> None:
    """A page of side-by-side samples per temperature: prompt, A, B, verdict and why; all text escaped."""
    esc = html.escape
    names = {0: "A better", 1: "B better", rewards.TIE: "tie", None: "failed"}
    parts = [
        "<!doctype html><meta charset='utf-8'>",
        f"<title>{esc(title)}</title>",
        "<style>body{font-family:sans-serif}td{vertical-align:top;white-space:pre-wrap;border:1px solid #ccc;padding:4px;max-width:40em}"
        ".win{background:#dfd}.loss{background:#fdd}.tie{background:#eee}.failed{background:#fd9}</style>",
        f"<h1>{esc(title)}</h1>",
    ]
    for t in sorted({r["temperature"] for r in rows}):
        parts.append(
            f"<h2>temperature {esc(temperature_key(t))}</h2><table><tr><th>#</th><th>prompt</th><th>A</th><th>B</th><th>verdict</th></tr>"
        )
        for r in (r for r in rows if r["temperature"] == t):
            d = r.get("detail") or {}
            if "score_a" in d:
                why = f"scores A {d['score_a']}, B {d['score_b']}"
            elif d.get("identical"):
                why = "identical responses"
            else:
                why = f"A first: {names.get(d.get('a_first'))}; B first: {names.get(1 - d['b_first'] if d.get('b_first') in (0, 1) else d.get('b_first'))}"
            parts.append(
                f"<tr class='{esc(r['verdict'])}'><td>{esc(r['id'])}</td><td>{esc(r['judge_prompt'])}</td><td>{esc(r['a'])}</td>"
                f"<td>{esc(r['b'])}</td><td>{esc(r['verdict'])}<br><small>{esc(why)}</small></td></tr>"
            )
        parts.append("</table>")
    utils.write_atomic(path, "\n".join(parts) + "\n")


def write_and_report(
    config, out: str, rows: list[dict], results: dict, errors: list, policy: sampling.Source, baseline_label: str
) -> None:
    """Rank 0's outputs: results.json, verdicts.jsonl, samples.html, the two plots, the printed table and warnings, the model card."""
    utils.write_atomic(os.path.join(out, "results.json"), json.dumps(results, indent=2) + "\n")
    utils.write_atomic(os.path.join(out, "verdicts.jsonl"), "".join(json.dumps(r) + "\n" for r in rows))
    title = f"{policy.label} vs {baseline_label}, judge {config.judge.name}"
    write_html(rows, os.path.join(out, "samples.html"), title)
    series = plot_series(results, list(config.plot_with or []))
    wins_title = win_rates_title(len({r["id"] for r in rows}), judge_text(config))
    plot_win_rates(series, os.path.join(out, "win_rates.png"), baseline_label, wins_title)
    plot_reward_kl(series, os.path.join(out, "reward_kl.png"), config.judge.name)
    print(f"{title} ({INTERVAL}):\n{results_table(results)}")
    print(
        f"reward: {policy.label}'s mean score, baseline reward: {baseline_label}'s, on the same prompts; reward and KL: "
        f"{MEAN_INTERVAL}; KL against {results['reference']}: {KL_OF}."
    )
    for t, r in results["temperatures"].items():
        if r["too_many_failures"]:
            print(
                f"Warning: at temperature {t}, {r['failed']} of {r['failed'] + r['n']} judgements failed "
                f"({r['failure_rate']:.0%} > max_failure_rate={config.max_failure_rate}); the win rate is over the other {r['n']}"
                + (f" (e.g. {errors[0]})." if errors else ".")
            )
    print(f"Results: {os.path.join(out, 'results.json')}, win_rates.png, reward_kl.png, samples.html")
    if not all(r["verdict"] == "failed" for r in rows):
        update_card(policy, out)


def update_card(policy: sampling.Source, out: str) -> None:
    """Add this evaluation to the model cards of the checkpoint ``policy`` is, if it is one, and print which."""
    if policy.weights is None or policy.run_dir is None:
        return
    checkpoint = os.path.dirname(policy.weights)  # the step-N folder resolved when the policy was named
    try:
        cards = modelcard.add_evaluation(checkpoint, policy.run_dir, out)
    # a read-only run folder, a checkpoint pruned meanwhile: the results are written all the same
    except (OSError, ValueError) as e:
        print(f"Warning: the model card of {checkpoint} could not be updated with this evaluation ({utils.failure_reason(e)}).")
        return
    if cards:
        print(f"Model card updated with this evaluation: {', '.join(cards)}")
