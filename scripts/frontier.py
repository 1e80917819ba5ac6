"""The DPO paper's Figure 2 (left) in miniature: mean sentiment reward against KL(policy || reference).

    python scripts/frontier.py [--out DIR] [--jobs 2] [--copy-plot docs/frontier_sentiment_stories260k.png]

Rafailov et al. 2023, section 6.1: an SFT model writes continuations of short prefixes, a
sentiment classifier is the reward, and each method's point is (KL to the SFT model, mean reward)
on held-out prompts. Here the SFT policy is stories260K and the reward is ``sentiment`` (VADER's
compound score, reward_functions.py). Every step but the first is a command of this repository,
printed as it starts, its output in ``<out>/logs/<step>.log``:

1. prompts: ``--n-stories`` stories sampled from the model at temperature 1 (seeded); each gives
   its first n words, n drawn from [2, 8] by a seeded RNG; repeats dropped; ``--n-test``
   held-out prompts and ``--n-train`` train prompts (``prompts_{train,test}.jsonl``, rows
   ``{prompt}``, which the ``hf`` loader reads as prompts).
2. pairs: ``make_pairs.py`` samples k=4 completions per train prompt from the model, scores them
   and pairs every two with different scores (up to 6 per prompt, the paper's construction);
   the same for the held-out prompts (training's held-out metrics only).
3. train: ``train.py`` from the model, the same pairs, lr, batch and number of examples for each
   method: DPO at each of ``--betas``, IPO, conservative DPO (``loss.label_smoothing``), online
   DPO (the policy's own pairs, labelled by the reward function, on the train prompts),
   Preferred-FT (``loss=sft`` on each train prompt's best-scored completion: the chosen one of
   its pairs that is never rejected).
4. evaluate: ``evaluate.py judge=reward_function`` on the held-out prompts at temperature 1: the
   mean reward and the Monte Carlo KL(policy || reference), each with a 95% t interval over
   prompts; also for the model itself (KL 0).
5. Best-of-N: ``make_pairs.py`` samples 64 completions per held-out prompt from the model; the
   first N of them give Best-of-N's reward (the mean over prompts of their best score, with a
   t interval over prompts) for each N of ``--best-of``; its KL is log N - (N - 1) / N, an upper
   bound (Beirami et al. 2024, "Theoretical guarantees on the best-of-n alignment policy").

It writes ``<out>/frontier.png`` (the plot), ``frontier.md`` (the table) and ``results.json``
(the rows, the settings, the commands, the wall time). PPO is not implemented here.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import os
import random
import shlex
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from evaluation import report, sampling, statistics  # noqa: E402  (the repository's modules, from the repository root)

DEFAULT_MODEL = REPO.parent / "shared" / "models" / "stories260K"
REWARD = "sentiment"
TEMPERATURE = 1.0  # the evaluation's and the sampling's: at 1 (no top-k / top-p) the KL estimate is unbiased
KL_BOUND = "log N - (N-1)/N, an upper bound (Beirami et al. 2024)"
CAPTION = "PPO is not implemented here. Best-of-N's KL is the bound log N - (N-1)/N (Beirami et al. 2024)."


def story_prefixes(texts: list[str], rng: random.Random, min_words: int = 2, max_words: int = 8) -> list[str]:
    """The first n words of each text, n drawn from [min_words, max_words] by ``rng`` (one draw
    per text, in order); a text of n words or fewer gives none (its last word may be cut off),
    and a prefix seen before is dropped. Words are split at whitespace and joined by one space."""
    prefixes, seen = [], set()
    for text in texts:
        n = rng.randint(min_words, max_words)
        words = text.split()
        if len(words) <= n:
            continue
        prefix = " ".join(words[:n])
        if prefix not in seen:
            seen.add(prefix)
            prefixes.append(prefix)
    return prefixes


def best_of_n_kl(n: int) -> float:
    """Best-of-N's KL from the reference, log N - (N - 1) / N nats: an upper bound of the true
    KL (Beirami et al. 2024, Theorem 1; the "usual formula" of Stiennon et al. 2020 and others)."""
    return math.log(n) - (n - 1) / n


def best_of_n(scores: list[list[float | None]], n: int) -> list[float]:
    """Best-of-N's reward per prompt: the highest of its first ``n`` scores (None: failed, left
    out); a prompt whose first ``n`` all failed gives none.

    Args:
        scores: per prompt, its samples' scores in the order they were drawn (at least ``n`` each).
    """
    best = []
    for row in scores:
        if len(row) < n:
            raise ValueError(f"Best-of-{n} needs {n} samples per prompt, a prompt has {len(row)}.")
        got = [s for s in row[:n] if s is not None and not math.isnan(s)]
        if got:
            best.append(max(got))
    return best


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def sample_stories(model_path: Path, n: int, seed: int, max_new_tokens: int = 24, batch: int = 256) -> list[str]:
    """``n`` stories the model writes from its BOS token alone, at temperature 1, seeded."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import utils
    from data.chat import stop_token_ids

    utils.set_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(model_path, trust_remote_code=False).eval()
    settings = OmegaConf.create({"top_k": 0, "top_p": 1.0, "max_new_tokens": max_new_tokens})
    stop_ids = stop_token_ids(tokenizer)
    texts = []
    for start in range(0, n, batch):
        prompts = [[tokenizer.bos_token_id]] * min(batch, n - start)
        out = sampling.generate_batch(model, tokenizer, stop_ids, prompts, TEMPERATURE, settings, seed + start)
        texts.extend(s["text"] for s in out)
    return texts


