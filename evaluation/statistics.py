"""The statistics of evaluate.py's results.json: verdicts from a judge's answers, win rates and their 95% intervals."""

from __future__ import annotations

import math

from evaluation import rewards

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
