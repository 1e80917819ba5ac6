"""The closed-form oracle: every paired objective trained on a task whose completions are enumerable, against its optimum.

The task: P prompts, K completions each, a tabular policy with logits theta[x, y] started at the reference's,
log pi(y|x) = log_softmax(theta[x])[y]; the reference pi_ref(y|x) and the reward r(x, y) ~ N(0, 1) are drawn from a seed.
The pairs are every ordered pair (y, y'), y != y', of every prompt, weighted by the Bradley-Terry preference
p(y > y') = sigmoid(r(x, y) - r(x, y')) (or, deterministic, 1 if r(x, y) > r(x, y') else 0): the population loss, so the
optimum is exact. Each objective's per-pair losses come from ``losses.OBJECTIVES[name].compute`` (one-token responses).
With g(y) = log pi(y|x) - log pi_ref(y|x) and h = g(y) - g(y'), the optima (derived from the population loss):

* DPO (Rafailov et al. 2023, Eq. 4): the pair {y, y'} contributes -p log sigmoid(beta h) - (1 - p) log sigmoid(-beta h),
  minimal at sigmoid(beta h) = p, i.e. beta h = r(y) - r(y'); every pair is met at once by
  pi*(y|x) ∝ pi_ref(y|x) exp(r(x, y) / beta), and the implicit reward beta g equals r up to a constant per prompt.
* cDPO (label smoothing eps): -p' log sigmoid(beta h) - (1 - p') log sigmoid(-beta h) with p' = (1 - eps) p + eps (1 - p),
  minimal at beta h = logit(p'); deterministic (p = 1): beta h = log((1 - eps) / eps), finite. K = 2: one margin per
  prompt, always consistent (for K > 2 the logits of p' need not be differences of one g).
* IPO (Azar et al. 2023, tau = beta): p (h - 1/(2 tau))^2 + (1 - p)(h + 1/(2 tau))^2 = (h - (2p - 1)/(2 tau))^2 + const,
  so the optimum is the least-squares g over all pairs of g(y) - g(y') = (2p(y > y') - 1) / (2 tau): for K = 2,
  h = (2p - 1) / (2 tau); deterministic, h = 1 / (2 tau), where DPO's h has no finite optimum (its loss falls as h grows).
* f-DPO (reverse KL), rDPO (eps = 0), LD-DPO and sigmoid_norm (one-token responses): DPO's loss, so DPO's pi*.
* The others have no closed form here: the table reports where they converge (KL to DPO's pi*, implicit-reward error).

Stopping rule: L-BFGS (strong Wolfe, float64) until the gradient's largest entry is below ``GRAD_TOL`` or the loss
stops moving (an outer step changing it by under 1e-15) or ``MAX_STEPS`` outer steps; the table shows the gradient at
the stop. ``python -m evaluation.oracle`` writes docs/oracle.md and docs/oracle.png (under half a minute on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import objectives  # noqa: F401  (registers every objective)
from losses import OBJECTIVES, PAIR_LOGPS, Objective, ObjectiveInputs

BETA = 0.5  # beta of every objective (IPO's tau); the reward has unit variance, so pi* is neither flat nor one-hot
PROMPTS, COMPLETIONS = 8, 4  # the task's size (K = 2 for the saturation cases)
SEEDS = (0, 1, 2, 3, 4)  # problem draws per objective
EPSILONS = (0.1, 0.25)  # cDPO's label smoothing
GRAD_TOL, MAX_STEPS = 1e-9, 200  # L-BFGS's stop: the gradient's largest entry, or this many outer steps of 20 iterations
ADAM_LR, ADAM_STEPS = 0.05, 300  # the deterministic case: Adam for N and 10 N steps
FILLABLE = {*PAIR_LOGPS, "chosen_n_tokens", "rejected_n_tokens", "policy_chosen_nll"}  # what the tabular task computes
NOT_TRAINED = {  # registered objectives the tabular task does not train, one reason each
    "kto": "learns from unpaired rows {prompt, completion, label} and a reference point from mismatched pairs",
    "reward": "trains a score head (a reward model), not a policy",
    "sft": "trains on each prompt's SFT target alone, no pairs",
    "wpo": "weighs pairs by per-token statistics of the policy's logits, which a tabular policy has not got",
    "mix": "a weighted combination of other objectives, each covered on its own",
    "aot": "sorts the batch's margins, so a loss belongs to a rank, not to a pair, and the pairs' weights cannot apply",
    "aot_unpaired": "sorts the batch's log-ratios, so a loss belongs to a rank, not to a pair, and the pairs' weights cannot apply",
}
CLOSED_FORM = {"dpo": "pi*", "f_dpo": "pi*", "robust": "pi*", "ld_dpo": "pi*", "sigmoid_norm": "pi*", "ipo": "IPO's g*"}


@dataclasses.dataclass
class Problem:
    """One draw of the task: the reference's log-probs and the reward, (P, K) each, float64."""

    reference_logps: torch.Tensor
    reward: torch.Tensor
    deterministic: bool = False  # p in {0, 1} from the order of r, not Bradley-Terry's


