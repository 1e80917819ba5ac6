"""Tests for preference_datasets.py: loaders, tokenization, collation and batching.

Expected values are worked out by hand from the documented behaviour. ByT5 (no files,
id = byte + 3, eos "</s>" = 1, pad 0, no BOS) gives exact token ids; the shared
stories260K (SentencePiece, <s> = 1, </s> = 2) and gpt-neox tokenizers are checked
structurally. Tests that need ../shared skip when it is absent.
"""

from __future__ import annotations

import collections
import json
import random
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, ByT5Tokenizer

import preference_datasets as pd
from data import prompts as prompt_sets
from data.arithmetic import get_arithmetic
from data.formats import get_json
from data.loading import load_dataset_dict, load_examples
from data.prompts import collate_prompts
from losses import IGNORE_INDEX
from preference_datasets import (
    ASSISTANT_TAG,
    REGISTRY,
    collate,
    get_batch_iterator,
    get_hh,
    get_se,
    get_shp,
    hh_rows_to_data,
    register_dataset,
    se_rows_to_data,
    shp_rows_to_data,
    split_prompt_and_responses,
    tokenize_element,
)
from utils import DataError

SHARED = Path(__file__).resolve().parents[2] / "shared"
HH_DIR = SHARED / "data" / "hh-rlhf"
STORIES = SHARED / "models" / "stories260K"
NEOX = SHARED / "tokenizers" / "gpt-neox-20b"


def shared_path(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} is absent (the shared/ folder beside the repository is needed)")
    return path


def counter() -> collections.Counter:
    return collections.Counter()


def text_pairs(entry: dict) -> list[tuple[str, str]]:
    r = entry["responses"]
    return [(r[i], r[j]) for i, j in entry["pairs"]]


# ----------------------------------------------------------------------------- HH splitting

H = "\n\nHuman:"
A = "\n\nAssistant:"


def test_split_normal_case():
    chosen = f"{H} Hi{A} Hello there."
    rejected = f"{H} Hi{A} Go away."
    assert split_prompt_and_responses(chosen, rejected) == (f"{H} Hi{A}", " Hello there.", " Go away.")


def test_split_regression_divergence_right_after_the_tag():
    # Regression: the tag search ended len(tag) - 1 characters before the divergence
    # point, so a tag ending exactly there (every normal HH row) was not found.
    assert split_prompt_and_responses(f"{A}a", f"{A}b") == (A, "a", "b")


def test_split_diverging_inside_assistant_text():
    chosen = f"{H} Pets?{A} I like cats"
    rejected = f"{H} Pets?{A} I like dogs"
    assert split_prompt_and_responses(chosen, rejected) == (f"{H} Pets?{A}", " I like cats", " I like dogs")


def test_split_diverging_before_last_assistant_turn():
    chosen = f"{H} hi{A} a{H} b{A} yes"
    rejected = f"{H} hi{A} a{H} c{A} no"
    # The reference split at the last tag of `chosen`, giving rejected a wrong response.
    assert split_prompt_and_responses(chosen, rejected) == (f"{H} hi{A}", f" a{H} b{A} yes", f" a{H} c{A} no")


def test_split_no_common_tag():
    assert split_prompt_and_responses(f"{H} hi{A} a", f"{H} yo{A} a") is None
    # common prefix ends inside the tag
    assert split_prompt_and_responses(f"{H} hi{A} a", f"{H} hi\n\nAssist: a") is None


def test_hh_rows_normal_and_repaired_counts():
    rows = [
        {"chosen": f"{H} hi{A} yes", "rejected": f"{H} hi{A} no"},
        {"chosen": f"{H} q{A} a{H} b{A} yes", "rejected": f"{H} q{A} a{H} c{A} no"},
    ]
    report = counter()
    data = hh_rows_to_data(rows, report)
    assert data == {
        f"{H} hi{A}": {"responses": [" yes", " no"], "pairs": [(0, 1)], "sft_target": " yes"},
        f"{H} q{A}": {
            "responses": [f" a{H} b{A} yes", f" a{H} c{A} no"],
            "pairs": [(0, 1)],
            "sft_target": f" a{H} b{A} yes",
        },
    }
    assert report == {"repaired: dialogues diverge before the last Assistant turn": 1}


def test_hh_rows_skips_are_counted():
    rows = [
        {"chosen": f"{H} hi{A} a", "rejected": f"{H} yo{A} a"},  # no common tag
        {"chosen": f"{H} hi{A} a", "rejected": f"{H} hi{A}"},  # empty rejected
        {"chosen": f"{H} hi{A}  ", "rejected": f"{H} hi{A} b"},  # whitespace-only chosen
        {"chosen": f"{H} hi{A} a", "rejected": f"{H} hi{A} a"},  # identical
    ]
    report = counter()
    assert hh_rows_to_data(rows, report) == {}
    assert report == {
        "skipped: no common Assistant turn": 1,
        "skipped: empty response": 2,
        "skipped: identical responses": 1,
    }


def test_hh_rows_same_prompt_shares_responses():
    p = f"{H} hi{A}"
    rows = [{"chosen": p + " a", "rejected": p + " b"}, {"chosen": p + " c", "rejected": p + " b"}]
    data = hh_rows_to_data(rows, counter())
    assert data == {p: {"responses": [" a", " b", " c"], "pairs": [(0, 1), (2, 1)], "sft_target": " a"}}


def test_hh_rows_bad_row_raises():
    with pytest.raises(DataError, match="row 1"):
        hh_rows_to_data([{"chosen": f"{H} a{A} b", "rejected": f"{H} a{A} c"}, {"chosen": "x"}], counter())


# ----------------------------------------------------------------------------- HH local loading


