"""The equivalence matrix (issue 37, part 2, evaluation/equivalence.py): the one-process cells for dpo, ipo and simpo,
the FSDP and tensor-parallel cells of several objectives in one launch each (evaluation/equivalence_worker.py), --merge,
and docs/equivalence.md naming every cell and objective."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from evaluation import equivalence, equivalence_worker

REPO = Path(__file__).resolve().parents[1]
ONE_PROCESS = ["reversed", "packed", "chunked", "precomputed", "accum 8x1", "accum 2x4", "resume", "lora"]


def cells_of(name: str, cells: list[str]) -> dict[str, equivalence.Result]:
    """The ``cells`` of objective ``name``, run: cell name -> Result."""
    results = equivalence.run_matrix([name], [equivalence.CELLS[c] for c in cells], progress=False)
    return {c: results[name, c] for c in cells}


def assert_within_tolerance(name: str, results: dict[str, equivalence.Result]) -> None:
    for cell, result in results.items():
        assert not result.over, f"loss={name}, {cell}: {result.text()}"
        assert result.loss_diff is not None or result.note.startswith("not run: "), f"loss={name}, {cell}: {result.note}"


@pytest.mark.integration
@pytest.mark.parametrize("name", ["dpo", "ipo", "simpo"])
def test_the_one_process_cells_match_the_padded_run(name):
    results = cells_of(name, ONE_PROCESS)
    assert_within_tolerance(name, results)
    measured = {c for c, r in results.items() if r.loss_diff is not None}
    no_reference = {"precomputed", "lora"} if name == "simpo" else set()  # simpo refuses a reference
    assert measured == set(ONE_PROCESS) - no_reference


@pytest.mark.integration
def test_sft_under_accumulation_differs_by_declaration_in_its_logged_loss_alone():
    # Its logged loss is the mean of the micro-batches' means per token (7e-3 off with 8 micro-batches of 1); the weights
    # must still agree.
    result = cells_of("sft", ["accum 8x1"])["accum 8x1"]
    assert result.note == "declared" and result.loss_diff > equivalence.ONE_PROCESS.loss
    assert not result.over and result.weight_diff <= equivalence.SPLIT.weight, result.text()


@pytest.mark.system
def test_fsdp_and_tensor_parallel_cells_run_several_objectives_in_one_launch_each(tmp_path):
    # One launch per cell: ipo first, then kto failing after its process group started (a loss that is not finite at
    # step 2), simpo refused before it, then dpo: each outcome is its own objective's, and dpo, run after a failure in
    # the same ranks, still ends within tolerance of its own fresh baseline (not from ipo's weights, nor kto's group).
    fsdp, tp = equivalence.CELLS["fsdp"], equivalence.CELLS["tp"]
    baselines = {
        n: equivalence.run_in_process([*equivalence.BASE, f"loss={n}", f"output_root={tmp_path / n}"], False)
        for n in ("ipo", "dpo")
    }
    jobs = {"ipo": baselines["ipo"], "kto": tmp_path, "simpo": tmp_path, "dpo": baselines["dpo"]}
    extra = {"kto": ["lr=1e30"], "simpo": ["loss.beta=-1"]}
    results = equivalence.run_process_cell(fsdp, jobs, tmp_path / "fsdp", extra=extra)
    assert list(results) == ["ipo", "kto", "simpo", "dpo"]
    for name in ("ipo", "dpo"):
        assert not results[name].over and results[name].loss_diff is not None, f"fsdp, loss={name}: {results[name]}"
    assert results["kto"].over and results["kto"].note.startswith("failed: NonFiniteLossError: "), results["kto"].note
    assert results["simpo"].note == "not run: refused" and "loss.beta must be > 0" in results["simpo"].refusal
    assert not results["simpo"].over
    results = equivalence.run_process_cell(tp, baselines, tmp_path / "tp")
    assert_within_tolerance("tp", results)
    assert all(r.loss_diff is not None for r in results.values())


def outcome_line(name: str, status: str, text: str = "", lost_peer: bool = False) -> str:
    return json.dumps({"name": name, "status": status, "text": text, "lost_peer": lost_peer})


def test_a_launch_attributes_each_outcome_to_its_objective_and_its_root_cause(tmp_path):
    # Two ranks' records, written by hand: ipo done on both; kto failed on rank 1, and rank 0 only lost its peer; simpo
    # refused on both; dpo started, and done on rank 0 alone (rank 1 died in it): not ended.
    rank0 = ["ipo started", "ipo done /runs/ipo", "kto started", "kto failed peer", "simpo started", "simpo refused"]
    rank1 = ["ipo started", "ipo done /runs/ipo-1", "kto started", "kto failed cause", "simpo started", "simpo refused"]
    texts = {"peer": "RuntimeError: Connection reset by peer", "cause": "NonFiniteLossError: loss is nan"}
    for rank, records in enumerate((rank0 + ["dpo started", "dpo done /runs/dpo"], rank1 + ["dpo started"])):
        lines = []
        for record in records:
            name, status, *text = record.split(" ")
            said = texts.get(text[0], text[0]) if text else "loss.beta must be > 0" if status == "refused" else ""
            lines.append(outcome_line(name, status, said, lost_peer=text == ["peer"]))
        (tmp_path / f"outcomes-{rank}.jsonl").write_text("\n".join(lines) + "\n")
    Outcome = equivalence_worker.Outcome
    assert equivalence_worker.read_outcomes(tmp_path, 2) == {
        "ipo": Outcome("done", "/runs/ipo"),
        "kto": Outcome("failed", "NonFiniteLossError: loss is nan (rank 1)"),
        "simpo": Outcome("refused", "loss.beta must be > 0"),
    }


def entry(loss_diff=None, weight_diff=None, note="", refusal="", by=None) -> dict:
    """An entry of the matrix's JSON document, written out."""
    return {"loss_diff": loss_diff, "weight_diff": weight_diff, "note": note, "over": False, "refusal": refusal, "by": by}


