"""Faults and bad input in the data (issue 13): bad data files, truncation that leaves nothing to
learn, and what the run tells about its data.

Each bad file is tried through ``train.main`` with ``datasets=[json] data.json.path=...`` (the
sentence, exactly, and no run folder under ``output_root``), and once through the command line.
Expected counts are worked out by hand (ByT5: id = byte + 3, EOS = 1, no BOS) or from the
documented rule (the held-out slice: the first 8 bytes of sha256(prompt) / 2**64 < fraction).
"""

from __future__ import annotations

import collections
import gzip
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TINY, compose_config, needs_shared, run_train
from transformers import AutoTokenizer, ByT5Tokenizer

import preference_datasets as pd
import train
from data import prompts as prompt_sets
from data import screening
from data.loading import load_dataset_dict, load_examples, split_overlap_warning
from data.readers import read_json_records
from losses import IGNORE_INDEX
from utils import DataError

H, A = "\n\nHuman:", "\n\nAssistant:"
ROW = {"prompt": "p0", "chosen": " a", "rejected": " b"}


def rows(n: int) -> list[dict]:
    return [{"prompt": f"p{i}", "chosen": " a", "rejected": " b"} for i in range(n)]


def jsonl(rows_: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows_)


def held_out(prompt: str, fraction: float) -> bool:
    """The documented rule, computed here: sha256's first 8 bytes as a fraction of 2**64."""
    return int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big") / 2**64 < fraction


def main_error(tmp_path: Path, overrides: list[str]) -> str:
    """The DataError sentence train.main raises for ``overrides``; asserts no run folder was made."""
    out = tmp_path / "runs"
    config = compose_config([*TINY, f"output_root={out}", *overrides])
    with pytest.raises(DataError) as e:
        train.main(config)
    assert not out.exists() or not any(out.iterdir()), f"a run folder was left behind: {list(out.iterdir())}"
    return str(e.value)


def json_error(tmp_path: Path, path, *overrides: str) -> str:
    return main_error(tmp_path, ["datasets=[json]", f"data.json.path={path}", *overrides])


# ----------------------------------------------------------------------------- 1. bad files


