"""The sentiment frontier's numbers from the outputs of its runs (scripts/frontier.py makes them): the reference from
many samples, Best-of-N picked by the true reward and by a learned reward model, each trained method's point as the
mean over training seeds with a t interval across seeds, the label budgets of offline and online DPO; and the table
and the plot."""

from __future__ import annotations

import math

from evaluation import report, statistics

REWARD = "sentiment"
TEMPERATURE = 1.0  # the evaluation's and the sampling's: at 1 (no top-k / top-p) the KL estimate is unbiased
KL_BOUND = "log N - (N-1)/N, an upper bound (Beirami et al. 2024)"
CAPTION = (
    "Points: mean over training seeds, bars: 95% t interval across seeds (reference and Best-of-N by the true reward: "
    "over prompts).\nBest-of-N's KL is the bound log N - (N-1)/N (Beirami et al. 2024). PPO is not implemented here."
)


def best_of_n_kl(n: int) -> float:
    """Best-of-N's KL from the reference, log N - (N - 1) / N nats: an upper bound of the true KL (Beirami et al. 2024,
    Theorem 1; the "usual formula" of Stiennon et al. 2020 and others), for any rule that picks one of N i.i.d. samples."""
    return math.log(n) - (n - 1) / n


def _scored(s: float | None) -> bool:
    return s is not None and not math.isnan(s)


def scores_by_prompt(samples: list[dict], key: str = "score") -> list[list]:
    """Each prompt's values of ``key`` (``row``: the whole row) in the order drawn, from make_pairs.py's samples (rows
    ``{id, score, ...}``)."""
    grouped: dict[str, list] = {}
    for s in samples:
        grouped.setdefault(s["id"], []).append(s if key == "row" else s[key])
    return list(grouped.values())


def best_of_n(scores: list[list[float | None]], n: int) -> list[float]:
    """Best-of-N's reward per prompt: the highest of its first ``n`` scores (None: failed, left out); a prompt whose
    first ``n`` all failed gives none.

    Args:
        scores: per prompt, its samples' scores in the order they were drawn (at least ``n`` each).
    """
    best = []
    for row in scores:
        if len(row) < n:
            raise ValueError(f"Best-of-{n} needs {n} samples per prompt, a prompt has {len(row)}.")
        got = [s for s in row[:n] if _scored(s)]
        if got:
            best.append(max(got))
    return best


def best_of_n_by(picker: list[list[float]], scores: list[list[float | None]], n: int) -> list[float]:
    """Best-of-N by another scorer: per prompt, the true score of the sample that ``picker`` ranks first among the first
    ``n`` (the earliest of equal picker scores); a prompt whose pick has no true score (failed) gives none.

    Args:
        picker: per prompt, the picking scorer's scores (a reward model's), in the order drawn.
        scores: per prompt, the true scores of the same samples (the reward function's).
    """
    if len(picker) != len(scores):
        raise ValueError(
            f"Best-of-N by a reward model got {len(picker)} prompts' picker scores and {len(scores)} prompts' scores."
        )
    picked = []
    for ranks, truth in zip(picker, scores):
        if min(len(ranks), len(truth)) < n:
            raise ValueError(f"Best-of-{n} needs {n} samples per prompt, a prompt has {min(len(ranks), len(truth))}.")
        first = max(range(n), key=lambda i: ranks[i])  # max keeps the first of equals
        if _scored(truth[first]):
            picked.append(truth[first])
    return picked


def mean_row(method: str, label: str, values: list[float], kl_mean: float, **extra) -> dict:
    """A row whose reward is the mean of ``values`` with its 95% t interval (over prompts) and whose KL is ``kl_mean``."""
    mean, low, high = statistics.mean_interval(values)
    row = {"method": method, "label": label, "beta": None, "reward_mean": mean, "reward_ci_low": low, "reward_ci_high": high}
    return {**row, "reward_n": len(values), "kl_mean": kl_mean, "kl_ci_low": None, "kl_ci_high": None, **extra}


def reference_row(scores: list[list[float | None]]) -> dict:
    """The reference's row: per prompt the mean of all its samples' scores, then their mean over prompts with a t
    interval over prompts; KL 0 (the model against itself)."""
    per_prompt = [math.fsum(got) / len(got) for got in ([s for s in row if _scored(s)] for row in scores) if got]
    k = max(len(row) for row in scores)
    return mean_row("reference", f"reference ({k} samples)", per_prompt, 0.0, kl="the model itself", samples_per_prompt=k)