LEFT_OUT = "not run: left out by --cells"


def test_merge_overwrites_only_the_cells_the_command_ran_and_keeps_the_commands_that_wrote_the_rest(tmp_path, monkeypatch):
    # By hand: command A wrote packed for dpo and ipo, B wrote fsdp for both; C runs fsdp again, for dpo (ipo refused).
    a = {"command": "python -m evaluation.equivalence --cells packed", "date": "d1", "commit": "c1", "seconds": 60.0}
    b = {"command": "python -m evaluation.equivalence --cells fsdp --merge", "date": "d2", "commit": "c2", "seconds": 30.0}
    previous = {
        "commands": [a, b],
        "results": {
            "dpo": {"packed": entry(1e-7, 2e-5, by=0), "fsdp": entry(3e-7, 4e-5, by=1)},
            "ipo": {"packed": entry(5e-8, 6e-6, by=0), "fsdp": entry(7e-8, 8e-6, by=1)},
        },
    }
    (tmp_path / "eq.json").write_text(json.dumps(previous))
    ran = {
        ("dpo", "packed"): equivalence.Result(note=LEFT_OUT),
        ("dpo", "fsdp"): equivalence.Result(2e-8, 3e-6),
        ("ipo", "packed"): equivalence.Result(note=LEFT_OUT),
        ("ipo", "fsdp"): equivalence.Result(note="not run: refused", refusal="no."),
    }
    monkeypatch.setattr(equivalence, "run_matrix", lambda *args, **kwargs: ran)
    assert equivalence.main(["--cells", "fsdp", "--merge", "--out", str(tmp_path / "eq.md")]) == 0
    document = json.loads((tmp_path / "eq.json").read_text())
    c = document["commands"][-1]  # this command
    assert c["command"] == f"python -m evaluation.equivalence --cells fsdp --merge --out {tmp_path / 'eq.md'}"
    assert document == {  # B wrote nothing that is left: it is gone; C is the second command
        "commands": [a, c],
        "results": {
            "dpo": {"packed": entry(1e-7, 2e-5, by=0), "fsdp": entry(2e-8, 3e-6, by=1)},
            "ipo": {"packed": entry(5e-8, 6e-6, by=0), "fsdp": entry(note="not run: refused", refusal="no.", by=1)},
        },
    }
    text = (tmp_path / "eq.md").read_text()
    assert f"- `{a['command']}` on d1 at commit c1 in 60 s: packed: dpo, ipo." in text
    assert f"- `{c['command']}` on {c['date']} at commit {c['commit']} in " in text and ": fsdp: dpo, ipo." in text
    assert f"`{b['command']}`" not in text
    assert re.search(r"^\| dpo \| not run: [^|]* \| 1\.0e-07 / 2\.0e-05 \|.*\| 2\.0e-08 / 3\.0e-06 \|", text, re.MULTILINE)
    assert "- ipo, fsdp: refused: no." in text


def test_merge_without_its_json_is_refused_in_one_sentence(tmp_path, capsys):
    with pytest.raises(SystemExit):
        equivalence.main(["--merge", "--out", str(tmp_path / "eq.md")])
    assert (
        f"--merge starts from {tmp_path / 'eq.json'}, which does not exist; run once without --merge." in capsys.readouterr().err
    )


def test_docs_equivalence_names_every_cell_and_objective_the_command_runs():
    text = (REPO / "docs" / "equivalence.md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| objective |"))
    assert [c.strip() for c in header.strip("|").split("|")[1:]] == list(equivalence.CELLS)
    rows = {m.group(1) for m in re.finditer(r"^\| (\w+) \|", text, re.MULTILINE)}
    assert set(equivalence.trained_objectives()) <= rows
    for name in equivalence.NOT_TRAINED:
        assert f"- {name}: not run: " in text
