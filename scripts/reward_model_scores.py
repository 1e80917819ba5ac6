"""A reward model's scores of given texts: each completion of make_pairs.py's samples file, and the chosen and
rejected of a pairs file, scored as ``judge=reward_model`` and online DPO score them (evaluation.rewards.RewardModelScorer).

    python scripts/reward_model_scores.py --reward-model <run>/LATEST/hf --samples <output>.samples.jsonl \
        --pairs <pairs>.jsonl --output scores.json

It writes ``{"reward_model", "samples": [one score per sample, in the file's order], "chosen": [...], "rejected": [...]}``
(scripts/frontier.py's Best-of-N by a reward model and the reward model's held-out pair accuracy).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: list[str] | None = None) -> dict:
    """Score the files; returns what it writes to ``--output``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reward-model", required=True, help="a reward model's Hugging Face folder (a loss=reward run's LATEST/hf)")
    p.add_argument("--samples", type=Path, required=True, help="make_pairs.py's <output>.samples.jsonl")
    p.add_argument("--pairs", type=Path, default=None, help="a pairs file (prompt, chosen, rejected) whose both sides to score")
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--batch-size", type=int, default=64)
    args = p.parse_args(argv)
    if not (Path(args.reward_model) / "config.json").is_file():
        p.error(
            f"--reward-model {args.reward_model} is not a Hugging Face model folder (no config.json); give a loss=reward run's LATEST/hf."
        )
    for name, path in (("--samples", args.samples), ("--pairs", args.pairs)):
        if path is not None and not path.is_file():
            p.error(f"{name} {path} is not a file; give make_pairs.py's output (its .samples.jsonl for --samples).")

    import utils
    from evaluation.rewards import RewardModelScorer
    from utils import ConfigError

    utils.set_threads(1)
    try:
        scorer = RewardModelScorer(args.reward_model, batch_size=args.batch_size)
    except ConfigError:  # its sentence names reward_model.* keys, which this script does not have
        raise SystemExit(
            f"Error: --reward-model {args.reward_model} has no trained score head; give a reward model (a loss=reward run's LATEST/hf)."
        ) from None
    except (ValueError, OSError) as e:
        raise SystemExit(f"Error: --reward-model {args.reward_model}: {e}") from None
    samples = read_jsonl(args.samples)
    out = {
        "reward_model": args.reward_model,
        "samples": scorer.score([s["prompt"] for s in samples], [s["completion"] for s in samples]).tolist(),
    }
    if args.pairs is not None:
        pairs = read_jsonl(args.pairs)
        prompts = [q["prompt"] for q in pairs]
        for side in ("chosen", "rejected"):
            out[side] = scorer.score(prompts, [q[side] for q in pairs]).tolist()
    args.output.write_text(json.dumps(out) + "\n", encoding="utf-8")
    print(
        f"[reward_model_scores] {len(samples)} samples"
        + (f" and {len(pairs)} pairs" if args.pairs else "")
        + f" scored: {args.output}"
    )
    return out


if __name__ == "__main__":
    main()