@pytest.fixture(scope="module")
def hh_slices():
    local = str(shared_path(HH_DIR / "harmless-base" / "test.jsonl.gz").parents[1])
    opts = {"local_dir": local, "subsets": ["harmless-base"]}
    full = get_hh("test", counter(), **opts)
    train = get_hh("train", counter(), holdout_fraction=0.1, **opts)
    test = get_hh("test", counter(), holdout_fraction=0.1, **opts)
    return opts, full, train, test


def test_hh_local_full_file_parses(hh_slices):
    _, full, _, _ = hh_slices
    # 2312 rows; almost every one is a distinct prompt with a usable pair.
    assert len(full) > 2200
    assert all(p.endswith(ASSISTANT_TAG) for p in full)
    assert sum(len(v["pairs"]) for v in full.values()) > 2200


def test_hh_local_holdout_slices(hh_slices):
    opts, full, train, test = hh_slices
    assert not set(train) & set(test)
    assert set(train) | set(test) == set(full)
    assert 0.07 < len(test) / len(full) < 0.13
    assert get_hh("test", counter(), holdout_fraction=0.1, **opts) == test
    assert list(get_hh("train", counter(), holdout_fraction=0.1, **opts)) == list(train)


def test_hh_local_train_without_holdout_raises(hh_slices):
    opts = hh_slices[0]
    with pytest.raises(DataError, match="holdout_fraction"):
        get_hh("train", counter(), **opts)


# ----------------------------------------------------------------------------- SHP


def shp_row(history, a, b, sa, sb, label):
    return {"history": history, "human_ref_A": a, "human_ref_B": b, "score_A": sa, "score_B": sb, "labels": label}


P_SHP = "\n\nHuman: post\n\nAssistant:"


def test_shp_label_direction():
    data = shp_rows_to_data([shp_row("post", "A", "B", 10, 2, 1)], counter())
    assert text_pairs(data[P_SHP]) == [(" A", " B")]
    data = shp_rows_to_data([shp_row("post", "A", "B", 2, 10, 0)], counter())
    assert text_pairs(data[P_SHP]) == [(" B", " A")]


def test_shp_tie_skipped_and_zero_score():
    report = counter()
    assert shp_rows_to_data([shp_row("post", "A", "B", 3, 3, 1), shp_row("post", "A", "B", 0, 0, 0)], report) == {}
    assert report == {"skipped: score tie": 2}
    report = counter()
    data = shp_rows_to_data([shp_row("post", "A", "B", 0, 5, 0)], report)  # no ZeroDivisionError
    assert text_pairs(data[P_SHP]) == [(" B", " A")]
    assert report == {"kept: zero or negative score (ratio taken as infinite)": 1}


def test_shp_min_score_ratio():
    rows = [shp_row("post", "A", "B", 3, 2, 1), shp_row("post", "C", "D", 4, 2, 1)]  # ratios 1.5 and 2
    report = counter()
    data = shp_rows_to_data(rows, report)
    assert text_pairs(data[P_SHP]) == [(" C", " D")]  # 2.0 is kept, 1.5 is not
    assert report == {"skipped: score ratio below min_score_ratio": 1}
    data = shp_rows_to_data(rows, counter(), min_score_ratio=1.5)
    assert sorted(text_pairs(data[P_SHP])) == [(" A", " B"), (" C", " D")]


def test_shp_max_pairs_keeps_largest_ratios_and_sft_target():
    rows = [
        shp_row("post", "A", "B", 4, 2, 1),  # ratio 2
        shp_row("post", "C", "D", 1, 10, 0),  # ratio 10, D chosen
        shp_row("post", "E", "F", 5, 1, 1),  # ratio 5
    ]
    report = counter()
    data = shp_rows_to_data(rows, report, max_pairs_per_prompt=2)
    assert text_pairs(data[P_SHP]) == [(" D", " C"), (" E", " F")]
    assert report == {"skipped: over max_pairs_per_prompt": 1}
    # D has both the largest ratio and the highest score (the reference's rule).
    assert data[P_SHP]["sft_target"] == " D"


# ----------------------------------------------------------------------------- SE


def test_se_html_ties_pairs_and_sft_target():
    rows = [
        {
            "question": "<p>How &amp; why?</p>",
            "answers": [
                {"text": "<p>low</p>", "pm_score": 1},
                {"text": "<p>A <b>bold</b> one</p>", "pm_score": 3},
                {"text": "mid &lt;3", "pm_score": 2},
            ],
        },
        {
            "question": "Tie?",
            "answers": [{"text": "x", "pm_score": 5}, {"text": "y", "pm_score": 5}, {"text": "z", "pm_score": 1}],
        },
    ]
    report = counter()
    data = se_rows_to_data(rows, report)
    p1 = "\n\nHuman: How & why?\n\nAssistant:"
    p2 = "\n\nHuman: Tie?\n\nAssistant:"
    assert set(data) == {p1, p2}
    assert sorted(text_pairs(data[p1])) == sorted([(" A bold one", " low"), (" mid <3", " low"), (" A bold one", " mid <3")])
    assert data[p1]["sft_target"] == " A bold one"
    assert sorted(text_pairs(data[p2])) == [(" x", " z"), (" y", " z")]  # x vs y tied: no pair
    assert data[p2]["sft_target"] in (" x", " y")
    assert report == {"skipped: answer score tie": 1}


# ----------------------------------------------------------------------------- json


def write_jsonl(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_json_missing_field_names_file_row_field(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "r"}, {"prompt": "p2", "chosen": "c"}])
    with pytest.raises(DataError) as e:
        get_json("train", counter(), path=f)
    msg = str(e.value)
    assert f in msg and "row 2" in msg and "'rejected'" in msg