# ----------------------------------------------------------------------------- running the steps


@dataclass
class Job:
    """Commands run one after the other (a training run, then its evaluation), logged to one
    file; a command given as a function is built when its turn comes (from what the earlier made)."""

    name: str
    commands: list
    seconds: float = 0.0
    after: list = field(default_factory=list)  # called once the commands succeeded


class Runner:
    """Runs jobs on ``jobs`` worker threads, each command a subprocess in the repository root;
    prints each command as it starts; the first failure stops the jobs not yet started."""

    def __init__(self, out: Path, jobs: int):
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.jobs = jobs
        self.lock = threading.Lock()
        self.failed: list[str] = []
        self.commands: list[str] = []

    def say(self, text: str) -> None:
        with self.lock:
            print(text, flush=True)

    def _run(self, job: Job) -> None:
        if self.failed:
            return
        start = time.time()
        log = self.logs / f"{job.name}.log"
        with open(log, "w", encoding="utf-8") as f:
            for cmd in job.commands:
                cmd = cmd() if callable(cmd) else cmd
                shown = "python " + shlex.join(cmd[1:])
                with self.lock:
                    self.commands.append(shown)
                    print(f"$ {shown}", flush=True)
                f.write(f"$ {shown}\n")
                f.flush()
                env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
                code = subprocess.call(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env)
                if code != 0:
                    tail = log.read_text(encoding="utf-8").splitlines()[-15:]
                    self.failed.append(f"{job.name}: exit {code}, see {log}:\n" + "\n".join(tail))
                    return
        job.seconds = time.time() - start
        for fn in job.after:
            fn()
        self.say(f"[frontier] {job.name} done ({job.seconds:.0f} s)")

    def run(self, jobs: list[Job]) -> None:
        """Run ``jobs`` (the longest first is best) and wait for all of them.

        Raises:
            SystemExit: naming the first command that failed and the end of its log.
        """
        with concurrent.futures.ThreadPoolExecutor(self.jobs) as pool:
            list(pool.map(self._run, jobs))
        if self.failed:
            raise SystemExit("Error: a step failed: " + self.failed[0])


def shown_path(path: Path) -> str:
    """``path`` relative to the repository root (where the commands run) when it is beside or
    inside it, else absolute: the printed commands stay short and run from the root."""
    rel = os.path.relpath(path, REPO)
    return rel if not rel.startswith("../..") else str(path)


def prompt_data(out: Path) -> list[str]:
    """The overrides that read the prompt files with the ``hf`` loader (prompt-only rows)."""
    train, test = (shown_path(out / f"prompts_{s}.jsonl") for s in ("train", "test"))
    return ["datasets=[hf]", f'data.hf.path={{train:"{train}",test:"{test}"}}']