def bon_rows(samples: list[dict], sizes: list[int]) -> list[dict]:
    """Best-of-N's rows from make_pairs.py's samples (in the order drawn, grouped by prompt id), picked by their scores."""
    scores = scores_by_prompt(samples)
    return [
        mean_row("Best-of-N", f"Best-of-{n}", best_of_n(scores, n), best_of_n_kl(n), n=n, kl=f"bound {KL_BOUND}") for n in sizes
    ]


def bon_rm_rows(samples: list[dict], rm_scores: list[float], sizes: list[int]) -> list[dict]:
    """One seed's Best-of-N(RM) rows: the true score of the sample the reward model ranks first among each prompt's
    first N, its mean over prompts with a t interval over prompts; ``rm_scores`` one per sample, in the samples' order."""
    if len(rm_scores) != len(samples):
        raise ValueError(f"{len(rm_scores)} reward-model scores for {len(samples)} samples; score every sample once.")
    picker = scores_by_prompt([{**s, "rm": r} for s, r in zip(samples, rm_scores)], "rm")
    scores = scores_by_prompt(samples)
    method = "Best-of-N (reward model)"
    return [
        mean_row(method, f"Best-of-{n} (RM)", best_of_n_by(picker, scores, n), best_of_n_kl(n), n=n, kl=f"bound {KL_BOUND}")
        for n in sizes
    ]


def pair_accuracy(chosen: list[float], rejected: list[float]) -> float:
    """The share of pairs whose chosen scores above its rejected (a tie counts half; chance 0.5)."""
    if not chosen or len(chosen) != len(rejected):
        raise ValueError(
            f"pair accuracy needs as many chosen as rejected scores (at least one), got {len(chosen)} and {len(rejected)}."
        )
    return math.fsum(1.0 if c > r else 0.5 if c == r else 0.0 for c, r in zip(chosen, rejected)) / len(chosen)


# ----------------------------------------------------------------------------- across seeds

SEED_KEYS = ("reward_mean", "reward_ci_low", "reward_ci_high", "kl_mean", "kl_ci_low", "kl_ci_high", "win_rate_vs_reference")


def across_seeds(per_seed: dict[int, dict], names: tuple[str, ...] = ("reward", "kl")) -> dict:
    """One point from a method's rows, one per training seed: each ``<name>_mean`` of ``names`` is the mean over seeds
    of the per-seed means, with the 95% t interval over those per-seed means (mean +- t(0.975, S-1) sd / sqrt(S));
    the win rate's mean over seeds; each seed's own values under ``per_seed``.

    Args:
        per_seed: training seed -> that seed's row (a mean over prompts and its interval over prompts, per name).
        names: the quantities to aggregate; any other ``<name>_mean`` is taken from the first seed (a KL bound).
    """
    if not per_seed:
        raise ValueError("a point across seeds needs at least one seed's row.")
    first = next(iter(per_seed.values()))
    row = {k: v for k, v in first.items() if k not in SEED_KEYS and k not in ("eval", "ended", "tokens", "reward_n")}
    row.update({k: first[k] for k in ("kl_mean", "kl_ci_low", "kl_ci_high") if "kl" not in names})
    for name in names:
        mean, low, high = statistics.mean_interval([r[f"{name}_mean"] for r in per_seed.values()])
        row.update({f"{name}_mean": mean, f"{name}_ci_low": low, f"{name}_ci_high": high})
    wins = [r.get("win_rate_vs_reference") for r in per_seed.values()]
    row["win_rate_vs_reference"] = math.fsum(wins) / len(wins) if None not in wins else None
    row["interval"] = "across seeds"
    row["seeds"] = list(per_seed)
    keep = (*SEED_KEYS, "reward_n", "ended", "tokens", "eval")
    row["per_seed"] = [{"seed": s, **{k: r[k] for k in keep if k in r}} for s, r in per_seed.items()]
    return row


def row_from_eval(results: dict, method: str, label: str, beta: float | None) -> dict:
    """One seed's row from an evaluate.py folder's results.json (temperature 1): mean reward and KL, their intervals over prompts."""
    r = results["temperatures"][report.temperature_key(TEMPERATURE)]
    keys = ("reward_mean", "reward_ci_low", "reward_ci_high", "kl_mean", "kl_ci_low", "kl_ci_high", "reward_n")
    row = {"method": method, "label": label, "beta": beta, **{k: r[k] for k in keys}}
    row.update(kl="Monte Carlo", win_rate_vs_reference=r["win_rate"], ended=r["a_ended"], tokens=r["a_tokens"])
    return row


# ----------------------------------------------------------------------------- label budgets