def test_json_invalid_line_is_named(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "p", "chosen": "c", "rejected": "r"}\n{bad\n')
    with pytest.raises(DataError, match="line 2"):
        get_json("train", counter(), path=str(f))


def test_json_no_path_raises():
    with pytest.raises(DataError, match="path"):
        get_json("train", counter())


def test_json_split_mapping(tmp_path):
    tr = write_jsonl(tmp_path / "tr.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "r"}])
    te = write_jsonl(tmp_path / "te.jsonl", [{"prompt": "q", "chosen": "c2", "rejected": "r2"}])
    paths = {"train": tr, "test": te}
    assert get_json("train", counter(), path=paths) == {"p": {"responses": ["c", "r"], "pairs": [(0, 1)], "sft_target": "c"}}
    assert get_json("test", counter(), path=paths) == {"q": {"responses": ["c2", "r2"], "pairs": [(0, 1)], "sft_target": "c2"}}
    with pytest.raises(DataError, match="'test'"):
        get_json("test", counter(), path={"train": tr})


def test_json_holdout(tmp_path):
    rows = [{"prompt": f"prompt {i}", "chosen": "c", "rejected": "r"} for i in range(40)]
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    train = get_json("train", counter(), path=f, holdout_fraction=0.5)
    test = get_json("test", counter(), path=f, holdout_fraction=0.5)
    assert not set(train) & set(test)
    assert set(train) | set(test) == {r["prompt"] for r in rows}
    assert 8 <= len(test) <= 32
    assert get_json("test", counter(), path=f, holdout_fraction=0.5) == test


# ----------------------------------------------------------------------------- registry


def test_unknown_dataset_lists_registered():
    with pytest.raises(DataError) as e:
        load_dataset_dict("no_such_dataset", "train")
    for name in ("hh", "shp", "se", "json", "arithmetic"):
        assert repr(name) in str(e.value)


@pytest.fixture
def toy_name():
    name = "toy_for_test_preference_datasets"
    yield name
    REGISTRY.pop(name, None)


def test_register_dataset_usable_by_name(toy_name, capsys):
    @register_dataset(toy_name, truncation_mode="keep_end")
    def toy(split, report, n=1):
        report["skipped: nothing"] += 1
        return {f"{split} {i}": {"responses": ["a", "b"], "pairs": [(0, 1)], "sft_target": "a"} for i in range(n)}

    data = load_dataset_dict(toy_name, "test", {"n": 2})
    assert data == {f"test {i}": {"responses": ["a", "b"], "pairs": [(0, 1)], "sft_target": "a"} for i in range(2)}
    assert f"[data] {toy_name}/test: 2 prompts, 2 pairs (1 skipped: nothing)" in capsys.readouterr().out
    examples = load_examples([toy_name], "train", {toy_name: {"n": 1}}, sft_mode=False, silent=True)
    assert examples == [{"prompt": "train 0", "chosen": "a", "rejected": "b", "truncation_mode": "keep_end"}]
    with pytest.raises(DataError, match="unexpected keyword"):
        load_dataset_dict(toy_name, "train", {"bogus": 1}, silent=True)
    with pytest.raises(ValueError, match="already registered"):
        register_dataset(toy_name)(toy)


# ----------------------------------------------------------------------------- tokenization


@pytest.fixture(scope="module")
def byt5():
    return ByT5Tokenizer()


@pytest.fixture(scope="module")
def stories():
    return AutoTokenizer.from_pretrained(str(shared_path(STORIES)))


@pytest.fixture(scope="module")
def neox_nobos():
    tok = AutoTokenizer.from_pretrained(str(shared_path(NEOX)))
    tok.bos_token = None
    assert tok.bos_token_id is None
    return tok


@pytest.fixture(params=["stories", "byt5", "neox_nobos"])
def tok(request):
    return request.getfixturevalue(request.param)


PROMPT = "\n\nHuman: Tell me a story about a cat.\n\nAssistant:"


def check_element(el: dict, tok, max_length: int | None = None):
    """Invariants of every tokenized element."""
    prompt_ids = el["prompt_input_ids"]
    n = len(prompt_ids)
    bos, eos = tok.bos_token_id, tok.eos_token_id
    if bos is not None:
        assert prompt_ids[0] == bos
    sides = [s for s in ("chosen", "rejected") if f"{s}_input_ids" in el]
    for side in sides:
        ids, labels, mask = el[f"{side}_input_ids"], el[f"{side}_labels"], el[f"{side}_attention_mask"]
        assert None not in ids and None not in prompt_ids
        assert ids[:n] == prompt_ids
        assert labels == [IGNORE_INDEX] * n + ids[n:]
        assert len(ids) > n  # never zero label tokens
        assert mask == [1] * len(ids)
        assert ids[-1] == eos
        assert ids[1:].count(eos) == 1  # ids[0] may be a BOS sharing the EOS id (gpt-style)
        if max_length is not None:
            assert len(ids) <= max_length


def test_tokenize_basic_invariants(tok):
    el = tokenize_element(PROMPT, " The cat sat.", " No.", "keep_end", tok, 128, 64)
    check_element(el, tok)
    assert el["prompt"] == PROMPT and el["chosen"] == " The cat sat." and el["rejected"] == " No."
    body = tok(PROMPT, add_special_tokens=False)["input_ids"]
    bos = [] if tok.bos_token_id is None else [tok.bos_token_id]
    assert el["prompt_input_ids"] == bos + body


def test_tokenize_sft_has_no_rejected(tok):
    el = tokenize_element(PROMPT, " The cat sat.", None, "keep_end", tok, 128, 64)
    check_element(el, tok)
    assert not any(k.startswith("rejected") for k in el)


def test_tokenize_byt5_exact_ids(byt5):
    el = tokenize_element("ab", "xy", "z", "keep_start", byt5, 16, 8)  # byte + 3, eos 1, no BOS
    assert el["prompt_input_ids"] == [100, 101]
    assert el["chosen_input_ids"] == [100, 101, 123, 124, 1]
    assert el["chosen_labels"] == [-100, -100, 123, 124, 1]
    assert el["rejected_input_ids"] == [100, 101, 125, 1]
    assert el["rejected_labels"] == [-100, -100, 125, 1]


def test_tokenize_trailing_eos_string_gives_one_eos(tok):
    eos = tok.eos_token
    plain = tokenize_element(PROMPT, " The cat sat.", " No.", "keep_end", tok, 128, 64)
    tagged = tokenize_element(PROMPT, " The cat sat." + eos, " No." + eos, "keep_end", tok, 128, 64)
    check_element(tagged, tok)
    for key in ("chosen_input_ids", "rejected_input_ids", "chosen_labels", "rejected_labels"):
        assert tagged[key] == plain[key]
    assert tagged["chosen"] == " The cat sat." + eos  # the text itself is kept as given


def test_tokenize_eos_string_mid_response(tok):
    eos = tok.eos_token
    el = tokenize_element(PROMPT, f" a{eos} b", f" c{eos}{eos}", "keep_end", tok, 128, 64)
    check_element(el, tok)  # one EOS id, at the end, for both
    assert len(el["chosen_input_ids"]) > len(el["prompt_input_ids"]) + 3


def test_tokenize_eos_string_mid_response_byt5_exact(byt5):
    el = tokenize_element("ab", "x</s>y", None, "keep_start", byt5, 32, 8)
    # "</s>" stays bytes: < 63, / 50, s 118, > 65
    assert el["chosen_input_ids"] == [100, 101, 123, 63, 50, 118, 65, 124, 1]


def test_truncation_keep_start_vs_keep_end_byt5(byt5):
    # prompt 10 + response 3 > 8 and prompt > 4: prompt cut to 4 tokens
    start = tokenize_element("abcdefghij", "xy", None, "keep_start", byt5, 8, 4)
    end = tokenize_element("abcdefghij", "xy", None, "keep_end", byt5, 8, 4)
    assert start["chosen_input_ids"] == [100, 101, 102, 103, 123, 124, 1]  # a b c d
    assert end["chosen_input_ids"] == [106, 107, 108, 109, 123, 124, 1]  # g h i j


def test_truncation_keep_end_keeps_bos(stories):
    prompt = "Once upon a time there was a little cat who liked to play in the big green garden"
    body = stories(prompt, add_special_tokens=False)["input_ids"]
    assert len(body) > 10
    end = tokenize_element(prompt, " Yes.", " No.", "keep_end", stories, 12, 5)
    start = tokenize_element(prompt, " Yes.", " No.", "keep_start", stories, 12, 5)
    assert end["prompt_input_ids"] == [1] + body[-4:]
    assert start["prompt_input_ids"] == [1] + body[:4]
    check_element(end, stories, 12)
    check_element(start, stories, 12)


def test_prompt_not_cut_when_everything_fits(byt5):
    # prompt (10) > max_prompt_length (4) but prompt + response fit: nothing is cut
    el = tokenize_element("abcdefghij", "xy", None, "keep_end", byt5, 16, 4)
    assert el["prompt_input_ids"] == list(range(100, 110))


def test_truncated_response_ends_with_eos_byt5(byt5):
    el = tokenize_element("ab", "xyzw", "x</s>", "keep_end", byt5, 5, 2)
    assert el["chosen_input_ids"] == [100, 101, 123, 124, 1]  # x y, then EOS replaces z w
    assert el["rejected_input_ids"] == [100, 101, 123, 1]  # trailing "</s>" string: one EOS


def test_truncated_response_invariants(tok):
    long_response = " The cat ran and ran and ran all the way home to her mother." * 3
    el = tokenize_element(PROMPT * 3, long_response, " No.", "keep_end", tok, 24, 12)
    check_element(el, tok, 24)
    assert len(el["chosen_input_ids"]) == 24
    assert len(el["prompt_input_ids"]) == 12


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
def test_response_never_left_without_labels(tok, mode):
    for max_length in range(2, 12):
        el = tokenize_element(PROMPT, " The cat sat on the mat.", " No.", mode, tok, max_length, max_length - 1)
        check_element(el, tok, max_length)


def test_minimal_room_byt5_exact(byt5):
    el = tokenize_element("abcdef", "xyz", None, "keep_start", byt5, 6, 5)
    assert el["chosen_input_ids"] == [100, 101, 102, 103, 104, 1]
    assert el["chosen_labels"] == [-100] * 5 + [1]


def test_keep_end_zero_prompt_length_regression(stories):
    # Regression: keep_end kept the BOS even with max_prompt_length=0, leaving no room,
    # and ids[:room - 1] = ids[:-1] then kept the whole response past max_length.
    el = tokenize_element("a", "b", None, "keep_end", stories, 1, 0)
    assert el["chosen_input_ids"] == [2]
    assert el["chosen_labels"] == [2]


def test_max_prompt_length_must_be_smaller(byt5):  # the sentence is validate_config's (test_train)
    with pytest.raises(AssertionError, match="validate_config"):
        tokenize_element("a", "b", None, "keep_end", byt5, 8, 8)


# ----------------------------------------------------------------------------- collate


def test_collate_padding():
    e1 = {
        "prompt": "p1",
        "prompt_input_ids": [11, 12],
        "chosen_input_ids": [11, 12, 13],
        "chosen_attention_mask": [1, 1, 1],
        "chosen_labels": [-100, -100, 13],
        "chosen": "x",
    }
    e2 = {
        "prompt": "p2",
        "prompt_input_ids": [21],
        "chosen_input_ids": [21, 22, 23, 24],
        "chosen_attention_mask": [1, 1, 1, 1],
        "chosen_labels": [-100, 22, 23, 24],
        "chosen": "y",
    }
    b = collate([e1, e2], pad_token_id=99)
    assert b["prompt"] == ["p1", "p2"] and b["chosen"] == ["x", "y"]
    expected = {
        "chosen_input_ids": [[11, 12, 13, 99], [21, 22, 23, 24]],
        "chosen_attention_mask": [[1, 1, 1, 0], [1, 1, 1, 1]],
        "chosen_labels": [[-100, -100, 13, -100], [-100, 22, 23, 24]],
        "prompt_input_ids": [[11, 12], [99, 21]],
        "prompt_attention_mask": [[1, 1], [0, 1]],
    }
    for key, value in expected.items():
        assert b[key].dtype == torch.long
        assert b[key].tolist() == value, key


# ----------------------------------------------------------------------------- batch iterator


def make_examples(n: int) -> list[dict]:
    return [{"prompt": f"Q{i}", "chosen": " yes", "rejected": " no", "truncation_mode": "keep_end"} for i in range(n)]


def stream(tok, examples, **kw) -> list[list[str]]:
    kw = {"batch_size": 4, "max_length": 32, "max_prompt_length": 16, **kw}
    return [b["prompt"] for b in get_batch_iterator(examples, tok, **kw)]


def flat(batches):
    return [p for b in batches for p in b]


def test_iterator_seed_determinism(byt5):
    ex = make_examples(10)
    a = flat(stream(byt5, ex, n_epochs=1, seed=0))
    assert a == flat(stream(byt5, ex, n_epochs=1, seed=0))
    assert a != flat(stream(byt5, ex, n_epochs=1, seed=1))
    assert sorted(a) == sorted(e["prompt"] for e in ex)
    assert flat(stream(byt5, ex, n_epochs=1, shuffle=False)) == [e["prompt"] for e in ex]


def test_iterator_remainder_and_epochs(byt5):
    ex = make_examples(10)
    batches = stream(byt5, ex, n_examples=23, seed=3)
    assert [len(b) for b in batches] == [4, 4, 4, 4, 4, 3]
    prompts = flat(batches)
    names = sorted(e["prompt"] for e in ex)
    assert sorted(prompts[:10]) == names and sorted(prompts[10:20]) == names  # each epoch a permutation
    assert len(set(prompts[20:])) == 3
    # batch 3 (stream positions 8..11) spans the epoch boundary
    assert batches[2] == prompts[8:12]
    # n_epochs=2 with 10 examples: 20, no batch dropped, last one smaller
    assert [len(b) for b in stream(byt5, ex, n_epochs=2, seed=3)] == [4, 4, 4, 4, 4]
    assert [len(b) for b in stream(byt5, ex, n_epochs=1, batch_size=3)] == [3, 3, 3, 1]


def test_iterator_resume(byt5):
    ex = make_examples(10)
    full = flat(stream(byt5, ex, n_examples=23, seed=5))
    for k in (0, 1, 5, 10, 13, 22, 23):
        assert flat(stream(byt5, ex, n_examples=23, seed=5, start_example=k)) == full[k:], k


def test_iterator_pads_with_eos_when_no_pad_token(stories):
    assert stories.pad_token_id is None
    ex = [
        {"prompt": "Once upon a time", "chosen": " The cat sat on the mat.", "rejected": " No.", "truncation_mode": "keep_end"},
        {"prompt": "Hi", "chosen": " Yes.", "rejected": " A long long long reply.", "truncation_mode": "keep_end"},
    ]
    (batch,) = get_batch_iterator(ex, stories, 2, 64, 32, shuffle=False, n_epochs=1)
    for side in ("chosen", "rejected"):
        ids, mask, labels = batch[f"{side}_input_ids"], batch[f"{side}_attention_mask"], batch[f"{side}_labels"]
        assert ids.shape == mask.shape == labels.shape
        assert (ids[mask == 0] == stories.eos_token_id).all()
        assert (labels[mask == 0] == IGNORE_INDEX).all()
    # left padding: the shorter prompt ("Hi") gets leading pad ids and zero mask
    pmask, pids = batch["prompt_attention_mask"], batch["prompt_input_ids"]
    assert pmask[0].tolist() == [1] * pmask.shape[1]
    assert pmask[1, 0] == 0 and pmask[1, -1] == 1
    assert (pids[pmask == 0] == stories.eos_token_id).all()
    assert pids[1, pmask[1] == 1][0] == stories.bos_token_id


def test_iterator_errors(byt5):
    with pytest.raises(ValueError, match="no examples"):
        next(get_batch_iterator([], byt5, 2, 32, 16, n_epochs=1))
    with pytest.raises(ValueError, match="n_epochs or n_examples"):
        next(get_batch_iterator(make_examples(2), byt5, 2, 32, 16))


# ----------------------------------------------------------------------------- arithmetic


def test_arithmetic():
    train = get_arithmetic("train", counter())
    test = get_arithmetic("test", counter())
    assert (len(train), len(test)) == (4000, 256)
    assert not set(train) & set(test)
    assert get_arithmetic("test", counter()) == test
    for data in (train, test):
        for prompt, entry in data.items():
            m = re.fullmatch(r"Q: (\d+)\+(\d+)=\nA:", prompt)
            assert m, prompt
            a, b = int(m[1]), int(m[2])
            ((chosen, rejected),) = text_pairs(entry)
            assert chosen == f" {a + b}" == entry["sft_target"]
            assert rejected != chosen
            assert int(rejected) in {int(f"{a}{b}"), abs(a - b), a + b + 1, a + b - 1, a + b - 10}


def test_json_single_file_never_evaluates_on_training_rows(tmp_path):
    # Regression: one file used to be read whole for both splits, so eval was on train pairs.
    rows = [{"prompt": f"prompt {i}", "chosen": "c", "rejected": "r"} for i in range(50)]
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    train, test = get_json("train", counter(), path=f), get_json("test", counter(), path=f)
    assert test and train and not set(train) & set(test)


def test_hub_unreachable_is_one_sentence_naming_the_local_option(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'Anthropic/hh-rlhf' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match="Could not load Anthropic/hh-rlhf .*set data.hh.local_dir"):
        get_hh("train", counter())
    with pytest.raises(DataError, match="data.shp.path"):
        get_shp("train", counter())
    with pytest.raises(DataError, match="data.se.path"):
        get_se("train", counter())


def test_docs_add_a_dataset_example_works_as_written(tmp_path):
    import re

    import preference_datasets

    doc = (Path(__file__).resolve().parents[1] / "docs" / "data.md").read_text()
    code = re.search(r"```python\n(# data/mine.py\n.*?)```", doc, re.S).group(1)
    rows = [{"question": f"q{i}", "good": "yes", "bad": "no"} for i in range(30)]
    path = write_jsonl(tmp_path / "all.jsonl", rows)
    namespace = vars(preference_datasets).copy()
    try:
        exec(code, namespace)
        assert preference_datasets.registered("pairs")["mine"].truncation_mode == "keep_start"
        train = load_dataset_dict("mine", "train", {"path": path}, silent=True)
        test = load_dataset_dict("mine", "test", {"path": path}, silent=True)
    finally:
        preference_datasets.REGISTRY.pop("mine", None)
    # Every row is one prompt with one pair, " yes" chosen over " no", in exactly one split; the
    # eval split is the default 10% slice: the prompts whose SHA-256 (first 8 bytes) / 2^64 < 0.1.
    import hashlib

    prompts = {f"\n\nHuman: q{i}\n\nAssistant:" for i in range(30)}
    held_out = {p for p in prompts if int.from_bytes(hashlib.sha256(p.encode()).digest()[:8], "big") / 2**64 < 0.1}
    assert held_out and set(test) == held_out and set(train) == prompts - held_out
    for entry in [*train.values(), *test.values()]:
        assert entry == {"responses": [" yes", " no"], "pairs": [(0, 1)], "sft_target": " yes"}


def test_length_grouped_order_is_a_seeded_permutation_that_cuts_padding():
    from preference_datasets import epoch_order

    rng = random.Random(0)
    lengths = [rng.randint(1, 500) for _ in range(256)]
    plain = epoch_order(256, 0, 0, True)
    grouped = epoch_order(256, 0, 0, True, lengths, 64)
    assert sorted(grouped.tolist()) == list(range(256))
    assert grouped.tolist() == epoch_order(256, 0, 0, True, lengths, 64).tolist()  # reproducible
    assert grouped.tolist() != epoch_order(256, 1, 0, True, lengths, 64).tolist()  # seeded
    assert set(grouped[:64].tolist()) == set(plain[:64].tolist())  # groups keep the seeded order's members

    def padding(order):
        batches = [order[i : i + 8] for i in range(0, 256, 8)]
        return sum(8 * max(lengths[j] for j in b) - sum(lengths[j] for j in b) for b in batches)

    assert padding(grouped) < padding(plain) / 3


# ----------------------------------------------------------------------------- prompt datasets (online DPO)


def hh_prompts_by_hand(rows) -> list[str]:
    """Independent of the loader: the prompt is the chosen text up to the last Assistant tag
    inside the two dialogues' common prefix (os.path.commonprefix); a row with an empty or
    identical response gives no pair, hence no prompt; first-seen order, no repeats."""
    import os

    prompts = []
    for r in rows:
        common = os.path.commonprefix([r["chosen"], r["rejected"]])
        cut = common.rfind(ASSISTANT_TAG) + len(ASSISTANT_TAG)
        usable = r["chosen"][cut:].strip() and r["rejected"][cut:].strip() and r["chosen"] != r["rejected"]
        if usable and r["chosen"][:cut] not in prompts:
            prompts.append(r["chosen"][:cut])
    return prompts


def test_hh_prompts_of_a_small_subset(tmp_path):
    import gzip

    rows = [json.loads(line) for line in gzip.open(shared_path(HH_DIR / "harmless-base" / "test.jsonl.gz"), "rt")][:30]
    same = {"chosen": f"{H} twice{A} same", "rejected": f"{H} twice{A} same"}  # identical responses: no pair
    subset = rows + [rows[0], rows[5], same]  # two repeated prompts
    (tmp_path / "harmless-base").mkdir()
    with gzip.open(tmp_path / "harmless-base" / "test.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in subset)
    got = prompt_sets.load_prompts(
        ["hh"], "test", {"hh": {"local_dir": str(tmp_path), "subsets": ["harmless-base"]}}, silent=True
    )
    # 33 rows: 30 distinct prompts (the first 30 rows of the file all differ), 2 repeats, 1 without a pair.
    assert len(got) == 30
    assert got == hh_prompts_by_hand(subset)
    assert got[0] == rows[0]["chosen"][: rows[0]["chosen"].rindex(A) + len(A)]


def test_hh_prompts_offline_from_the_shared_copy_with_the_config():
    import gzip

    from conftest import compose_config
    from omegaconf import OmegaConf

    config = compose_config(["datasets=[hh]", f"data.hh.local_dir={shared_path(HH_DIR)}", "data.hh.holdout_fraction=0.1"])
    options = OmegaConf.to_container(config.data)
    train = prompt_sets.load_prompts(list(config.datasets), "train", options, silent=True)
    test = prompt_sets.load_prompts(list(config.datasets), "test", options, silent=True)
    rows = [json.loads(line) for line in gzip.open(HH_DIR / "harmless-base" / "test.jsonl.gz", "rt")]
    expected = hh_prompts_by_hand(rows)
    assert len(expected) == 2306  # 2312 rows, 2 repeated prompts, 4 with an empty response
    assert not set(train) & set(test) and sorted(train + test) == sorted(expected)
    assert train == [p for p in expected if p in set(train)]  # first-seen order kept
    assert 0.07 < len(test) / len(expected) < 0.13


TLDR_ROWS = [
    {"prompt": "SUBREDDIT: r/cats\n\nTITLE: My cat\n\nPOST: It sleeps a lot.\n\nTL;DR:", "completion": " sleepy cat"},
    {"prompt": "SUBREDDIT: r/dogs\n\nTITLE: Walks\n\nPOST: Two a day?\n\nTL;DR:", "completion": " how many walks"},
    {"prompt": "SUBREDDIT: r/dogs\n\nTITLE: Walks\n\nPOST: Two a day?\n\nTL;DR:", "completion": " walks?"},  # repeated
    {"prompt": "   ", "completion": " nothing"},  # empty
]


def test_tldr_from_a_local_jsonl(tmp_path, capsys):
    f = write_jsonl(tmp_path / "tldr.jsonl", TLDR_ROWS)
    got = prompt_sets.load_prompts(["tldr"], "train", {"tldr": {"path": f}})
    assert got == [TLDR_ROWS[0]["prompt"], TLDR_ROWS[1]["prompt"]]
    out = capsys.readouterr().out
    assert "[data] tldr/train: 2 prompts (1 skipped: empty prompt, 1 skipped: repeated prompt)" in out
    assert "one file for both splits" in out
    assert prompt_sets.prompt_truncation_mode("tldr") == "keep_end"  # the prompt ends with the TL;DR: cue


def test_tldr_folder_in_the_hub_layout_reads_validation_for_test(tmp_path):
    import pyarrow
    import pyarrow.parquet

    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "validation", "test"):
        table = pyarrow.Table.from_pylist([{"prompt": f"{split} post {i} TL;DR:", "completion": " c"} for i in range(2)])
        pyarrow.parquet.write_table(table, data / f"{split}-00000-of-00001.parquet")
    options = {"tldr": {"path": str(tmp_path)}}
    assert prompt_sets.load_prompts(["tldr"], "train", options, silent=True) == ["train post 0 TL;DR:", "train post 1 TL;DR:"]
    assert prompt_sets.load_prompts(["tldr"], "test", options, silent=True) == [
        "validation post 0 TL;DR:",
        "validation post 1 TL;DR:",
    ]
    (data / "validation-00000-of-00001.parquet").unlink()  # no validation split: test reads test
    assert prompt_sets.load_prompts(["tldr"], "test", options, silent=True) == ["test post 0 TL;DR:", "test post 1 TL;DR:"]


def test_tldr_split_mapping_and_missing_split(tmp_path):
    train = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a"}])
    test = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "b"}])
    options = {"tldr": {"path": {"train": train, "test": test}}}
    assert prompt_sets.load_prompts(["tldr"], "train", options, silent=True) == ["a"]
    assert prompt_sets.load_prompts(["tldr"], "test", options, silent=True) == ["b"]
    (tmp_path / "only").mkdir()
    write_jsonl(tmp_path / "only" / "train.jsonl", [{"prompt": "a"}])
    with pytest.raises(DataError, match="has no validation or test file for split 'test'"):
        prompt_sets.load_prompts(["tldr"], "test", {"tldr": {"path": str(tmp_path / "only")}}, silent=True)
    with pytest.raises(DataError, match="does not exist"):
        prompt_sets.load_prompts(["tldr"], "train", {"tldr": {"path": str(tmp_path / "missing.parquet")}}, silent=True)


