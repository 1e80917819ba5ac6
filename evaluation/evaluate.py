"""Win rates as the DPO paper measured them (Rafailov et al. 2023, Figs. 2-3); usage and outputs: docs/win-rates.md."""

from __future__ import annotations

import functools
import glob
import html
import json
import math
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
from evaluation import rewards, sampling
from export import modelcard
from losses import IGNORE_INDEX
from modeling import models
from parallel import process_group
from runs import checkpoints, checks
from runs.config_text import digest
from runs.files import open_append
from trainers import response_logps
from utils import ConfigError, DataError

CONFIDENCE = 0.95  # the level of the interval around each win rate
INTERVAL = (  # results.json's "interval": how the win rate's interval is computed
    "Wilson score interval (95%) of wins / n over the n judged prompts (one sample per prompt); "
    "ties are not wins (win_rate + tie_rate + loss_rate = 1); failed judgements are left out of n"
)
MEAN_INTERVAL = (  # results.json's "mean_interval": how reward_ci_* and kl_ci_* are computed
    "Student t interval (95%) of the mean over prompts (one sample per prompt): mean +- t(0.975, n-1) * sd / sqrt(n), "
    "sd with n-1; null for n < 2"
)
KL_OF = (  # results.json's "kl_of": what kl_mean is
    "mean over A's samples of sum over the sampled response tokens (stop token included) of log pi_A - log pi_ref, "
    "both the models' own distributions (temperature 1, no top-k/top-p) on the same prompt tokens; "
    "KL(pi_A || pi_ref) without bias for samples at temperature 1 without top-k/top-p"
)
VERDICTS = ("win", "tie", "loss", "failed")  # a judged pair's outcome, from A's side
JUDGE_CHUNK = 32  # judge requests (or texts to score) at a time; each chunk's answers are cached before the next
SUMMARY_TEMPLATE = "dpo_summarization_concise"
DIALOGUE_TEMPLATE = "dpo_dialogue"
SUMMARY_DATASETS = ("tldr",)  # summarisation prompts, judged with the paper's summarisation prompt


# ----------------------------------------------------------------------------- statistics
def wilson_interval(wins: int, n: int, confidence: float = CONFIDENCE) -> tuple[float | None, float | None]:
    """The Wilson score interval (low, high) in [0, 1] of ``wins / n`` (scipy's ``binomtest``); (None, None) for n = 0."""
    if n == 0:
        return None, None
    from scipy.stats import binomtest

    ci = binomtest(wins, n).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


