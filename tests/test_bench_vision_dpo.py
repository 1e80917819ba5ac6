"""bench/bench_vision_dpo.py (issue 38: image DPO, ours vs TRL's DPOTrainer on model=tiny_vlm): the two sides' data
formats, the command line, and the harness itself at its smallest (both sides in their own processes, one step)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from conftest import REPO, needs_shared

sys.path.insert(0, str(REPO / "bench"))
import bench_vision_dpo as bv  # noqa: E402

PAIR = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Q?"}]}], "chosen": "red"}


def test_the_same_pair_in_each_sides_format(tmp_path):
    from PIL import Image

    Image.new("RGB", (4, 4), (255, 0, 0)).save(tmp_path / "0.png")
    pair = {**PAIR, "rejected": "blue", "image": str(tmp_path / "0.png")}
    (ours,) = bv.our_examples([pair])
    assert ours == {
        "prompt": PAIR["messages"],
        "chosen": "red",
        "rejected": "blue",
        "images": [str(tmp_path / "0.png")],
        "truncation_mode": "keep_start",  # TRL refuses keep_end for images; nothing is cut on either side anyway
    }
    trl = bv.trl_rows([pair])  # TRL's vision format: prompt messages with an image part, images, answers as messages
    assert trl["prompt"] == [PAIR["messages"]]
    assert trl["chosen"] == [[{"role": "assistant", "content": [{"type": "text", "text": "red"}]}]]
    assert trl["rejected"] == [[{"role": "assistant", "content": [{"type": "text", "text": "blue"}]}]]
    assert [im.getpixel((1, 1)) for (im,) in trl["images"]] == [(255, 0, 0)]


def test_defaults_are_the_presets_lengths_and_bench_dpos_fairness_settings():
    args = bv.build_parser().parse_args([])
    assert (args.batch_size, args.max_length, args.lr, args.beta, args.trl_optim) == (8, 48, 1e-4, 0.1, "adamw_torch")
    assert (args.steps, args.warmup, args.rounds) == (20, 3, 2)


@pytest.mark.timeout(400)
def test_end_to_end_one_step_each_side_trains_the_same_pairs(tmp_path):
    """Both sides in their own processes at the smallest setting: the same pairs per step (2 rows per pair), the
    same prompt ids and pixel values, step-0 loss ln 2 on both, each side's own peak RSS and a ratio."""
    pytest.importorskip("trl", reason="TRL is not installed: pip install -r requirements-bench.txt")
    needs_shared("tokenizers", "smollm2-135m-instruct")
    out = tmp_path / "out.json"
    cmd = [sys.executable, str(REPO / "bench" / "bench_vision_dpo.py"), "--steps", "1", "--warmup", "0", "--rounds", "1"]
    cmd += ["--batch-size", "2", "--wait-quiet", "0", "--retries", "0", "--max-others", "99", "--json", str(out)]
    done = subprocess.run(["bash", "-c", '"$@"; exit $?', "bash", *cmd], capture_output=True, text=True, timeout=380, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    prep, (row,) = result["prepare"], result["rows"]
    assert prep["prompt_ids_equal"] == [True] and prep["pixel_values_equal"] == [True]
    assert result["rows_per_step"] == {"ours": [4], "trl": [4]}
    assert row["ours"]["losses"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert row["trl"]["losses"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert row["speed_ratio"] == pytest.approx(row["ours"]["pairs_per_s"] / row["trl"]["pairs_per_s"])
    assert 100 < row["ours"]["rss_peak_mib"] < 4000 and 100 < row["trl"]["rss_peak_mib"] < 4000
    assert "tiny_vlm live" in done.stdout and "step-0 loss ours 0.693147  TRL 0.693147" in done.stdout