@pytest.mark.parametrize("bad", [{"prompt": 5}, {"text": "no prompt field"}, ["not", "an", "object"]])
def test_tldr_malformed_row_names_the_row_and_the_file(tmp_path, bad):
    f = write_jsonl(tmp_path / "t.jsonl", [TLDR_ROWS[0], bad])
    with pytest.raises(DataError, match=f"^{re.escape(f)}, row 2: field 'prompt' is missing or not a string"):
        prompt_sets.load_prompts(["tldr"], "train", {"tldr": {"path": f}}, silent=True)


def test_tldr_hub_call_and_offline_error(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(hub_id, **kwargs):
        calls.append((hub_id, kwargs))
        return [{"prompt": f"{kwargs['split']} p", "completion": " c"}]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert prompt_sets.load_prompts(["tldr"], "test", {}, silent=True) == ["validation p"]
    assert prompt_sets.load_prompts(["tldr"], "train", {"tldr": {"path": None}}, silent=True) == ["train p"]
    assert calls == [
        ("trl-lib/tldr", {"split": "validation", "cache_dir": None}),
        ("trl-lib/tldr", {"split": "train", "cache_dir": None}),
    ]

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'trl-lib/tldr' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match="Could not load trl-lib/tldr .*set data.tldr.path"):
        prompt_sets.load_prompts(["tldr"], "train", {}, silent=True)