def pair_data(train: Path, test: Path) -> list[str]:
    return ["datasets=[json]", f'data.json.path={{train:"{shown_path(train)}",test:"{shown_path(test)}"}}']


@dataclass
class Method:
    """One training run: its name (folder), label (plot), beta (None: not a preference loss) and overrides."""

    name: str
    label: str
    family: str
    beta: float | None
    overrides: list[str]


def methods(args, out: Path) -> list[Method]:
    """The runs ``args.methods`` asks for, each with its loss and data."""
    pairs = pair_data(out / "pairs_train.jsonl", out / "pairs_test.jsonl")
    chosen = pair_data(out / "preferred_train.jsonl", out / "pairs_test.jsonl")
    runs = []
    if "dpo" in args.methods:
        for b in args.betas:
            runs.append(Method(f"dpo_beta{b:g}", f"DPO β={b:g}", "DPO", b, [*pairs, "loss=dpo", f"loss.beta={b:g}"]))
    if "ipo" in args.methods:
        b = args.ipo_beta
        runs.append(Method(f"ipo_beta{b:g}", f"IPO β={b:g}", "IPO", b, [*pairs, "loss=ipo", f"loss.beta={b:g}"]))
    if "cdpo" in args.methods:
        b, eps = args.cdpo_beta, args.label_smoothing
        overrides = [*pairs, "loss=dpo", f"loss.beta={b:g}", f"loss.label_smoothing={eps:g}"]
        runs.append(Method(f"cdpo_beta{b:g}", f"cDPO β={b:g} ε={eps:g}", "cDPO", b, overrides))
    if "online" in args.methods:
        b = args.online_beta
        overrides = [
            *prompt_data(out),
            "loss=dpo",
            f"loss.beta={b:g}",
            "online.enabled=true",
            "online.scorer=reward_function",
            f"online.temperature={TEMPERATURE:g}",
            f"online.max_new_tokens={args.max_new_tokens}",
        ]
        runs.append(Method(f"online_dpo_beta{b:g}", f"online DPO β={b:g}", "online DPO", b, overrides))
    if "pft" in args.methods:
        runs.append(Method("preferred_ft", "Preferred-FT", "Preferred-FT", None, [*chosen, "loss=sft"]))
    return runs


def preferred_rows(pairs: list[dict]) -> list[dict]:
    """Preferred-FT's data: per prompt, one row whose chosen is its best-scored completion (the
    json loader's SFT target: the first chosen of a prompt) and whose rejected is its worst."""
    best, worst = {}, {}
    for p in pairs:
        if p["prompt"] not in best or p["chosen_score"] > best[p["prompt"]][1]:
            best[p["prompt"]] = (p["chosen"], p["chosen_score"])
        if p["prompt"] not in worst or p["rejected_score"] < worst[p["prompt"]][1]:
            worst[p["prompt"]] = (p["rejected"], p["rejected_score"])
    return [{"prompt": q, "chosen": best[q][0], "rejected": worst[q][0]} for q in best]


def row_from_eval(folder: Path, method: str, label: str, beta: float | None) -> dict:
    """A table row from an evaluate.py folder's results.json (temperature 1)."""
    results = json.loads((folder / "results.json").read_text())
    r = results["temperatures"][report.temperature_key(TEMPERATURE)]
    keys = ("reward_mean", "reward_ci_low", "reward_ci_high", "kl_mean", "kl_ci_low", "kl_ci_high", "reward_n")
    row = {"method": method, "label": label, "beta": beta, **{k: r[k] for k in keys}}
    row.update(kl="Monte Carlo", win_rate_vs_reference=r["win_rate"], ended=r["a_ended"], tokens=r["a_tokens"])
    row["eval"] = shown_path(folder)
    return row


