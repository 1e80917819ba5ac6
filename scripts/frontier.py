"""The DPO paper's Figure 2 (left) in miniature: mean sentiment reward against KL(policy || reference), over seeds.

    python scripts/frontier.py [--out DIR] [--seeds 0 1 2] [--jobs 2] [--copy-plot docs/frontier_sentiment_stories260k.png]

Rafailov et al. 2023, section 6.1: an SFT model writes continuations of short prefixes, a
sentiment classifier is the reward, and each method's point is (KL to the SFT model, mean reward)
on held-out prompts. Here the SFT policy is stories260K and the reward is ``sentiment`` (VADER's
compound score, reward_functions.py). Every step but the first is a command of this repository,
printed as it starts, its output in ``<out>/logs/<step>.log``:

1. prompts: ``--n-stories`` stories sampled from the model at temperature 1 (seeded by ``--seed``);
   each gives its first n words, n drawn from [2, 8] by a seeded RNG; repeats dropped; ``--n-test``
   held-out prompts and ``--n-train`` train prompts (``prompts_{train,test}.jsonl``, rows
   ``{prompt}``, which the ``hf`` loader reads as prompts).
2. pairs: ``make_pairs.py`` samples k=4 completions per train prompt from the model, scores them
   and pairs every two with different scores (up to 6 per prompt, the paper's construction);
   the same for the held-out prompts (training's held-out metrics, the reward model's accuracy).
   Prompts and pairs are the data: made once (``--seed``), the same for every training seed.
3. train, once per seed of ``--seeds`` (train.py's ``seed``: the data order, online DPO's sampling;
   the evaluation's sampling too): ``train.py`` from the model, the same pairs, lr, batch and
   number of examples for each method: DPO at each of ``--betas``, IPO, conservative DPO
   (``loss.label_smoothing``), online DPO (the policy's own pairs, labelled by the reward
   function, on the train prompts: as many labelled pairs as the offline pairs file has),
   Preferred-FT (``loss=sft`` on each train prompt's best-scored completion: the chosen one of
   its pairs that is never rejected), and a Bradley-Terry reward model (``loss=reward``).
4. evaluate: ``evaluate.py judge=reward_function`` on the held-out prompts at temperature 1: the
   mean reward and the Monte Carlo KL(policy || reference) of each run; a point is the mean over
   seeds of both, with a 95% t interval across seeds.
5. Best-of-N: ``make_pairs.py`` samples 64 completions per held-out prompt from the model; their
   mean is the reference's reward (KL 0); the first N of them give Best-of-N's reward (the mean over
   prompts of their best score, with a t interval over prompts) for each N of ``--best-of``, and
   Best-of-N (RM)'s (the true score of the one each seed's reward model ranks first,
   scripts/reward_model_scores.py); both KLs are log N - (N - 1) / N, an upper bound (Beirami et
   al. 2024, "Theoretical guarantees on the best-of-n alignment policy").

It writes ``<out>/frontier.png`` (the plot), ``frontier.md`` (the tables) and ``results.json``
(the rows with each seed's values, the label budgets, the settings, the commands, the wall time).
PPO is not implemented here.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
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

from evaluation import sampling, statistics  # noqa: E402  (the repository's modules, from the repository root)
from scripts import frontier_results as results  # noqa: E402
from scripts.frontier_results import KL_BOUND, REWARD, TEMPERATURE  # noqa: E402

DEFAULT_MODEL = REPO.parent / "shared" / "models" / "stories260K"


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


def methods(args, out: Path, n_pairs: int) -> list[Method]:
    """The runs ``args.methods`` asks for, each with its loss and data; online DPO labels ``n_pairs`` pairs, as many as
    the offline pairs file has (its n_examples counts prompts, each one sampled pair)."""
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
            "online.ties=random",  # a tied pair labelled by a coin, so each of its n_examples prompts gives one labelled pair
            f"n_examples={n_pairs}",  # the offline pairs file's labelled pairs, whatever --epochs
            f"eval_every={n_pairs}",
        ]
        runs.append(Method(f"online_dpo_beta{b:g}", f"online DPO β={b:g}", "online DPO", b, overrides))
    if "pft" in args.methods:
        runs.append(Method("preferred_ft", "Preferred-FT", "Preferred-FT", None, [*chosen, "loss=sft"]))
    if "rm" in args.methods:  # not a point of its own: its scores pick Best-of-N (RM)
        overrides = [*pairs, "loss=reward", f"lr={args.rm_lr:g}", "save_hf_export=true"]  # LATEST/hf: what the scorer loads
        runs.append(Method("reward_model", "reward model", "reward model", None, overrides))
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


def refuse(message: str) -> None:
    """A user's mistake: one sentence on stderr, exit 2."""
    print(f"Error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


METHODS = ("dpo", "ipo", "cdpo", "online", "pft", "rm")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="output folder (null: outputs/frontier_<timestamp>)")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="the SFT policy and reference (a Hugging Face folder)")
    p.add_argument("--seed", type=int, default=0, help="the data's seed: stories, prompts, pairs and Best-of-N's samples")
    p.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds: every method is trained once per seed"
    )
    p.add_argument("--n-stories", type=int, default=2048, help="stories sampled to cut the prompts from")
    p.add_argument("--n-train", type=int, default=256, help="train prompts")
    p.add_argument("--n-test", type=int, default=128, help="held-out prompts (evaluation and Best-of-N)")
    p.add_argument("--min-words", type=int, default=2)
    p.add_argument("--max-words", type=int, default=8)
    p.add_argument("--k", type=int, default=4, help="completions per train prompt (k(k-1)/2 pairs at most)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="completion length (sampling, online DPO, evaluation)")
    p.add_argument(
        "--methods", nargs="+", default=list(METHODS), choices=list(METHODS), help="rm: the reward model of Best-of-N (RM)"
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
    p.add_argument("--rm-lr", type=float, default=1e-3, help="the reward model's lr (a trial at 1e-4 stayed at chance)")
    p.add_argument(
        "--epochs",
        type=float,
        default=1.0,
        help="passes over the pairs: every offline run trains on epochs x pairs examples (online DPO labels as many pairs as the file has)",
    )
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
    if len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds must be distinct, got {args.seeds}.")
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


def make_data(args, out: Path, model: str, common: list[str], runner: Runner, n_train: int, n_test: int) -> dict:
    """Steps 2 and 5's sampling, once for every training seed (the data, seeded by ``--seed``): the train and held-out
    pairs, Preferred-FT's rows, and the reference's ``max(--best-of)`` samples per held-out prompt."""
    seeded = [f"seed={args.seed}", *common]
    bon = out / "best_of_n.jsonl"
    runner.run(
        [
            pairs_job("best_of_n", model, out, seeded, "test", n_test, max(args.best_of), bon, ["max_pairs_per_prompt=1"]),
            pairs_job("pairs_train", model, out, seeded, "train", n_train, args.k, out / "pairs_train.jsonl"),
            pairs_job("pairs_test", model, out, seeded, "test", n_test, args.k, out / "pairs_test.jsonl"),
        ]
    )
    pairs = read_jsonl(out / "pairs_train.jsonl")
    write_jsonl(out / "preferred_train.jsonl", preferred_rows(pairs))
    offline = results.offline_budget(read_jsonl(out / "pairs_train.jsonl.samples.jsonl"), len(pairs))
    return {"n_pairs": len(pairs), "samples": read_jsonl(Path(f"{bon}.samples.jsonl")), "offline_budget": offline}


def train_overrides(args, model: str, budget: int, n_test: int, seed: int) -> list[str]:
    """train.py's overrides shared by every method: the model, the seed, the optimizer, the length, the eval."""
    return [
        "model=blank_model",
        f"model.name_or_path={model}",
        f"seed={seed}",
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


def eval_overrides(out: Path, n_test: int, common: list[str], seed: int) -> list[str]:
    """evaluate.py's overrides shared by every evaluation: the reward function on the held-out prompts at temperature 1."""
    return [
        "judge=reward_function",
        f"temperatures=[{TEMPERATURE:g}]",
        *prompt_data(out),
        f"n_prompts={n_test}",
        "top_k=0",
        "top_p=1.0",
        "max_prompt_length=64",
        f"seed={seed}",
        *common,
        "progress_bar=false",
    ]


def merged(common: list[str], overrides: list[str]) -> list[str]:
    """``common`` less the keys that ``overrides`` sets, then ``overrides``: one value per key in the printed command."""
    keys = {o.split("=", 1)[0] for o in overrides}
    return [o for o in common if o.split("=", 1)[0] not in keys] + overrides


def method_job(m: Method, seed: int, out: Path, train_common: list[str], eval_common: list[str], found: dict) -> Job:
    """Train method ``m`` from the model with ``seed``, then evaluate it against the model (a reward model: score
    Best-of-N's samples and the held-out pairs with it), then record what it gave in ``found``."""
    py = sys.executable
    root, folder = out / "runs" / m.name / f"seed{seed}", out / "eval" / m.name / f"seed{seed}"
    scores = out / "reward_model_scores" / f"seed{seed}.json"
    for old in (root, folder, scores):  # an earlier run's: the run folder is found below as the one folder in root
        if old.is_dir():
            shutil.rmtree(old)
        elif old.exists():
            old.unlink()
    train_cmd = [py, "train.py", *merged(train_common, m.overrides), f"output_root={shown_path(root)}", f"exp_name={m.name}"]

    def run() -> Path:
        (folder_made,) = root.iterdir()  # the run folder train.py made: <exp_name>_<timestamp>
        return folder_made

    def eval_cmd():
        return [
            py,
            "evaluate.py",
            f"policy={shown_path(run())}",
            "baseline=reference",
            *eval_common,
            f"label={m.name}_seed{seed}",
        ]

    if m.family == "reward model":
        scores.parent.mkdir(exist_ok=True)
        samples, pairs = out / "best_of_n.jsonl.samples.jsonl", out / "pairs_test.jsonl"
        second = lambda: [  # noqa: E731
            py, "scripts/reward_model_scores.py", "--reward-model", shown_path(run() / "LATEST" / "hf"),
            "--samples", shown_path(samples), "--pairs", shown_path(pairs), "--output", shown_path(scores),
        ]  # fmt: skip
        record = lambda: found["rm"].__setitem__(seed, json.loads(scores.read_text()))  # noqa: E731
        return Job(f"{m.name}_seed{seed}", [train_cmd, second], after=[record])

    def record():
        row = results.row_from_eval(json.loads((folder / "results.json").read_text()), m.family, m.label, m.beta)
        found["runs"][m.name, seed] = {**row, "eval": shown_path(folder)}
        if m.family == "online DPO":
            found["online_budget"][seed] = results.online_budget(read_jsonl(run() / "metrics.jsonl"))

    return Job(f"{m.name}_seed{seed}", [train_cmd, lambda: [*eval_cmd(), f"output_dir={shown_path(folder)}"]], after=[record])


def train_all(args, out: Path, model: str, common: list[str], runner: Runner, data: dict, n_test: int) -> tuple[dict, list[Job]]:
    """Steps 3 and 4: every method trained once per seed and evaluated (the reward model: its scores); returns what
    they gave (``runs``: (method, seed) -> row, ``rm``: seed -> scores, ``online_budget``: seed -> labels) and the jobs."""
    budget = max(1, round(data["n_pairs"] * args.epochs))
    found: dict = {"runs": {}, "rm": {}, "online_budget": {}}
    jobs = []
    for seed in args.seeds:
        train_common = train_overrides(args, model, budget, n_test, seed)
        eval_common = eval_overrides(out, n_test, common, seed)
        jobs += [method_job(m, seed, out, train_common, eval_common, found) for m in methods(args, out, data["n_pairs"])]
    online = [j for j in jobs if j.name.startswith("online")]  # the longest: sampling every step
    runner.run(online + [j for j in jobs if j not in online])
    return found, jobs


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

    train, test = make_prompts(args, out, model)  # 1. prompts, from the model's own stories
    common = ["num_threads=1", f"reward_functions=[{REWARD}]", f"max_new_tokens={args.max_new_tokens}"]
    runner = Runner(out, args.jobs)
    data = make_data(args, out, model, common, runner, len(train), len(test))  # 2. pairs, 5. Best-of-N's samples
    budget = max(1, round(data["n_pairs"] * args.epochs))
    print(
        f"[frontier] {data['n_pairs']} train pairs; every offline run trains on {budget} examples, online DPO labels "
        f"{data['n_pairs']} pairs; each once per seed of {args.seeds}",
        flush=True,
    )
    found, jobs = train_all(args, out, model, common, runner, data, len(test))  # 3. train, 4. evaluate

    sizes = {
        "n_train_prompts": len(train),
        "n_test_prompts": len(test),
        "n_train_pairs": data["n_pairs"],
        "examples_per_run": budget,
    }
    jobs_s = {j.name: round(j.seconds, 1) for j in jobs}
    return write_results(args, argv, out, frontier_points(args, out, data, found), sizes, model, started, jobs_s, runner.commands)


def frontier_points(args, out: Path, data: dict, found: dict) -> dict:
    """The table's rows in order (the reference, each trained method across seeds, Best-of-N, Best-of-N (RM) across
    seeds), the reward model's held-out pair accuracy per seed and across seeds, and the label budgets."""
    samples = data["samples"]
    rows = [results.reference_row(results.scores_by_prompt(samples))]
    trained = [m for m in methods(args, out, data["n_pairs"]) if m.family != "reward model"]
    rows += [results.across_seeds({s: found["runs"][m.name, s] for s in args.seeds}) for m in trained]
    rows += results.bon_rows(samples, args.best_of)
    rm = None
    if found["rm"]:
        per_seed = {s: results.bon_rm_rows(samples, found["rm"][s]["samples"], args.best_of) for s in args.seeds}
        for i in range(len(args.best_of)):
            rows.append(results.across_seeds({s: per_seed[s][i] for s in args.seeds}, names=("reward",)))
        accuracy = {s: results.pair_accuracy(found["rm"][s]["chosen"], found["rm"][s]["rejected"]) for s in args.seeds}
        mean, low, high = statistics.mean_interval(list(accuracy.values()))
        n_pairs = len(found["rm"][args.seeds[0]]["chosen"])
        rm = {
            "held_out_pair_accuracy": mean,
            "ci_low": low,
            "ci_high": high,
            "per_seed": accuracy,
            "n_pairs": n_pairs,
            "chance": 0.5,
        }
    online = {
        s: found["online_budget"][s] for s in args.seeds if s in found["online_budget"]
    }  # in seed order, not finishing order
    budgets = {"offline": data["offline_budget"], "online": online}
    return {"rows": rows, "reward_model": rm, "label_budgets": budgets}


def write_results(args, argv, out: Path, points: dict, sizes: dict, model: str, started: float, jobs_s: dict, commands) -> dict:
    """Step 6: frontier.md (the tables), frontier.png (the plot) and results.json in ``out``; returns results.json's contents."""
    wall = time.time() - started
    command = "python " + shlex.join(["scripts/frontier.py", *(sys.argv[1:] if argv is None else argv)])
    title = (
        f"{REWARD} reward against KL, {args.model.name} (DPO paper Figure 2, left, in miniature), seeds {args.seeds}\n"
        f"{sizes['n_train_prompts']} train prompts x {args.k} completions ({sizes['n_train_pairs']} pairs), "
        f"{sizes['n_test_prompts']} held-out prompts, temperature {TEMPERATURE:g}, <= {args.max_new_tokens} new tokens"
    )
    settings = {**sizes, "seeds": args.seeds, "samples_per_prompt": max(args.best_of), "lr": args.lr, "rm_lr": args.rm_lr}
    settings.update(batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, model=model, kl_bound=KL_BOUND)
    text = results.markdown(points, settings)
    heading = title.replace("\n", ": ", 1)
    (out / "frontier.md").write_text(f"# {heading}\n\n{text}\nCommand: `{command}` ({wall:.0f} s)\n", encoding="utf-8")
    results.plot_frontier(points["rows"], out / "frontier.png", title)
    written = {
        "command": command,
        "wall_s": wall,
        "date": datetime.date.today().isoformat(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        **sizes,
        **points,
        "jobs_s": jobs_s,
        "commands": commands,
    }
    (out / "results.json").write_text(json.dumps(written, indent=2) + "\n", encoding="utf-8")
    print(f"\n{text}")
    if args.copy_plot:
        args.copy_plot.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out / "frontier.png", args.copy_plot)
    print(
        f"[frontier] {out}/frontier.png, frontier.md, results.json ({wall:.0f} s)"
        + (f"; plot copied to {args.copy_plot}" if args.copy_plot else "")
    )
    return written


if __name__ == "__main__":
    main()