def mean_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float | None, float | None, float | None]:
    """(mean, low, high) of ``values``: mean +- t(0.975, n-1) * sd / sqrt(n), sd with n-1; None where undefined (n < 1, n < 2)."""
    n = len(values)
    if n == 0:
        return None, None, None
    mean = math.fsum(values) / n
    if n == 1:
        return mean, None, None
    from scipy.stats import t as student_t

    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(student_t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def win_rate_stats(verdicts: list[str], max_failure_rate: float) -> dict:
    """One temperature's :data:`VERDICTS` as rates over the n judged, :func:`wilson_interval`, counts and ``failure_rate``."""
    counts = {v: sum(x == v for x in verdicts) for v in VERDICTS}
    n = counts["win"] + counts["tie"] + counts["loss"]
    low, high = wilson_interval(counts["win"], n)
    failure_rate = counts["failed"] / len(verdicts) if verdicts else 0.0
    return {
        **{f"{v}_rate": counts[v] / n if n else None for v in ("win", "tie", "loss")},
        "ci_low": low,
        "ci_high": high,
        "n": n,
        "wins": counts["win"],
        "ties": counts["tie"],
        "losses": counts["loss"],
        "failed": counts["failed"],
        "failure_rate": failure_rate,
        "too_many_failures": failure_rate > max_failure_rate,
    }


def combine_orders(a_first: int | None, b_first: int | None) -> str:
    """A's verdict from the answers for (A, B) and (B, A) (0/1: which is better, TIE, None: failed); disagreement is "tie"."""
    if a_first is None or b_first is None:
        return "failed"
    if rewards.TIE in (a_first, b_first):
        return "tie"
    return {(0, 1): "win", (1, 0): "loss"}.get((a_first, b_first), "tie")  # else the judge followed the position


def compare_scores(a: float, b: float) -> str:
    """A's verdict from reward-model scores: "win" (a > b), "loss" (a < b), "tie" (equal) or "failed" (a NaN)."""
    if math.isnan(a) or math.isnan(b):
        return "failed"
    return "win" if a > b else "loss" if a < b else "tie"


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


# ----------------------------------------------------------------------------- the on-disk cache
class Cache:
    """Records in ``<folder>/<name>-rank<r>.jsonl``: all ranks' files read on open, each rank appends to its own, fsynced."""

    def __init__(self, folder: str, name: str, rank: int = 0):
        self.records: dict[str, dict] = {}
        for path in sorted(glob.glob(os.path.join(folder, f"{name}-rank*.jsonl"))):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    try:
                        record = json.loads(line)
                    except ValueError:
                        continue
                    self.records[record["key"]] = record
        self.path = os.path.join(folder, f"{name}-rank{rank}.jsonl")
        if os.path.exists(self.path) and os.path.getsize(self.path):
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                cut = f.read(1) != b"\n"
            if cut:  # the last line of a killed process: start the next one on a line of its own
                with open_append(self.path) as f:
                    f.write("\n")
        self.added = 0

    def get(self, key: str) -> dict | None:
        """The record stored under ``key``, or None."""
        return self.records.get(key)

    def put(self, records: list[dict]) -> None:
        """Store ``records`` (each with its ``key``) in memory and on disk."""
        if not records:
            return
        with open_append(self.path) as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
                self.records[record["key"]] = record
            f.flush()
            os.fsync(f.fileno())
        self.added += len(records)


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


# ----------------------------------------------------------------------------- judging
def _source(fn) -> str:
    """A digest of ``fn``'s source code (its name where unreadable): cached scores are asked again after it changes."""
    import inspect

    try:
        return digest([inspect.getsource(fn)])
    except (OSError, TypeError):
        return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"


class Judge:
    """The ``judge=`` scorer, checked before sampling: scores each response or asks each pair both ways; failures uncached."""

    def __init__(self, config: DictConfig, cache: Cache | None = None):
        self.config = config
        self.kind = config.judge.name
        self.cache = cache
        self._built: dict[str, object] = {}
        self.errors: list[str] = []
        assert self.kind in checks.SCORERS  # refused earlier by check_config
        if self.kind == "http_judge":
            for template in {self.template(it) for it in ({"dataset": d} for d in config.datasets)}:
                self._identity(template)  # checks the template now, before any sampling
        elif self.kind == "reward_function":
            self._build()  # imports the functions and checks the weights now, before any sampling
        else:  # a missing folder or a causal LM is refused before any sampling
            problem = checks.reward_model_error(config, f"judge={self.kind}")
            if problem is not None:
                raise ConfigError(problem)
            allow = bool(config.reward_model.allow_untrained_head)
            rewards.check_reward_model_config(config.reward_model.name_or_path, allow)

    def template(self, item: dict):
        """The HTTP judge's template for ``item``: ``judge.template``, or the paper's for its task."""
        if self.config.judge.template is not None:
            return self.config.judge.template
        return SUMMARY_TEMPLATE if item["dataset"] in SUMMARY_DATASETS else DIALOGUE_TEMPLATE

    def _scorer_config(self, template=None) -> DictConfig:
        config = self.config.copy()
        config.online.scorer = self.kind
        config.judge.shuffle_order = False  # both orders are asked
        if self.kind == "http_judge":
            config.judge.template = template
        return config

    def _build(self, template=None):
        name = str(template)
        if name not in self._built:
            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
            self._built[name] = rewards.build_scorer(self._scorer_config(template), device=device)
        return self._built[name]

    def _identity(self, template=None) -> str:
        if self.kind == "http_judge":
            judge = rewards.build_scorer(self._scorer_config(template))  # no request is made
            return digest(["http", judge.url, judge.model, judge.template, judge.max_tokens])
        if self.kind == "reward_function":
            scorer = self._build()
            return digest([self.kind, scorer.names, scorer.weights, [_source(fn) for fn in scorer.functions]])
        path = os.path.expanduser(self.config.reward_model.name_or_path)
        where = sampling._folder_stat(path) if os.path.isdir(path) else path
        return digest([self.kind, where, self.config.reward_model.max_length])

    def judge_all(self, rows: list[dict]) -> None:
        """Set each row's ``verdict`` and ``detail``, asking only what the cache lacks, :data:`JUDGE_CHUNK` at a time."""
        (self._by_scores if self.kind in ("reward_model", "reward_function") else self._pairwise)(rows, JUDGE_CHUNK)

    def _by_scores(self, rows: list[dict], chunk: int) -> None:
        identity = self._identity()
        by_function = self.kind == "reward_function"  # a reward function reads the row's fields; a reward model does not

        def key(row: dict, text: str) -> str:
            fields = row.get("fields") if by_function else None
            return digest([identity, row["judge_prompt"], text, *([fields] if fields else [])])

        wanted = {}
        for row in rows:
            for text in (row["a"], row["b"]):
                k = key(row, text)
                if self.cache.get(k) is None:
                    wanted[k] = (row["judge_prompt"], text, row.get("fields"))
        todo = list(wanted.items())
        for start in range(0, len(todo), chunk):
            part = todo[start : start + chunk]
            scorer = self._build()
            fields = rewards.field_columns([f for _, (_, _, f) in part]) if by_function else {}
            scores = scorer.score([p for _, (p, _, _) in part], [t for _, (_, t, _) in part], **fields).tolist()
            self.cache.put([{"key": k, "score": s} for (k, _), s in zip(part, scores) if not math.isnan(s)])
            why = getattr(scorer, "last_errors", None)  # a reward function's sentences
            self.errors += list(why) if why else ["NaN score" for s in scores if math.isnan(s)]
        for row in rows:
            a, b = (self.cache.get(key(row, t)) for t in (row["a"], row["b"]))
            sa, sb = (float("nan") if r is None else r["score"] for r in (a, b))
            row["verdict"] = compare_scores(sa, sb)
            row["detail"] = {"score_a": None if a is None else sa, "score_b": None if b is None else sb}

    def _pairwise(self, rows: list[dict], chunk: int) -> None:
        identities = {}
        by_template: dict = {}  # template -> [(key, prompt, first, second)]
        for row in rows:
            template = self.template(row)
            if template not in identities:
                identities[template] = self._identity(template)
            row["_keys"] = []
            for first, second in ((row["a"], row["b"]), (row["b"], row["a"])):
                k = digest([identities[template], row["judge_prompt"], first, second])
                row["_keys"].append(k)
                if row["a"] != row["b"] and self.cache.get(k) is None:
                    by_template.setdefault(template, {})[k] = (k, row["judge_prompt"], first, second)
        for template, requests in by_template.items():
            judge, todo = self._build(template), list(requests.values())
            for start in range(0, len(todo), chunk):
                part = todo[start : start + chunk]
                answers = judge.judge([p for _, p, _, _ in part], [(f, s) for _, _, f, s in part])
                self.cache.put([{"key": k, "answer": a} for (k, _, _, _), a in zip(part, answers) if a is not None])
                self.errors += list(judge.last_errors)
        for row in rows:
            keys = row.pop("_keys")
            if row["a"] == row["b"]:
                row["verdict"], row["detail"] = "tie", {"identical": True}
                continue
            answers = [None if self.cache.get(k) is None else self.cache.get(k)["answer"] for k in keys]
            row["verdict"] = combine_orders(*answers)
            row["detail"] = {"a_first": answers[0], "b_first": answers[1]}


# ----------------------------------------------------------------------------- outputs
def temperature_key(t: float) -> str:
    """A temperature as results.json's key: ``"0.25"``, ``"1"``, ``"0"`` (greedy)."""
    return f"{float(t):g}"


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
    if config.datasets is not None and (not OmegaConf.is_list(config.datasets) or not len(config.datasets)):
        raise ConfigError(f"datasets must be a non-empty list: write datasets=[{config.datasets}].")
    problem = checks.scorer_error(config.judge.get("name"), config, "judge")
    if problem is not None:
        raise ConfigError(problem)


def effective_config(config: DictConfig) -> DictConfig:
    """The config to run: with ``resume=<evaluation folder>``, the one saved there, that folder its ``output_dir`` (ConfigError
    when it names code or an endpoint ``config`` does not: :func:`checks.handed_error`)."""
    if config.resume is None:
        return config
    folder = str(config.resume)
    saved = os.path.join(folder, "config.yaml")
    run_config = checkpoints.load_run_config(saved) if os.path.isfile(saved) else None
    if run_config is None or "policy" not in run_config:
        raise ConfigError(
            f"resume={folder} is not an evaluation folder (no config.yaml of evaluate.py in it); give the folder evaluate.py printed."
        )
    problem = checks.handed_error(folder, run_config, config, "evaluate.py")  # its code and endpoints: only if given too
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
        d for d in checks.config_differences(other, config) if not any(d[0].split(".")[0] == k for k in RESULT_FREE_KEYS)
    ]
    if not differences:
        return None  # the same evaluation, continued: nothing finished is redone
    return (
        f"output_dir={config.output_dir} holds another evaluation ({checks.describe_differences(differences)}); give a new "
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


def source_path(source: sampling.Source) -> str:
    """Where ``source``'s weights are: its checkpoint, hf or adapter folder (links resolved), or its hub id."""
    if source.weights is not None:
        return os.path.dirname(checkpoints.local_path(source.weights))
    return checkpoints.local_path(source.adapter or source.model_config.name_or_path)


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


def default_output_dir(config: DictConfig, policy: sampling.Source, baseline_label: str) -> str:
    """``<policy's run folder or output_root>/eval/<name>_<timestamp>``; ``name`` defaults to ``vs_<baseline>_<judge>``."""
    name = config.name or f"vs_{baseline_label}_{config.judge.name}"
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")[:80]
    root = os.path.join(policy.run_dir if policy.run_dir else config.output_root, "eval")
    os.makedirs(root, exist_ok=True)
    return checkpoints.make_run_dir(root, name)


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
    if config.baseline == "chosen":
        baseline, baseline_label = None, "chosen"
    elif config.baseline == "reference":
        baseline, baseline_label = sampling.reference_source(policy), "reference"
    else:
        baseline = sampling.resolve_source(config.baseline, config, "baseline")
        baseline_label = baseline.label
    baseline_label = config.baseline_label or baseline_label
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
    judge = Judge(config)  # its settings checked before any folder is made
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
    results = summarize(rows, config, policy, baseline_label, reference)
    if rank == 0:
        _write_and_report(config, out, rows, results, errors, policy, baseline_label)
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


def _write_and_report(
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
    problem = None if any(a.startswith("-") for a in overrides) else checks.override_error(overrides, config_name="evaluate")
    if problem is not None:
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            print(f"Error: {problem}", file=sys.stderr, flush=True)
        sys.exit(2)
    if "RANK" not in os.environ:
        hydra_main()
    else:
        processes.exit_rank(hydra_main)