def bon_rows(samples: list[dict], sizes: list[int]) -> list[dict]:
    """Best-of-N's rows from make_pairs.py's samples (in the order drawn, grouped by prompt id)."""
    scores: dict[str, list] = {}
    for s in samples:
        scores.setdefault(s["id"], []).append(s["score"])
    rows = []
    for n in sizes:
        best = best_of_n(list(scores.values()), n)
        mean, low, high = statistics.mean_interval(best)
        kl = best_of_n_kl(n)
        rows.append(
            {
                "method": "Best-of-N",
                "label": f"Best-of-{n}",
                "beta": None,
                "n": n,
                "reward_mean": mean,
                "reward_ci_low": low,
                "reward_ci_high": high,
                "reward_n": len(best),
                "kl_mean": kl,
                "kl_ci_low": None,
                "kl_ci_high": None,
                "kl": f"bound {KL_BOUND}",
            }
        )
    return rows


def _bar(r: dict, name: str, end: str) -> float:
    """An error bar's length from ``<name>_mean`` to ``<name>_ci_<end>`` (0 without an interval)."""
    bound = r.get(f"{name}_ci_{end}")
    return 0.0 if bound is None else abs(bound - r[f"{name}_mean"])


def _cell(mean, low, high, digits: int) -> str:
    if mean is None:
        return "-"
    text = f"{mean:.{digits}f}"
    return text + (f" [{low:.{digits}f}, {high:.{digits}f}]" if low is not None else "")