def test_load_prompts_concatenates_and_falls_back_to_preference_prompts(tmp_path):
    tldr = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "t1"}, {"prompt": "t2"}])
    rows = [{"prompt": "j1", "chosen": "a", "rejected": "b"}, {"prompt": "j2", "chosen": "a", "rejected": "b"}]
    rows.append({"prompt": "j1", "chosen": "c", "rejected": "d"})  # j1 again: one prompt
    pairs = write_jsonl(tmp_path / "p.jsonl", rows)
    options = {"tldr": {"path": tldr}, "json": {"path": pairs, "holdout_fraction": 0}}
    assert prompt_sets.load_prompts(["tldr", "json"], "train", options, silent=True) == ["t1", "t2", "j1", "j2"]
    examples = prompt_sets.load_prompt_examples(
        ["json", "arithmetic"], "test", {**options, "arithmetic": {"n_test": 1}}, silent=True
    )
    assert examples[:2] == [
        {"prompt": "j1", "truncation_mode": "keep_end"},
        {"prompt": "j2", "truncation_mode": "keep_end"},
    ]
    assert len(examples) == 3 and examples[2]["truncation_mode"] == "keep_start"
    assert (
        prompt_sets.prompt_truncation_mode("hh") == "keep_end"
        and prompt_sets.prompt_truncation_mode("arithmetic") == "keep_start"
    )


