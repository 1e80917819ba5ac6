"""Every option acts (issue 37, part 3) on the paths of several processes: one torchrun launch (2 ranks, gloo, CPU) per
path of tests/option_cells.py's PATHS (FSDP, tensor parallel) runs tests/options_act_worker.py, every (objective, key)
cell one forward and backward there: each key changes the loss or the gradient on some rank, or the path refuses it in
one sentence before anything loads (runs/checks.py); packing and the output layer's chunking change neither."""

from __future__ import annotations

import json

import pytest
from conftest import run_torchrun
from option_cells import PATHS, TRAINER_KEYS, UNPAIRED_KEYS, one_sentence

SEVERAL = [name for name, spec in PATHS.items() if spec.processes > 1]


@pytest.mark.parametrize("path", SEVERAL)
def test_each_key_acts_on_a_path_of_several_processes_or_is_refused(tmp_path, path):
    code, text = run_torchrun(["tests/options_act_worker.py", path, str(tmp_path)], timeout=300)
    assert code == 0, text[-4000:]
    result = json.loads(next(line for line in text.splitlines() if line.startswith("RESULT "))[len("RESULT ") :])
    counts = f"{path}: {len(result['acts'])} (objective, key) cells act, {len(result['refused'])} refused"
    assert len(result["acts"]) + len(result["silent"]) + len(result["refused"]) == len(TRAINER_KEYS) + len(UNPAIRED_KEYS)
    assert not result["silent"], f"{counts}; keys that change nothing on {path}: {result['silent']}"
    for name, key, sentence in result["refused"]:
        assert one_sentence(sentence), f"loss={name} loss.{key} on {path}: {sentence}"
    assert not result["differs"], f"{counts}; the padded forward disagrees with (objective, forward): {result['differs']}"
    print(counts)  # the count of cells, in the output of -s