def frontier_table(rows: list[dict]) -> str:
    """The markdown table: one row per run, in the order given."""
    lines = [
        "| method | β | reward [95%] | KL, nats [95%] | win rate vs reference | samples ending | KL from |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        beta = "-" if r["beta"] is None else f"{r['beta']:g}"
        win = "-" if r.get("win_rate_vs_reference") is None or r["method"] == "reference" else f"{r['win_rate_vs_reference']:.2f}"
        ended = "-" if r.get("ended") is None else f"{r['ended']:.2f}"
        kl_from = "log N - (N-1)/N (upper bound)" if r["method"] == "Best-of-N" else r["kl"]
        reward = _cell(r["reward_mean"], r["reward_ci_low"], r["reward_ci_high"], 3)
        kl = _cell(r["kl_mean"], r["kl_ci_low"], r["kl_ci_high"], 2)
        lines.append(f"| {r['label']} | {beta} | {reward} | {kl} | {win} | {ended} | {kl_from} |")
    return "\n".join(lines) + "\n"


STYLE = {  # family -> (marker, colour)
    "reference": ("*", "black"),
    "DPO": ("o", "tab:blue"),
    "IPO": ("s", "tab:orange"),
    "cDPO": ("D", "tab:purple"),
    "online DPO": ("^", "tab:red"),
    "Preferred-FT": ("v", "tab:green"),
    "Best-of-N": ("P", "tab:gray"),
}


def plot_frontier(rows: list[dict], path: Path, title: str) -> None:
    """Reward (y) against KL (x), one point per run with its 95% intervals as bars, labelled;
    DPO's betas joined by a line in KL order, Best-of-N's sizes by a dashed one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    for family, (marker, colour) in STYLE.items():
        mine = sorted((r for r in rows if r["method"] == family), key=lambda r: r["kl_mean"])
        if not mine:
            continue
        xs, ys = [r["kl_mean"] for r in mine], [r["reward_mean"] for r in mine]
        xerr, yerr = ([[_bar(r, name, end) for r in mine] for end in ("low", "high")] for name in ("kl", "reward"))
        style = "--" if family == "Best-of-N" else "-" if family == "DPO" and len(mine) > 1 else "none"
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
    fig.text(0.01, 0.01, CAPTION, fontsize=7.5, style="italic")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def refuse(message: str) -> None:
    """A user's mistake: one sentence on stderr, exit 2."""
    print(f"Error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="output folder (null: outputs/frontier_<timestamp>)")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="the SFT policy and reference (a Hugging Face folder)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-stories", type=int, default=2048, help="stories sampled to cut the prompts from")
    p.add_argument("--n-train", type=int, default=256, help="train prompts")
    p.add_argument("--n-test", type=int, default=128, help="held-out prompts (evaluation and Best-of-N)")
    p.add_argument("--min-words", type=int, default=2)
    p.add_argument("--max-words", type=int, default=8)
    p.add_argument("--k", type=int, default=4, help="completions per train prompt (k(k-1)/2 pairs at most)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="completion length (sampling, online DPO, evaluation)")
    p.add_argument(
        "--methods", nargs="+", default=["dpo", "ipo", "cdpo", "online", "pft"], choices=["dpo", "ipo", "cdpo", "online", "pft"]
    )
    p.add_argument("--betas", type=float, nargs="+", default=[0.05, 0.1, 0.25, 1.0], help="DPO's betas")
    p.add_argument(
        "--ipo-beta", type=float, default=1.0, help="IPO's beta (its target log-ratio gap is 1/(2 beta) nats per token)"
    )
    p.add_argument("--cdpo-beta", type=float, default=0.1)
    p.add_argument("--label-smoothing", type=float, default=0.2, help="cDPO's epsilon")
    p.add_argument("--online-beta", type=float, default=0.1)
    p.add_argument("--best-of", type=int, nargs="+", default=[4, 16, 64], help="Best-of-N's sizes (the largest is sampled)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=float, default=1.0, help="passes over the pairs: every run trains on epochs x pairs examples")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--jobs", type=int, default=2, help="commands run at once (each with one thread)")
    p.add_argument("--copy-plot", type=Path, default=None, help="also copy frontier.png here (e.g. docs/...)")
    args = p.parse_args(argv)
    if not 1 <= args.min_words <= args.max_words:
        p.error(f"--min-words and --max-words must satisfy 1 <= min <= max, got {args.min_words} and {args.max_words}.")
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}.")
    if min(args.best_of) < 1:
        p.error(f"--best-of sizes must be >= 1, got {args.best_of}.")
    return args


SAMPLING = ["temperature=1.0", "top_k=0", "top_p=1.0"]  # make_pairs.py's: the model's own distribution


def make_prompts(args, out: Path, model: str) -> tuple[list[str], list[str]]:
    """Step 1: the train and held-out prompts, prefixes of the model's own stories, written to ``out``."""
    stories = sample_stories(args.model, args.n_stories, args.seed)
    prompts = story_prefixes(stories, random.Random(args.seed), args.min_words, args.max_words)
    random.Random(args.seed).shuffle(prompts)
    if len(prompts) < args.n_test + args.n_train:
        refuse(
            f"{args.n_stories} stories gave {len(prompts)} distinct prefixes, fewer than --n-test {args.n_test} + "
            f"--n-train {args.n_train}; raise --n-stories."
        )
    test, train = prompts[: args.n_test], prompts[args.n_test : args.n_test + args.n_train]
    write_jsonl(out / "prompts_test.jsonl", [{"prompt": q} for q in test])
    write_jsonl(out / "prompts_train.jsonl", [{"prompt": q} for q in train])
    print(
        f"[frontier] prompts: {args.n_stories} stories sampled from {model} (seed {args.seed}) gave {len(prompts)} distinct "
        f"{args.min_words}-{args.max_words}-word prefixes; {len(train)} train, {len(test)} held out, e.g. {train[:3]}",
        flush=True,
    )
    return train, test


def pairs_job(name: str, model: str, out: Path, common: list[str], split: str, n: int, k: int, output: Path, extra=()) -> Job:
    """make_pairs.py: ``k`` completions of each of ``n`` prompts of ``split`` sampled from ``model``, scored, to ``output``."""
    cmd = [sys.executable, "make_pairs.py", f"policy={model}", *prompt_data(out), f"split={split}", f"n_prompts={n}", f"k={k}"]
    return Job(name, [[*cmd, *SAMPLING, *common, *extra, f"output={shown_path(output)}"]])


def train_overrides(args, model: str, budget: int, n_test: int) -> list[str]:
    """train.py's overrides shared by every method: the model, the optimizer, the length, the eval."""
    return [
        "model=blank_model",
        f"model.name_or_path={model}",
        f"seed={args.seed}",
        "num_threads=1",
        "optimizer=AdamW",
        f"lr={args.lr:g}",
        f"warmup_steps={args.warmup_steps}",
        f"batch_size={args.batch_size}",
        f"eval_batch_size={args.batch_size}",
        f"n_examples={budget}",
        f"eval_every={budget}",
        "do_first_eval=false",
        f"n_eval_examples={min(128, n_test)}",
        "sample_during_eval=false",
        "save_hf_export=false",
        "keep_checkpoints=1",
        "max_length=128",
        "max_prompt_length=64",
        f"reward_functions=[{REWARD}]",
        "progress_bar=false",
    ]


def eval_overrides(out: Path, n_test: int, common: list[str]) -> list[str]:
    """evaluate.py's overrides shared by every evaluation: the reward function on the held-out prompts at temperature 1."""
    return [
        "judge=reward_function",
        f"temperatures=[{TEMPERATURE:g}]",
        *prompt_data(out),
        f"n_prompts={n_test}",
        "top_k=0",
        "top_p=1.0",
        "max_prompt_length=64",
        *common,
        "progress_bar=false",
    ]


def method_job(m: Method, out: Path, train_common: list[str], eval_common: list[str], rows: dict) -> Job:
    """Train method ``m`` from the model, evaluate it against the model, then record its row in ``rows``."""
    py = sys.executable
    root = out / "runs" / m.name
    folder = out / "eval" / m.name
    for old in (root, folder):  # an earlier run's: the run folder is found below as the one folder in root
        if old.exists():
            shutil.rmtree(old)
    train_cmd = [py, "train.py", *train_common, *m.overrides, f"output_root={shown_path(root)}", f"exp_name={m.name}"]

    def eval_cmd():
        (run,) = root.iterdir()  # the run folder train.py made: <exp_name>_<timestamp>
        return [
            py,
            "evaluate.py",
            f"policy={shown_path(run)}",
            "baseline=reference",
            *eval_common,
            f"label={m.name}",
            f"output_dir={shown_path(folder)}",
        ]

    def record():
        rows[m.name] = row_from_eval(folder, m.family, m.label, m.beta)

    return Job(m.name, [train_cmd, eval_cmd], after=[record])


def reference_job(model: str, out: Path, eval_common: list[str], rows: dict) -> Job:
    """Evaluate the model itself (KL 0), then record its row in ``rows``."""
    ref_folder = out / "eval" / "reference"
    if ref_folder.exists():
        shutil.rmtree(ref_folder)
    return Job(
        "reference",
        [
            [
                sys.executable,
                "evaluate.py",
                f"policy={model}",
                f"baseline={model}",
                f"reference={model}",
                *eval_common,
                "label=reference",
                f"output_dir={shown_path(ref_folder)}",
            ]
        ],
        after=[lambda: rows.__setitem__("reference", row_from_eval(ref_folder, "reference", "reference (stories260K)", None))],
    )


def main(argv: list[str] | None = None) -> dict:
    """Run the pipeline; returns results.json's contents."""
    args = parse_args(argv)
    started = time.time()
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    if not (args.model / "config.json").is_file():
        refuse(f"--model {args.model} is not a Hugging Face model folder (no config.json); give stories260K's folder.")
    out = (args.out or Path("outputs") / f"frontier_{stamp}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = shown_path(args.model.resolve())
    print(f"[frontier] output folder: {out}", flush=True)

    # 1. prompts, from the model's own stories
    train, test = make_prompts(args, out, model)
    common = [f"seed={args.seed}", "num_threads=1", f"reward_functions=[{REWARD}]", f"max_new_tokens={args.max_new_tokens}"]
    runner = Runner(out, args.jobs)

    # 2. pairs from the model's own samples, as the paper built them
    runner.run(
        [
            pairs_job("pairs_train", model, out, common, "train", len(train), args.k, out / "pairs_train.jsonl"),
            pairs_job("pairs_test", model, out, common, "test", len(test), args.k, out / "pairs_test.jsonl"),
        ]
    )
    pairs = read_jsonl(out / "pairs_train.jsonl")
    write_jsonl(out / "preferred_train.jsonl", preferred_rows(pairs))
    budget = max(1, round(len(pairs) * args.epochs))
    print(f"[frontier] {len(pairs)} train pairs; every run trains on {budget} examples", flush=True)

    # 3-5. train and evaluate each method; the model itself; Best-of-N
    train_common = train_overrides(args, model, budget, len(test))
    eval_common = eval_overrides(out, len(test), common)
    rows: dict[str, dict] = {}
    jobs = [method_job(m, out, train_common, eval_common, rows) for m in methods(args, out)]
    ref = reference_job(model, out, eval_common, rows)
    bon_path = out / "best_of_n.jsonl"
    bon = pairs_job("best_of_n", model, out, common, "test", len(test), max(args.best_of), bon_path, ["max_pairs_per_prompt=1"])
    bon.after.append(
        lambda: rows.update({r["label"]: r for r in bon_rows(read_jsonl(Path(f"{bon_path}.samples.jsonl")), args.best_of)})
    )
    online = [j for j in jobs if j.name.startswith("online")]  # the longest: sampling every step
    runner.run(online + [bon] + [j for j in jobs if j not in online] + [ref])

    # 6. the table, the plot, results.json
    sizes = {"n_train_prompts": len(train), "n_test_prompts": len(test), "n_train_pairs": len(pairs), "examples_per_run": budget}
    jobs_s = {j.name: round(j.seconds, 1) for j in jobs + [ref, bon]}
    return write_results(args, argv, out, rows, sizes, model, started, jobs_s, runner.commands)


def write_results(args, argv, out: Path, rows: dict, sizes: dict, model: str, started: float, jobs_s: dict, commands) -> dict:
    """Step 6: frontier.md (the table), frontier.png (the plot) and results.json in ``out``; returns results.json's contents."""
    order = ["reference", *(m.name for m in methods(args, out)), *(f"Best-of-{n}" for n in args.best_of)]
    table_rows = [rows[k] for k in order]
    wall = time.time() - started
    command = "python " + shlex.join(["scripts/frontier.py", *(sys.argv[1:] if argv is None else argv)])
    n_test = sizes["n_test_prompts"]
    title = (
        f"{REWARD} reward against KL, {args.model.name} (DPO paper Figure 2, left, in miniature)\n"
        f"{sizes['n_train_prompts']} train prompts x {args.k} completions ({sizes['n_train_pairs']} pairs), {n_test} held-out prompts, "
        f"temperature {TEMPERATURE:g}, <= {args.max_new_tokens} new tokens"
    )
    table = frontier_table(table_rows)
    note = (
        f"Reward: mean {REWARD} score of one completion per held-out prompt ({n_test} prompts, temperature {TEMPERATURE:g}, "
        f"at most {args.max_new_tokens} new tokens); KL: Monte Carlo mean over those completions of "
        "sum_t log pi(y_t|x,y<t) - log pi_ref(y_t|x,y<t) (evaluate.py); [95%]: t interval over prompts. "
        f"Best-of-N: the best of the first N of {max(args.best_of)} reference samples per held-out prompt; its KL is {KL_BOUND}. "
        f"Every trained run: {sizes['examples_per_run']} examples, lr {args.lr:g}, batch {args.batch_size}, from {model}. "
        "PPO is not implemented here.\n"
    )
    (out / "frontier.md").write_text(
        f"# {title.replace(chr(10), ': ', 1)}\n\n{table}\n{note}\nCommand: `{command}` ({wall:.0f} s)\n", encoding="utf-8"
    )
    plot_frontier(table_rows, out / "frontier.png", title)
    results = {
        "command": command,
        "wall_s": wall,
        "date": datetime.date.today().isoformat(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        **sizes,
        "rows": table_rows,
        "jobs_s": jobs_s,
        "commands": commands,
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"\n{table}\n{note}")
    if args.copy_plot:
        args.copy_plot.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out / "frontier.png", args.copy_plot)
    print(
        f"[frontier] {out}/frontier.png, frontier.md, results.json ({wall:.0f} s)"
        + (f"; plot copied to {args.copy_plot}" if args.copy_plot else "")
    )
    return results


if __name__ == "__main__":
    main()