def offline_budget(samples: list[dict], n_pairs: int) -> dict:
    """Offline DPO's label budget from make_pairs.py's train samples: one reward-function call per completion; every
    two distinct scored completions of a prompt compared (online/make_pairs.py's ``make_pairs``), the ties among them
    dropped, the rest the labelled pairs, which must be the pairs file's ``n_pairs`` rows (ValueError otherwise: the
    samples are not that file's)."""
    from online.make_pairs import make_pairs

    labelled = ties = 0
    for rows in scores_by_prompt(samples, "row"):
        pairs, tied, _ = make_pairs([r["completion"] for r in rows], [r["score"] for r in rows])
        labelled, ties = labelled + len(pairs), ties + tied
    if labelled != n_pairs:
        raise ValueError(f"the samples give {labelled} labelled pairs ({ties} ties), the pairs file {n_pairs}: not its samples.")
    return {"reward_function_calls": len(samples), "pairs_compared": labelled + ties, "ties": ties, "pairs_labelled": labelled}


def online_budget(records: list[dict]) -> dict:
    """Online DPO's label budget from its metrics.jsonl records: one pair compared per prompt (two completions, two
    reward-function calls); each train record's means of ``online/labelled_pairs`` (1: trained on) and ``online/ties``
    times its prompts (``counters/examples`` since the record before) count the labelled pairs and the ties."""
    seen = compared = 0
    labelled = ties = 0.0
    for r in records:
        if "online/labelled_pairs" not in r:
            continue  # an eval record
        n = round(r["counters/examples"]) - seen  # logged as a float
        seen += n
        compared += n
        labelled += r["online/labelled_pairs"] * n
        ties += r["online/ties"] * n
    return {
        "reward_function_calls": 2 * compared,
        "pairs_compared": compared,
        "ties": round(ties),
        "pairs_labelled": round(labelled),
    }


# ----------------------------------------------------------------------------- the table and the plot


def _bar(r: dict, name: str, end: str) -> float:
    """An error bar's length from ``<name>_mean`` to ``<name>_ci_<end>`` (0 without an interval)."""
    bound = r.get(f"{name}_ci_{end}")
    return 0.0 if bound is None else abs(bound - r[f"{name}_mean"])


def _cell(mean, low, high, digits: int) -> str:
    if mean is None:
        return "-"
    text = f"{mean:.{digits}f}"
    return text + (f" [{low:.{digits}f}, {high:.{digits}f}]" if low is not None else "")


def _per_seed(r: dict, name: str, digits: int) -> str:
    if name == "kl" and r["method"].startswith("Best-of-N"):
        return "-"
    return ", ".join(f"{s[f'{name}_mean']:.{digits}f}" for s in r.get("per_seed", [])) or "-"