def test_unknown_prompt_dataset_lists_both_registries():
    for call in (lambda: prompt_sets.load_prompts(["nope"], "train", {}), lambda: prompt_sets.prompt_truncation_mode("nope")):
        with pytest.raises(
            DataError, match="Unknown prompt dataset 'nope'; registered prompt datasets are \\['hf', 'hh', 'tldr'"
        ) as e:
            call()
        assert "'arithmetic'" in str(e.value)
    with pytest.raises(DataError, match="data.tldr: .*unexpected keyword"):
        prompt_sets.load_prompts(["tldr"], "train", {"tldr": {"bogus": 1}})


def test_register_prompt_dataset_usable_by_name(capsys):
    name = "toy_prompts_for_test"
    try:

        @pd.register_prompt_dataset(name, truncation_mode="keep_end")
        def toy(split, report, n=1):
            report["skipped: nothing"] += 1
            return [f"{split} {i}" for i in range(n)]

        assert prompt_sets.load_prompts([name], "test", {name: {"n": 2}}) == ["test 0", "test 1"]
        assert f"[data] {name}/test: 2 prompts (1 skipped: nothing)" in capsys.readouterr().out
        with pytest.raises(ValueError, match="A prompt dataset named 'toy_prompts_for_test' is already registered"):
            pd.register_prompt_dataset(name)(toy)
        with pytest.raises(ValueError, match="keep_start or keep_end"):
            pd.register_prompt_dataset("other", truncation_mode="middle")
    finally:
        pd.REGISTRY.pop(name, None)