def draw_problem(seed: int, prompts: int = PROMPTS, completions: int = COMPLETIONS, deterministic: bool = False) -> Problem:
    """The task drawn from ``seed``: reference logits and rewards ~ N(0, 1), (P, K) each."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(prompts, completions, generator=generator, dtype=torch.float64)
    reward = torch.randn(prompts, completions, generator=generator, dtype=torch.float64)
    return Problem(torch.log_softmax(logits, dim=-1), reward, deterministic)


def preference(problem: Problem) -> torch.Tensor:
    """p(y > y' | x), (P, K, K): Bradley-Terry's sigmoid(r(y) - r(y')), or the order of r when deterministic."""
    gap = problem.reward[:, :, None] - problem.reward[:, None, :]
    return (gap > 0).to(gap.dtype) if problem.deterministic else torch.sigmoid(gap)


def ordered_pairs(problem: Problem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every ordered pair (x, y, y'), y != y', as (prompt, chosen, rejected) indices (N,) and its weight p(y > y'), (N,)."""
    prompts, completions = problem.reward.shape
    x, y, y_other = torch.meshgrid(torch.arange(prompts), torch.arange(completions), torch.arange(completions), indexing="ij")
    keep = y != y_other
    x, y, y_other = x[keep], y[keep], y_other[keep]
    return x, y, y_other, preference(problem)[x, y, y_other]


def loss_config(name: str, **overrides) -> dict:
    """The ``loss`` section of objective ``name``: its defaults, ``beta`` = :data:`BETA`, then ``overrides``."""
    decl = OBJECTIVES[name]
    values = {key: spec.default for key, spec in decl.keys_for({}).items()}
    values.update({"beta": BETA} if "beta" in values else {}, **overrides)
    return {"name": name, **values}


def population_loss(logits: torch.Tensor, problem: Problem, decl: Objective, config: dict, pairs=None) -> torch.Tensor:
    """The objective's expected loss per prompt over the pairs, each pair's loss from the project's own code.

    Args:
        logits: theta, (P, K), the tabular policy's logits.
        problem: the task; its pairs and weights come from :func:`ordered_pairs`.
        decl: the registered objective; ``config`` its ``loss`` section.
        pairs: :func:`ordered_pairs` of ``problem``, if already computed.

    Returns:
        A scalar: sum over pairs of p(y > y') times the loss of (chosen = y, rejected = y'), divided by P.
    """
    x, chosen, rejected, weight = ordered_pairs(problem) if pairs is None else pairs
    policy = torch.log_softmax(logits, dim=-1)
    ones = torch.ones_like(weight)
    inputs = ObjectiveInputs(
        policy_chosen_logps=policy[x, chosen],
        policy_rejected_logps=policy[x, rejected],
        reference_chosen_logps=problem.reference_logps[x, chosen],
        reference_rejected_logps=problem.reference_logps[x, rejected],
        chosen_n_tokens=ones,  # one-token responses: sums and means per token agree
        rejected_n_tokens=ones,
        policy_chosen_nll=-policy[x, chosen],  # the chosen NLL per token of a one-token response
    )
    out = decl.compute(inputs, config)
    return (weight * out.losses).sum() / problem.reward.shape[0]


@contextlib.contextmanager
def one_thread():
    """Run the block on one intra-op thread (tensors of a few dozen entries: threads cost ten times the arithmetic)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@one_thread()
def train(problem: Problem, config: dict, max_steps: int = MAX_STEPS) -> tuple[torch.Tensor, dict]:
    """Minimise :func:`population_loss` with L-BFGS from the reference's logits until the stopping rule holds.

    Returns:
        (log pi, (P, K) detached; {"grad": the gradient's largest entry at the stop, "steps": outer steps}).
    """
    decl, pairs = OBJECTIVES[config["name"]], ordered_pairs(problem)
    logits = problem.reference_logps.clone().requires_grad_(True)
    optimizer = torch.optim.LBFGS(
        [logits], lr=1, max_iter=20, history_size=50, tolerance_grad=GRAD_TOL / 10, tolerance_change=1e-16,
        line_search_fn="strong_wolfe",
    )  # fmt: skip

    def closure():
        optimizer.zero_grad()
        loss = population_loss(logits, problem, decl, config, pairs)
        loss.backward()
        return loss

    previous, steps = math.inf, 0
    while steps < max_steps:
        steps += 1
        loss = float(optimizer.step(closure).detach())
        if float(logits.grad.abs().max()) < GRAD_TOL or abs(previous - loss) < 1e-15:
            break
        previous = loss
    closure()  # the gradient at the final logits
    grad = float(logits.grad.abs().max())
    return torch.log_softmax(logits.detach(), dim=-1), {"grad": grad, "steps": steps}


@one_thread()
def train_adam(problem: Problem, config: dict, steps: int, lr: float = ADAM_LR) -> list[torch.Tensor]:
    """Full-batch Adam on :func:`population_loss` from the reference's logits; log pi (P, K) after each step."""
    decl, pairs = OBJECTIVES[config["name"]], ordered_pairs(problem)
    logits = problem.reference_logps.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([logits], lr=lr)
    trajectory = []
    for _ in range(steps):
        optimizer.zero_grad()
        population_loss(logits, problem, decl, config, pairs).backward()
        optimizer.step()
        trajectory.append(torch.log_softmax(logits.detach(), dim=-1))
    return trajectory


def dpo_optimum(problem: Problem, beta: float = BETA) -> torch.Tensor:
    """log pi*(y|x), pi* ∝ pi_ref exp(r / beta) (DPO, Eq. 4), (P, K)."""
    return torch.log_softmax(problem.reference_logps + problem.reward / beta, dim=-1)


def ipo_optimum(problem: Problem, tau: float = BETA) -> torch.Tensor:
    """IPO's optimal g = log pi - log pi_ref, (P, K), each prompt's mean removed: the least-squares solution of
    g(y) - g(y') = (2 p(y > y') - 1) / (2 tau) over the prompt's pairs."""
    prompts, completions = problem.reward.shape
    i, j = torch.triu_indices(completions, completions, offset=1)
    design = F.one_hot(i, completions).double() - F.one_hot(j, completions).double()  # (pairs, K)
    target = (2 * preference(problem)[:, i, j] - 1) / (2 * tau)  # (P, pairs)
    solution = torch.linalg.lstsq(design.expand(prompts, -1, -1), target.unsqueeze(-1)).solution.squeeze(-1)
    return solution - solution.mean(-1, keepdim=True)


def cdpo_margin(p: torch.Tensor, epsilon: float) -> torch.Tensor:
    """cDPO's optimal implicit-reward margin beta h = logit(p'), p' = (1 - eps) p + eps (1 - p)."""
    smoothed = (1 - epsilon) * p + epsilon * (1 - p)
    return torch.log(smoothed) - torch.log1p(-smoothed)


def kl(logp: torch.Tensor, logq: torch.Tensor) -> float:
    """KL(p || q) in nats over the last axis, averaged over prompts."""
    return float((logp.exp() * (logp - logq)).sum(-1).mean())


def centered(values: torch.Tensor) -> torch.Tensor:
    """``values`` (P, K) with each prompt's mean removed."""
    return values - values.mean(-1, keepdim=True)


def rms(values: torch.Tensor) -> float:
    """The root mean square of ``values``."""
    return float(values.pow(2).mean().sqrt())


def reward_error(policy_logps: torch.Tensor, problem: Problem, beta: float = BETA) -> float:
    """RMS over (x, y) of beta log(pi / pi_ref) - r, each prompt's mean removed from both (the implicit-reward error)."""
    return rms(centered(beta * (policy_logps - problem.reference_logps)) - centered(problem.reward))


def trained_objectives() -> list[str]:
    """The registered paired objectives whose inputs the tabular task fills, by name (the others: :func:`not_trained`)."""
    return sorted(name for name in OBJECTIVES if name not in not_trained())


def not_trained() -> dict[str, str]:
    """Registered objectives the task does not train, with the reason."""
    out = {}
    for name, decl in OBJECTIVES.items():
        missing = sorted(set(decl.needs) - FILLABLE)
        if name in NOT_TRAINED:
            out[name] = NOT_TRAINED[name]
        elif not decl.paired or decl.unpaired or missing:
            out[name] = f"needs {', '.join(missing) or 'unpaired rows'}, which a tabular policy has not got"
    return out


def measure(name: str, seed: int, **overrides) -> dict:
    """Train objective ``name`` on seed ``seed``'s task (BT preferences, K = :data:`COMPLETIONS`) and measure it."""
    problem = draw_problem(seed)
    policy, info = train(problem, loss_config(name, **overrides))
    row = {"kl": kl(policy, dpo_optimum(problem)), "reward_error": reward_error(policy, problem), **info}
    if name == "ipo":
        row["own"] = rms(centered(policy - problem.reference_logps) - ipo_optimum(problem))
    elif CLOSED_FORM.get(name) == "pi*":
        row["own"] = row["kl"]
    return row


def measure_cdpo(seed: int, epsilon: float, deterministic: bool) -> dict:
    """cDPO (``loss=dpo`` with ``label_smoothing``) on seed ``seed``'s K = 2 task: the largest |beta h - its optimum|."""
    problem = draw_problem(seed, completions=2, deterministic=deterministic)
    policy, info = train(problem, loss_config("dpo", label_smoothing=epsilon))
    margin = BETA * ((policy - problem.reference_logps)[:, 0] - (policy - problem.reference_logps)[:, 1])
    expected = cdpo_margin(preference(problem)[:, 0, 1], epsilon)
    return {"own": float((margin - expected).abs().max()), "margin": float(margin.abs().mean()), **info}


def deterministic_case(seed: int = 0, steps: int = ADAM_STEPS) -> dict:
    """DPO, IPO and cDPO (eps = 0.1) on seed ``seed``'s deterministic K = 2 task with Adam for 10 ``steps`` steps:
    the mean over prompts of the implicit-reward margin beta h (oriented to the preferred completion) after each
    step, by objective, and of pi(preferred | x) at the end."""
    problem = draw_problem(seed, completions=2, deterministic=True)
    sign = torch.where(problem.reward[:, 0] > problem.reward[:, 1], 1.0, -1.0).double()  # orient each prompt to its winner
    out = {}
    for label, config in (
        ("dpo", loss_config("dpo")),
        ("ipo", loss_config("ipo")),
        ("cdpo (eps=0.1)", loss_config("dpo", label_smoothing=0.1)),
    ):
        trajectory = train_adam(problem, config, 10 * steps)
        margins = [float((BETA * sign * ((lp - problem.reference_logps) @ torch.tensor([1.0, -1.0]).double())).mean())
                   for lp in trajectory]  # fmt: skip
        winner = torch.where(sign > 0, trajectory[-1][:, 0], trajectory[-1][:, 1]).exp()
        out[label] = {"margins": margins, "p_winner": float(winner.mean()), "p_winner_min": float(winner.min())}
    return out


def summary(values: list[float]) -> str:
    """``mean [min, max]`` of the values over seeds, in 3 significant figures."""
    return f"{sum(values) / len(values):.3g} [{min(values):.3g}, {max(values):.3g}]"


def run(seeds=SEEDS, names=None, progress: bool = True) -> dict:
    """Every measure of the report: per objective its rows over ``seeds``, cDPO's cases and the deterministic case."""
    names = trained_objectives() if names is None else names
    jobs = [(name, seed) for name in names for seed in seeds]
    results: dict = {"objectives": {name: [] for name in names}, "cdpo": {}}
    for name, seed in tqdm(jobs, desc="oracle: objectives x seeds", disable=not progress):
        results["objectives"][name].append(measure(name, seed))
    for epsilon in EPSILONS:
        for deterministic in (True, False):
            rows = [measure_cdpo(seed, epsilon, deterministic) for seed in seeds]
            results["cdpo"][(epsilon, deterministic)] = rows
    results["deterministic"] = deterministic_case(seeds[0])
    return results


def objectives_table(results: dict) -> list[str]:
    """The Markdown table of the trained objectives: distance to their own optimum, KL to DPO's pi*, the reward error."""
    lines = [
        f"| objective | its optimum | distance to it (mean [min, max] over {len(next(iter(results['objectives'].values())))}"
        " seeds) | KL(π ‖ π*) nats | implicit-reward RMS error | largest gradient entry at the stop |",
        "|---|---|---|---|---|---|",
    ]
    for name, rows in results["objectives"].items():
        form = CLOSED_FORM.get(name)
        own = summary([r["own"] for r in rows]) if form else "no closed form"
        optimum = {"pi*": "π* (KL, nats)", "IPO's g*": "IPO's least squares (RMS of log-ratios)"}.get(form, "—")
        grad = max(r["grad"] for r in rows)
        cells = [f"`{name}`", optimum, own, summary([r["kl"] for r in rows]), summary([r["reward_error"] for r in rows])]
        lines.append("| " + " | ".join(cells) + f" | {grad:.1e} |")
    return lines


def cdpo_table(results: dict) -> list[str]:
    """The Markdown table of cDPO's K = 2 cases: the largest |beta h - logit(p')| and the mean |beta h|."""
    lines = [
        "| ε | preferences | optimum β·h | largest \\|β·h − optimum\\| (mean [min, max]) | mean \\|β·h\\| |",
        "|---|---|---|---|---|",
    ]
    for (epsilon, deterministic), rows in results["cdpo"].items():
        optimum = f"log((1−ε)/ε) = {math.log((1 - epsilon) / epsilon):.4f}" if deterministic else "logit(p′)"
        kind = "deterministic" if deterministic else "Bradley–Terry"
        margins = summary([r["margin"] for r in rows])
        lines.append(f"| {epsilon} | {kind} | {optimum} | {summary([r['own'] for r in rows])} | {margins} |")
    return lines


def deterministic_lines(results: dict, steps: int = ADAM_STEPS) -> list[str]:
    """The deterministic case's table: the mean margin beta h after N and 10 N Adam steps, and pi(preferred)."""
    lines = [
        f"| objective | its optimum β·h | β·h after N = {steps} steps | after 10 N = {10 * steps} | mean (min) π(preferred) at 10 N |",
        "|---|---|---|---|---|",
    ]
    optimum = {"dpo": "none (grows without bound)", "ipo": f"β/(2τ) = {BETA / (2 * BETA)}",
               "cdpo (eps=0.1)": f"log(0.9/0.1) = {math.log(9):.4f}"}  # fmt: skip
    for label, row in results["deterministic"].items():
        after_n, after_10n = row["margins"][steps - 1], row["margins"][-1]
        lines.append(
            f"| {label} | {optimum[label]} | {after_n:.4f} | {after_10n:.4f} | {row['p_winner']:.6f} ({row['p_winner_min']:.6f}) |"
        )
    return lines


def markdown(results: dict) -> str:
    """docs/oracle.md's text."""
    skipped = "\n".join(f"- `{name}`: {why}." for name, why in sorted(not_trained().items()))
    return "\n".join([
        "# Does each objective reach its optimum? (the closed-form oracle)",
        "",
        "Written by `python -m evaluation.oracle` ([evaluation/oracle.py](../evaluation/oracle.py), whose docstring derives",
        f"each optimum; under half a minute on 2 CPU cores). The task: {PROMPTS} prompts, {COMPLETIONS} completions each, a tabular",
        "policy started at the reference, reference logits and rewards ~ N(0, 1) drawn from each seed, every ordered pair of",
        "completions weighted by its Bradley–Terry preference σ(r − r′) (the population loss: no sampling noise), each",
        f"pair's loss from `losses.OBJECTIVES[name].compute`, β = τ = {BETA} for every objective (its other keys at their",
        "defaults), L-BFGS in float64 until the gradient's largest entry is below "
        f"{GRAD_TOL:g} or the loss stops moving. π* ∝ π_ref exp(r/β) is DPO's optimum;",
        "the implicit-reward error is the RMS of β log(π/π_ref) − r after removing each prompt's mean from both.",
        "",
        *objectives_table(results),
        "",
        "A gradient far above the tolerance at the stop means the loss stopped moving, not a stationary point: `hinge` is",
        "piecewise linear, and `apo_down` (like `apo_zero`, whose implicit-reward error is as large) saturates, its",
        "log-ratios running off without bound.",
        "",
        "## Conservative DPO (`loss=dpo loss.label_smoothing=ε`), K = 2",
        "",
        "The implicit-reward margin β·h = β (log π/π_ref (y) − log π/π_ref (y′)) of each prompt against its optimum",
        "logit(p′), p′ = (1 − ε) p + ε (1 − p): log((1 − ε)/ε) for deterministic preferences.",
        "",
        *cdpo_table(results),
        "",
        "## Deterministic preferences: DPO diverges, IPO stays (Azar et al. 2023, Section 4)",
        "",
        "K = 2, p ∈ {0, 1} from the order of r, seed " f"{SEEDS[0]}, full-batch Adam (lr {ADAM_LR}); β·h is the mean over",
        "prompts of the margin towards the preferred completion. DPO's margin keeps growing and π(preferred) goes to 1;",
        "IPO's stays at its optimum β/(2τ), cDPO's at log((1 − ε)/ε) ([oracle.png](oracle.png), left).",
        "",
        *deterministic_lines(results),
        "",
        "![DPO vs IPO margins under deterministic preferences; KL to π* per objective](oracle.png)",
        "",
        "## Not trained here",
        "",
        skipped,
        "",
    ])  # fmt: skip


def plot(results: dict, path: Path) -> None:
    """docs/oracle.png: the deterministic case's margins against steps; each objective's KL to pi* over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, row in results["deterministic"].items():
        left.plot(range(1, len(row["margins"]) + 1), row["margins"], label=label)
    left.set(
        xscale="log", xlabel="Adam steps", ylabel="mean implicit-reward margin β·h", title="deterministic preferences, K = 2"
    )
    left.legend()
    names = list(results["objectives"])
    kls = [[max(r["kl"], 1e-16) for r in results["objectives"][n]] for n in names]
    means = [sum(v) / len(v) for v in kls]
    errors = [
        [max(m - min(v), 0) for m, v in zip(means, kls)],
        [max(max(v) - m, 0) for m, v in zip(means, kls)],
    ]  # >= 0 despite rounding
    right.barh(names, means, xerr=errors, color="tab:blue")
    right.set(xscale="log", xlabel="KL(π ‖ π*) nats, mean and range over seeds", title="where each objective converges")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(folder: Path, seeds=SEEDS, progress: bool = True) -> dict:
    """Run every measure and write ``oracle.md`` and ``oracle.png`` into ``folder``; returns the results."""
    results = run(seeds, progress=progress)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "oracle.md").write_text(markdown(results))
    plot(results, folder / "oracle.png")
    return results


def main(argv=None) -> None:
    """``python -m evaluation.oracle [--out docs]``: write docs/oracle.md and docs/oracle.png."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs")
    args = parser.parse_args(argv)
    write_report(args.out)
    print(f"wrote {args.out / 'oracle.md'} and {args.out / 'oracle.png'}")


if __name__ == "__main__":
    main()