def write_truncated_gz(tmp_path: Path) -> Path:
    f = tmp_path / "d.jsonl.gz"
    whole = gzip.compress(jsonl(rows(20)).encode())
    f.write_bytes(whole[: len(whole) // 2])
    return f


def test_truncated_gz_is_one_sentence(tmp_path):
    # Regression: EOFError traceback.
    f = write_truncated_gz(tmp_path)
    assert json_error(tmp_path, f) == (
        f"{f} is cut short (its gzip stream ends early, as after an interrupted copy); copy the whole file again."
    )


def test_a_folder_is_one_sentence(tmp_path):
    # Regression: IsADirectoryError traceback.
    (tmp_path / "data").mkdir()
    folder = tmp_path / "data"
    assert (
        json_error(tmp_path, folder)
        == f"{folder} is a folder, not a data file; give the path of a .jsonl, .json or .parquet file."
    )


@pytest.mark.parametrize("text", ['[{"prompt": "p", "chosen": " a", "rejected": " b"}', '[{"prompt": "p", "chosen": " a", "rej'])
def test_truncated_json_list_is_one_sentence(tmp_path, text):
    # Regression: JSONDecodeError traceback (the list's end, or a string, cut off).
    f = tmp_path / "d.json"
    f.write_text(text)
    assert json_error(tmp_path, f) == f"{f} is cut short (its JSON ends early, on line 1); copy the whole file again."


@pytest.mark.parametrize("indent", [None, 2])
def test_json_file_of_one_object_is_one_sentence(tmp_path, indent):
    # Regression: pretty-printed, "line 1: not valid JSON" for a valid file; on one line, read as one row.
    f = tmp_path / "d.json"
    f.write_text(json.dumps(ROW, indent=indent))
    assert json_error(tmp_path, f) == (
        f"{f} holds one JSON object, not a list of rows; write its rows as a JSON list [{{...}}, ...] or one object a line (.jsonl)."
    )


def test_pretty_printed_object_in_a_jsonl_file_is_one_sentence(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps(ROW, indent=2))
    assert json_error(tmp_path, f).startswith(f"{f} holds one JSON object, not a list of rows;")


def test_empty_file_says_the_file_has_no_rows(tmp_path):
    # Regression: "The eval split is empty" (the train split read nothing and said nothing).
    f = tmp_path / "d.jsonl"
    f.write_text("\n")
    assert json_error(tmp_path, f) == f"{f} has no rows; give a file with one JSON object a line, or a JSON list of them."
    g = tmp_path / "e.json"
    g.write_text("[]")
    assert json_error(tmp_path, g) == f"{g} has no rows; give a file with one JSON object a line, or a JSON list of them."


def test_every_row_skipped_says_why(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(jsonl([{"prompt": "p", "chosen": " a", "rejected": " a"}, {"prompt": "q", "chosen": " ", "rejected": " b"}]))
    assert json_error(tmp_path, f"{{train: {f}, test: {f}}}") == (
        f"Every row of json/train ({f}) was skipped (1 skipped: empty response, 1 skipped: identical responses), "
        "so it has no pairs; fix those rows or give data.json other data."
    )


def test_train_split_left_empty_by_the_holdout_is_one_sentence(tmp_path):
    # Regression: a traceback after the run folder and its config.yaml were written.
    f = tmp_path / "d.jsonl"
    f.write_text(jsonl(rows(3)))
    assert json_error(tmp_path, f, "data.json.holdout_fraction=1.0") == (
        f"json/train ({f}) has no pairs: data.json.holdout_fraction=1.0 puts all 3 of its prompts in the eval slice; "
        "lower it (e.g. 0.1) so that some prompts are left to train on, or give more rows."
    )
    # The smallest natural case: two prompts that both hash into a 0.5 slice.
    both = [p for p in (f"q{i}" for i in range(100)) if held_out(p, 0.5)][:2]
    f.write_text(jsonl([{"prompt": p, "chosen": " a", "rejected": " b"} for p in both]))
    assert json_error(tmp_path, f, "data.json.holdout_fraction=0.5").startswith(
        f"json/train ({f}) has no pairs: data.json.holdout_fraction=0.5 puts all 2 of its prompts in the eval slice;"
    )


def test_eval_split_left_empty_by_the_holdout_names_the_option(tmp_path):
    f = tmp_path / "d.jsonl"
    none = [p for p in (f"q{i}" for i in range(100)) if not held_out(p, 0.1)][:3]
    f.write_text(jsonl([{"prompt": p, "chosen": " a", "rejected": " b"} for p in none]))
    assert json_error(tmp_path, f) == (
        f"json/test ({f}) has no pairs: data.json.holdout_fraction=0.1 puts none of its 3 prompts in the eval slice; "
        # regression: it suggested "e.g. 0.1", the value already set; 3 held-out prompts of 3 would need 1.0, capped at 0.5
        "raise it (e.g. 0.5) so that some prompts are held out, or give more rows."
    )


@pytest.mark.parametrize(
    "name, content, message",
    [
        (
            "d.jsonl.gz",
            b'{"prompt": "p"}\n',
            "{f} is not a gzip file although its name ends with .gz; rename it without .gz if it is plain text.",
        ),
        (
            "d.jsonl",
            b'{"prompt": "caf\xe9", "chosen": " a", "rejected": " b"}\n',
            "{f} is not UTF-8 text (byte 15 of the text cannot be decoded); save it as UTF-8.",
        ),
        (
            "d.jsonl",
            (jsonl(rows(3)) + '{"prompt": "p3", "cho').encode(),
            "{f}, line 4 (the last) is cut short; copy the whole file again, or delete that line.",
        ),
        (
            "d.json",
            b'[{"prompt": "p"}, {"prompt" 1}]',
            "{f} is not valid JSON at line 1, column 29 (Expecting ':' delimiter); fix the file there.",
        ),
    ],
)
def test_other_bad_files_are_one_sentence(tmp_path, name, content, message):
    f = tmp_path / name
    f.write_bytes(content)
    assert json_error(tmp_path, f) == message.format(f=f)


def test_utf8_bom_is_read(tmp_path, capsys):
    # Regression: the first row was refused ("Unexpected UTF-8 BOM ... fix or delete that line").
    f = tmp_path / "d.jsonl"
    f.write_text(jsonl(rows(16)), encoding="utf-8-sig")
    assert f.read_bytes()[:3] == b"\xef\xbb\xbf"
    assert read_json_records(str(f)) == rows(16)
    g = tmp_path / "d.json.gz"
    g.write_bytes(gzip.compress(("\ufeff" + json.dumps(rows(2))).encode()))
    assert read_json_records(str(g)) == rows(2)
    args = [
        "datasets=[json]",
        f"data.json.path={{train: {f}, test: {f}}}",
        "n_examples=8",
        "eval_every=8",
        "max_length=64",
        "max_prompt_length=32",
    ]
    run_dir = run_train(args, tmp_path)
    assert (run_dir / "LATEST").exists()
    out = capsys.readouterr().out
    # What the run tells, once per split: 16 pairs of 2-byte prompts and 3-token responses, nothing cut.
    for split in ("train", "eval"):
        line = f"[data] {split}: truncation to max_length=64 / max_prompt_length=32 cuts 0.0% (0 of 16) of prompts and 0.0% (0 of 32) of responses\n"
        assert out.count(line) == 1


def test_command_line_prints_one_error_line_and_exits_2(tmp_path):
    f = write_truncated_gz(tmp_path)
    out = tmp_path / "runs"
    proc = subprocess.run(
        [sys.executable, "train.py", "datasets=[json]", f"data.json.path={f}", f"output_root={out}", "sft_first.n_examples=null"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (
        proc.stderr
        == f"Error: {f} is cut short (its gzip stream ends early, as after an interrupted copy); copy the whole file again.\n"
    )
    assert "Traceback" not in proc.stdout
    assert not out.exists()


def test_every_local_reader_gives_the_sentences(tmp_path):
    """hh, shp, se and tldr (JSON and parquet) read local files the same way."""
    import pyarrow
    import pyarrow.parquet

    (tmp_path / "harmless-base").mkdir()
    hh = tmp_path / "harmless-base" / "test.jsonl.gz"
    whole = gzip.compress(jsonl([{"chosen": f"{H} q{i}{A} a", "rejected": f"{H} q{i}{A} b"} for i in range(30)]).encode())
    hh.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DataError, match=f"^{hh} is cut short \\(its gzip stream ends early"):
        load_examples(["hh"], "test", {"hh": {"local_dir": str(tmp_path)}}, False, silent=True)
    hh.write_bytes(gzip.compress(jsonl([{"chosen": f"{H} q{A} a", "rejected": f"{H} r{A} a"}]).encode()))
    with pytest.raises(DataError) as e:
        load_examples(["hh"], "test", {"hh": {"local_dir": str(tmp_path)}}, False, silent=True)
    assert str(e.value) == (
        f"Every row of hh/test ({hh}) was skipped (1 skipped: no common Assistant turn), so it has no pairs; "
        "fix those rows or give data.hh other data."
    )
    folder = tmp_path / "harmless-base"
    for name in ("shp", "se"):
        with pytest.raises(DataError, match=f"^{folder} is a folder, not a data file"):
            load_examples([name], "train", {name: {"path": str(folder)}}, False, silent=True)
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match=f"^{empty} has no rows"):
        load_examples(["se"], "train", {"se": {"path": str(empty)}}, False, silent=True)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(jsonl([{"post": "x"}]))
    with pytest.raises(
        DataError, match=f"^{bad}, row 1: field 'history' is missing or not a string; every shp row needs history"
    ):
        load_examples(["shp"], "train", {"shp": {"path": str(bad)}}, False, silent=True)
    bad.write_text(jsonl([{"question": "q", "answers": [{"text": "t"}]}]))
    with pytest.raises(DataError, match=f"^{bad}, row 1: answer 1 needs a string 'text' and a numeric 'pm_score'"):
        load_examples(["se"], "train", {"se": {"path": str(bad)}}, False, silent=True)
    parquet = tmp_path / "train.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist([{"prompt": f"post {i} TL;DR:"} for i in range(50)]), parquet)
    parquet.write_bytes(parquet.read_bytes()[:-20])
    with pytest.raises(DataError) as e:
        prompt_sets.load_prompts(["tldr"], "train", {"tldr": {"path": {"train": str(parquet)}}}, silent=True)
    assert str(e.value).startswith(f"{parquet} is not a readable parquet file (") and "Traceback" not in str(e.value)
    assert str(e.value).endswith("); copy it again if it was cut short.")
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist([], schema=pyarrow.schema([("prompt", pyarrow.string())])), parquet)
    with pytest.raises(DataError, match=f"^{parquet} has no rows"):
        prompt_sets.load_prompts(["tldr"], "train", {"tldr": {"path": {"train": str(parquet)}}}, silent=True)
    tldr = tmp_path / "t.jsonl"
    tldr.write_text(jsonl([{"prompt": " "}, {"prompt": "  "}]))
    with pytest.raises(DataError) as e:
        prompt_sets.load_prompts(["tldr"], "train", {"tldr": {"path": {"train": str(tldr)}}}, silent=True)
    assert str(e.value) == (
        f"Every row of tldr/train ({tldr}) was skipped (2 skipped: empty prompt), so it has no prompts; "
        "fix those rows or give data.tldr other data."
    )


# ----------------------------------------------------------------------------- 2. truncation that leaves nothing to learn


def test_pairs_identical_once_cut_stop_before_the_run_folder(tmp_path):
    # Regression: at a small max_length every pair became prompt + EOS against prompt + EOS and the
    # loss stayed at ln 2 for the whole run. ByT5: a 10-byte prompt + " a" + EOS (3) > 9, so the
    # prompt keeps its last 8 bytes and the room left (1) holds only EOS, for chosen and rejected.
    f = tmp_path / "d.jsonl"
    f.write_text(
        jsonl(
            [
                {"prompt": "0123456789", "chosen": " a", "rejected": " b"},
                {"prompt": "9876543210", "chosen": " c", "rejected": " d"},
            ]
        )
    )
    message = json_error(tmp_path, f"{{train: {f}, test: {f}}}", "max_length=9", "max_prompt_length=8")
    assert message == (
        "All 2 train pairs have the same chosen and rejected tokens once cut to max_length=9 / max_prompt_length=8 "
        "(they differ only past the cut), so there is nothing to learn; raise max_length or lower max_prompt_length."
    )


def test_screen_skips_only_pairs_left_identical_and_reports_the_cuts(capsys):
    tok = ByT5Tokenizer()
    examples = [
        # 10 + 3 > 9: prompt cut to 8 (keep_end), room 1: both responses become [EOS] -> skipped
        {"prompt": "0123456789", "chosen": " a", "rejected": " b", "truncation_mode": "keep_end"},
        # 1 + 5 <= 9: nothing cut
        {"prompt": "Q", "chosen": " yes", "rejected": " no", "truncation_mode": "keep_end"},
        # 3 + 10 > 9: the 3-byte prompt fits max_prompt_length, room 6: chosen cut, rejected (3) not
        {"prompt": "abc", "chosen": " abcdefgh", "rejected": " x", "truncation_mode": "keep_start"},
        # the same tokens before any cut: " a</s>" loses its EOS string, then both are [35, 100, 1]
        {"prompt": "Q", "chosen": " a</s>", "rejected": " a", "truncation_mode": "keep_end"},
    ]
    kept = screening.screen_examples(examples, "train", tok, 9, 8)
    assert kept == examples[1:3]
    out = capsys.readouterr().out.splitlines()
    assert out == [
        # prompts cut: example 0; responses cut: example 0's two, example 2's chosen
        "[data] train: truncation to max_length=9 / max_prompt_length=8 cuts 25.0% (1 of 4) of prompts and 37.5% (3 of 8) of responses",
        "[data] warning: train: skipped 1 of 4 pairs whose chosen and rejected are the same tokens once cut to "
        "max_length=9 / max_prompt_length=8 (they differ only past the cut); raise max_length or lower max_prompt_length to keep them.",
        "[data] warning: train: skipped 1 of 4 pairs whose chosen and rejected tokenize the same.",
    ]
    # SFT examples (no rejected) are never skipped, only reported
    sft = [{k: v for k, v in e.items() if k != "rejected"} for e in examples]
    assert screening.screen_examples(sft, "test", tok, 9, 8) == sft
    assert capsys.readouterr().out == (
        # prompts cut: example 0 (10 + 3 > 9); responses cut: 0 (room 1), 2 (room 6 < 10)
        "[data] eval: truncation to max_length=9 / max_prompt_length=8 cuts 25.0% (1 of 4) of prompts and 50.0% (2 of 4) of responses\n"
    )
    # prompts alone (online DPO): cut to max_prompt_length, nothing skipped
    prompts = [{"prompt": p, "truncation_mode": "keep_end"} for p in ("0123456789", "Q", "abcdefgh")]
    assert screening.screen_examples(prompts, "train", tok, 9, 8) == prompts
    assert capsys.readouterr().out == "[data] train: truncation to max_prompt_length=8 cuts 33.3% (1 of 3) of prompts\n"


HH_FILE = ("data", "hh-rlhf", "harmless-base", "test.jsonl.gz")


@pytest.fixture(scope="module")
def hh_examples():
    path = needs_shared(*HH_FILE).parents[1]
    return load_examples(["hh"], "test", {"hh": {"local_dir": str(path)}}, False, silent=True)


@pytest.mark.parametrize("tokenizer", ["gpt-neox-20b", "stories260K", "byt5"])
def test_screening_decides_exactly_as_tokenize_element(hh_examples, tokenizer):
    if tokenizer == "byt5":
        tok = ByT5Tokenizer()
    else:
        path = needs_shared("tokenizers", tokenizer) if tokenizer != "stories260K" else needs_shared("models", tokenizer)
        tok = AutoTokenizer.from_pretrained(str(path))
    pairs = hh_examples[:150]
    # the EOS string at the end, a special token's text inside, an empty prompt
    extra = {"prompt": "", "chosen": f" ok{tok.eos_token}", "rejected": f" {tok.eos_token} x", "truncation_mode": "keep_start"}
    pairs = [*pairs, extra, {**pairs[0], "truncation_mode": "keep_start"}]
    sft = [{k: v for k, v in e.items() if k != "rejected"} for e in pairs]
    prompts = [{"prompt": e["prompt"], "truncation_mode": e["truncation_mode"]} for e in pairs]
    for max_length, max_prompt_length in ((512, 256), (64, 48), (12, 4), (2, 1)):
        for examples in (pairs, sft):
            got = list(screening.truncated_ids(examples, tok, max_length, max_prompt_length, chunk_size=64))
            assert len(got) == len(examples)
            for ex, t in zip(examples, got):
                el = pd.tokenize_element(
                    ex["prompt"], ex["chosen"], ex.get("rejected"), ex["truncation_mode"], tok, max_length, max_prompt_length
                )
                n = len(el["prompt_input_ids"])
                assert t.prompt_ids == el["prompt_input_ids"]
                sides = ["chosen", "rejected"] if "rejected" in ex else ["chosen"]
                assert t.response_ids == [el[f"{s}_labels"][n:] for s in sides]
                assert all(label == IGNORE_INDEX for s in sides for label in el[f"{s}_labels"][:n])
                whole = pd.tokenize_element(
                    ex["prompt"], ex["chosen"], ex.get("rejected"), ex["truncation_mode"], tok, 10**6, 10**6 - 1
                )
                assert t.prompt_cut == (n < len(whole["prompt_input_ids"]))
                assert t.responses_cut == [
                    len(el[f"{s}_labels"]) - n < len(whole[f"{s}_labels"]) - len(whole["prompt_input_ids"]) for s in sides
                ]
        for ex, t in zip(prompts, screening.truncated_ids(prompts, tok, max_length, max_prompt_length, chunk_size=64)):
            assert (
                t.prompt_ids
                == pd.tokenize_prompt(ex["prompt"], tok, max_prompt_length, ex["truncation_mode"])["prompt_input_ids"]
            )


# ----------------------------------------------------------------------------- 3. what the run tells


def test_skip_counts_are_those_of_the_split(tmp_path, capsys):
    # Regression: the whole file's counts were printed on both split lines.
    prompts = [f"q{i}" for i in range(40)]
    data = [{"prompt": p, "chosen": " a", "rejected": " a" if i % 3 == 0 else " b"} for i, p in enumerate(prompts)]
    f = tmp_path / "d.jsonl"
    f.write_text(jsonl(data))
    same = {"train": 0, "test": 0}
    pairs = {"train": 0, "test": 0}
    for i, p in enumerate(prompts):
        split = "test" if held_out(p, 0.25) else "train"
        if i % 3 == 0:
            same[split] += 1
        else:
            pairs[split] += 1
    assert min(same.values()) > 0 and min(pairs.values()) > 0  # the file has some of each in each split
    for split in ("train", "test"):
        load_dataset_dict("json", split, {"path": str(f), "holdout_fraction": 0.25})
        assert capsys.readouterr().out == (
            f"[data] json/{split}: {pairs[split]} prompts, {pairs[split]} pairs ({same[split]} skipped: identical responses)\n"
        )


def test_hh_repair_at_an_earlier_divergence_is_counted():
    # Regression: a dialogue split before the chosen text's last Assistant tag was counted only when
    # a "\n\nHuman:" followed; the real file's repaired rows have "  Human:" (no newlines) or none.
    rows_ = [
        {"chosen": f"{H} q{A} a{A} b", "rejected": f"{H} q{A} c"},  # split at the first tag: repaired
        {"chosen": f"{H} r{A} a  Human: b{A} c", "rejected": f"{H} r{A} d"},  # as in the real file: repaired
        {"chosen": f"{H} s{A} a", "rejected": f"{H} s{A} a{H} more{A} b"},  # chosen's last tag: not repaired
        {"chosen": f"{H} t{A} {A} b", "rejected": f"{H} t{A} {A} b"},  # identical: skipped, not repaired
    ]
    report = collections.Counter()
    data = pd.hh_rows_to_data(rows_, report)
    assert report == {"repaired: dialogues diverge before the last Assistant turn": 2, "skipped: identical responses": 1}
    assert data[f"{H} q{A}"]["responses"] == [f" a{A} b", " c"]


def test_hh_repair_and_skip_counts_per_split_on_the_real_file(capsys):
    path = needs_shared(*HH_FILE)
    lines = [json.loads(line) for line in gzip.open(path, "rt")]
    expected = {"train": collections.Counter(), "test": collections.Counter()}
    for r in lines:
        common = os.path.commonprefix([r["chosen"], r["rejected"]])
        cut = common.rfind(A) + len(A)
        prompt, chosen, rejected = r["chosen"][:cut], r["chosen"][cut:], r["rejected"][cut:]
        split = "test" if held_out(prompt, 0.1) else "train"
        if not chosen.strip() or not rejected.strip():
            expected[split]["skipped: empty response"] += 1
        elif cut != r["chosen"].rfind(A) + len(A):  # not where the reference repository split
            expected[split]["repaired: dialogues diverge before the last Assistant turn"] += 1
    assert sum(c["repaired: dialogues diverge before the last Assistant turn"] for c in expected.values()) == 4
    for split in ("train", "test"):
        data = load_dataset_dict("hh", split, {"local_dir": str(path.parents[1]), "holdout_fraction": 0.1})
        notes = ", ".join(f"{v} {k}" for k, v in sorted(expected[split].items()))
        n_pairs = sum(len(v["pairs"]) for v in data.values())
        assert (
            capsys.readouterr().out
            == f"[data] hh/{split}: {len(data)} prompts, {n_pairs} pairs" + (f" ({notes})" if notes else "") + "\n"
        )


def test_an_eval_set_of_one_example_is_named_in_the_singular():
    # Regression (fresh-user trial): "larger than the eval set (1 examples)".
    from data import splits

    note = splits.check_eval_size(compose_config(["eval_batch_size=8"]), 1)
    assert note == "eval_batch_size (8) is larger than the eval set (1 example), so the eval runs as one batch of 1."


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize(
    "name, row, what",
    [
        ("hf", '{{"prompt": "p", "responses": ["A", "B"], "scores": [1, {v}]}}', "response 2's score"),
        (
            "hf",
            '{{"prompt": "p", "responses": [{{"text": "A", "score": {v}}}, {{"text": "B", "score": 1}}]}}',
            "response 1's score",
        ),
        (
            "shp",
            '{{"history": "h", "human_ref_A": "a", "human_ref_B": "b", "score_A": {v}, "score_B": 3, "labels": 1}}',
            "field 'score_A'",
        ),
        (
            "se",
            '{{"question": "q", "answers": [{{"text": "a", "pm_score": 2}}, {{"text": "b", "pm_score": {v}}}]}}',
            "answer 2's 'pm_score'",
        ),
    ],
)
def test_a_score_that_is_nan_or_infinite_is_one_sentence_naming_the_row(tmp_path, name, row, what, value):
    # JSON readers take NaN and Infinity; a NaN compares false with every score, so it ranked as the worst and trained.
    f = tmp_path / "rows.jsonl"
    f.write_text(row.format(v=2) + "\n" + row.format(v=value) + "\n")  # a good row first: the second is named
    shown = {"NaN": "nan", "Infinity": "inf", "-Infinity": "-inf"}[value]
    options = {name: {"path": str(f)}} if name != "hf" else {"hf": {"path": str(f), "format": "ranked"}}
    with pytest.raises(DataError) as e:
        load_examples([name], "train", options, False, silent=True)
    assert str(e.value) == (
        f"{f}, row 2: {what} is {shown}, not a finite number, so it cannot rank the responses; fix that row or drop it."
    )


def test_one_file_given_as_both_splits_is_said_in_one_warning(tmp_path):
    # 10 pairs; the test file holds 2 of them and 1 other: 2 of 3 eval examples were trained on.
    rows = [{"prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(10)]
    other = {"prompt": "held out", "chosen": "a", "rejected": "b"}
    train_file, test_file = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train_file.write_text(jsonl(rows))
    test_file.write_text(jsonl([rows[3], other, rows[7]]))
    options = {"json": {"path": {"train": str(train_file), "test": str(test_file)}}}
    train_examples, test_examples = (load_examples(["json"], s, options, False, silent=True) for s in ("train", "test"))
    assert split_overlap_warning(train_examples, test_examples) == (
        "[data] warning: 66.7% (2 of 3) of the eval examples are also train examples (the same prompt and responses; one "
        "file given as both splits?), so the eval metrics measure trained examples, not held-out ones; give a test split "
        "of other examples unless that is meant."
    )
    assert split_overlap_warning(train_examples, test_examples[1:2]) is None  # held out: no word
    swapped = [{**ex, "chosen": ex["rejected"], "rejected": ex["chosen"]} for ex in test_examples]
    assert split_overlap_warning(train_examples, swapped) is None  # the same prompts, other pairs: not the same example


def test_the_same_file_as_train_and_test_warns_through_the_run(tmp_path, capsys):
    rows = [{"prompt": f"{i} + {i} =", "chosen": f" {2 * i}", "rejected": f" {2 * i + 1}"} for i in range(16)]
    f = tmp_path / "pairs.jsonl"
    f.write_text(jsonl(rows))
    config = compose_config(
        [*TINY, "datasets=[json]", f"data.json.path={{train: {f}, test: {f}}}", "n_examples=8", f"output_root={tmp_path / 'out'}"]
    )
    train.main(config)
    assert "[data] warning: 100.0% (16 of 16) of the eval examples are also train examples" in capsys.readouterr().out


@pytest.mark.parametrize(
    "suffix, text",
    [(".jsonl", b'{"prompt": "caf\xe9", "chosen": "a", "rejected": "b"}\n'), (".csv", b"prompt,chosen,rejected\ncaf\xe9,a,b\n")],
)
def test_a_latin_1_file_through_hf_is_one_sentence(tmp_path, suffix, text):
    # Before: a UnicodeDecodeError traceback (JSON, decoded as Arrow hands the rows over) or "could not be read" (CSV).
    f = tmp_path / f"latin1{suffix}"
    f.write_bytes(text)
    options = {"hf": {"path": {"train": str(f), "test": str(f)}, "cache_dir": str(tmp_path / "c")}}
    with pytest.raises(DataError) as e:
        load_examples(["hf"], "train", options, False, silent=True)
    assert str(e.value) == f"{f} is not UTF-8 text (byte 3 of a value cannot be decoded); save it as UTF-8."