def frontier_table(rows: list[dict]) -> str:
    """The markdown table: one row per point, in the order given; its interval is across seeds for a trained method and
    Best-of-N (RM), over prompts for the reference and Best-of-N by the true reward."""
    lines = [
        "| method | β | reward [95%] | KL, nats [95%] | reward per seed | KL per seed | win rate vs reference | interval |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        beta = "-" if r["beta"] is None else f"{r['beta']:g}"
        win = "-" if r.get("win_rate_vs_reference") is None else f"{r['win_rate_vs_reference']:.2f}"
        reward = _cell(r["reward_mean"], r["reward_ci_low"], r["reward_ci_high"], 3)
        kl = (
            f"≤ {r['kl_mean']:.2f}"
            if r["method"].startswith("Best-of-N")
            else _cell(r["kl_mean"], r["kl_ci_low"], r["kl_ci_high"], 2)
        )
        over = f"{len(r['seeds'])} seeds" if "seeds" in r else f"{r['reward_n']} prompts"
        cells = [r["label"], beta, reward, kl, _per_seed(r, "reward", 3), _per_seed(r, "kl", 2), win, over]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def budget_table(offline: dict, online: dict[int, dict]) -> str:
    """The label budgets: offline DPO's (its pairs file) and online DPO's, one row per seed (its own samples tie differently)."""
    lines = [
        "| run | pairs labelled (trained on) | pairs compared | ties among them | reward-function calls |",
        "|---|---|---|---|---|",
    ]
    rows = [("offline DPO (make_pairs.py, all seeds)", offline)] + [(f"online DPO, seed {s}", b) for s, b in online.items()]
    for name, b in rows:
        lines.append(
            f"| {name} | {b['pairs_labelled']:,} | {b['pairs_compared']:,} | {b['ties']:,} | {b['reward_function_calls']:,} |"
        )
    return "\n".join(lines) + "\n"


STYLE = {  # family -> (marker, colour, line)
    "reference": ("*", "black", "none"),
    "DPO": ("o", "tab:blue", "-"),
    "IPO": ("s", "tab:orange", "none"),
    "cDPO": ("D", "tab:purple", "none"),
    "online DPO": ("^", "tab:red", "none"),
    "Preferred-FT": ("v", "tab:green", "none"),
    "Best-of-N": ("P", "tab:gray", "--"),
    "Best-of-N (reward model)": ("X", "tab:brown", ":"),
}


def plot_frontier(rows: list[dict], path, title: str) -> None:
    """Reward (y) against KL (x), one point per method (the mean over seeds) with its 95% intervals as bars on both axes,
    labelled; DPO's betas joined in KL order, Best-of-N's sizes by a dashed line, Best-of-N (RM)'s by a dotted one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5.4))
    for family, (marker, colour, line) in STYLE.items():
        mine = sorted((r for r in rows if r["method"] == family), key=lambda r: r["kl_mean"])
        if not mine:
            continue
        xs, ys = [r["kl_mean"] for r in mine], [r["reward_mean"] for r in mine]
        xerr, yerr = ([[_bar(r, name, end) for r in mine] for end in ("low", "high")] for name in ("kl", "reward"))
        style = line if len(mine) > 1 else "none"
        ax.errorbar(
            xs, ys, xerr=xerr, yerr=yerr, marker=marker, color=colour, linestyle=style, capsize=2, markersize=7, label=family
        )
        above = family in ("DPO", "Best-of-N")  # these two lines' labels above-left, the rest below-right
        for r, x, y in zip(mine, xs, ys):
            offset, align = ((-6, 5), "right") if above else ((6, -11), "left")
            ax.annotate(r["label"], (x, y), textcoords="offset points", xytext=offset, ha=align, fontsize=7, color=colour)
    ax.set_xlabel("KL(policy || reference), nats per completion (Monte Carlo; Best-of-N: upper bound)")
    ax.set_ylabel(f"mean reward ({REWARD}, VADER compound in [-1, 1])")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.text(0.01, 0.01, CAPTION, fontsize=7, style="italic")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(points: dict, s: dict) -> str:
    """frontier.md's body: the frontier table, what each row is, the reward model's accuracy, the label budgets.

    Args:
        points: frontier.py's ``frontier_points``: ``rows``, ``reward_model`` (None without one), ``label_budgets``.
        s: the settings named in the text (sizes, seeds, samples_per_prompt, lr, rm_lr, batch_size, max_new_tokens, model).
    """
    seeds = s["seeds"]
    text = frontier_table(points["rows"]) + (
        f"\nTrained methods: the mean over training seeds {seeds} of each seed's mean {REWARD} reward and Monte Carlo "
        f"KL(policy || reference) (sum over tokens of log pi - log pi_ref), one completion per held-out prompt "
        f"({s['n_test_prompts']} prompts, temperature {TEMPERATURE:g}, at most {s['max_new_tokens']} new tokens); [95%]: the "
        f"t interval across the {len(seeds)} per-seed means; the per-seed columns list them in seed order. Every trained run: "
        f"{s['examples_per_run']} examples, lr {s['lr']:g}, batch {s['batch_size']}, from {s['model']}; the prompts and pairs "
        f"are the same for every seed (the data). Reference: the mean of the {s['samples_per_prompt']} samples per held-out "
        "prompt, [95%] over prompts. Best-of-N: the best of the first N of those samples by the true reward, [95%] over "
        "prompts; Best-of-N (RM): the true reward of the one each seed's reward model ranks first, [95%] across seeds; "
        f"both KLs are {s['kl_bound']}. PPO is not implemented here.\n"
    )
    rm = points["reward_model"]
    if rm is not None:
        per = ", ".join(f"{a:.3f}" for a in rm["per_seed"].values())
        interval = f" [{rm['ci_low']:.3f}, {rm['ci_high']:.3f}]" if rm["ci_low"] is not None else ""
        text += (
            f"\nReward model (loss=reward, Bradley-Terry, lr {s['rm_lr']:g}, on the same {s['n_train_pairs']} train pairs, once per "
            f"seed): held-out pair accuracy {rm['held_out_pair_accuracy']:.3f}{interval} across seeds (per seed {per}) on "
            f"{rm['n_pairs']} held-out pairs; chance 0.5.\n"
        )
    budgets = points["label_budgets"]
    if budgets["online"]:
        text += "\nLabel budgets (a pair labelled: one preference, trained on):\n\n" + budget_table(
            budgets["offline"], budgets["online"]
        )
    return text