def test_tokenize_prompt_byt5_exact_ids_and_truncation(byt5):
    # ByT5: id = byte + 3, no BOS; no EOS is added to a prompt.
    assert pd.tokenize_prompt("abcdef", byt5, 16, "keep_start") == {
        "prompt": "abcdef",
        "prompt_input_ids": [100, 101, 102, 103, 104, 105],
    }
    assert pd.tokenize_prompt("abcdef", byt5, 4, "keep_start")["prompt_input_ids"] == [100, 101, 102, 103]
    assert pd.tokenize_prompt("abcdef", byt5, 4, "keep_end")["prompt_input_ids"] == [102, 103, 104, 105]
    # "</s>" in the text stays text: '<' 60, '/' 47, 's' 115, '>' 62, each + 3.
    assert pd.tokenize_prompt("a</s>", byt5, 16, "keep_end")["prompt_input_ids"] == [100, 63, 50, 118, 65]
    with pytest.raises(ValueError, match="max_prompt_length must be >= 1"):
        pd.tokenize_prompt("a", byt5, 0, "keep_end")
    with pytest.raises(ValueError, match="keep_start or keep_end, not 'middle'"):
        pd.tokenize_prompt("abcdef", byt5, 4, "middle")


def test_tokenize_prompt_keeps_bos_and_matches_the_pair_pipeline(stories):
    el = pd.tokenize_prompt(PROMPT, stories, 5, "keep_end")
    full = tokenize_element(PROMPT, " x", None, "keep_end", stories, 10_000, 5)["prompt_input_ids"]  # fits: not cut
    assert full[0] == stories.bos_token_id == 1 and len(full) > 5
    assert el["prompt_input_ids"] == [1] + full[-4:]
    assert pd.tokenize_prompt(PROMPT, stories, 5, "keep_start")["prompt_input_ids"] == full[:5]
    assert pd.tokenize_prompt(PROMPT, stories, 10_000, "keep_end")["prompt_input_ids"] == full
    # the pair pipeline cuts a too-long prompt the same way
    cut = tokenize_element(PROMPT, " x", None, "keep_end", stories, 8, 5)["prompt_input_ids"]
    assert cut == el["prompt_input_ids"]


def test_collate_prompts_left_pads_by_hand():
    elements = [{"prompt": "long", "prompt_input_ids": [5, 6, 7]}, {"prompt": "short", "prompt_input_ids": [8]}]
    batch = collate_prompts(elements, pad_token_id=0)
    assert batch["prompt"] == ["long", "short"]
    assert batch["prompt_input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch["prompt_attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch["prompt_input_ids"].dtype == batch["prompt_attention_mask"].dtype == torch.long
    with pytest.raises(ValueError, match="at least one element"):
        collate_prompts([], 0)
