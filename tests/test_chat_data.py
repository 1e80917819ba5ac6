"""Conversational data that trained silently wrong (issue 22): ultrafeedback's layout read as
conversational, roles outside system / user / assistant / tool, tool messages a template cannot
render, empty assistant turns, and exact duplicate pairs. Expected prompts, responses, token ids,
counts and sentences are worked out by hand from the rows."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import datasets
import pytest
from conftest import TINY, compose_config, needs_shared
from omegaconf import OmegaConf
from test_hf_data import bot, key, user
from transformers import AutoTokenizer

import preference_datasets as pd
import train
from data import chat, loading
from data.loading import load_dataset_dict
from losses import IGNORE_INDEX
from utils import DataError

SYS = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
"""SmolLM2's default system message (its template adds it when the first message is not a system one)."""


def smollm2():
    return AutoTokenizer.from_pretrained(str(needs_shared("tokenizers", "smollm2-135m-instruct")))


def enc(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def write(tmp_path: Path, rows: list[dict], name: str = "rows.parquet") -> str:
    f = str(tmp_path / name)
    datasets.Dataset.from_list(rows).to_parquet(f)
    return f


def load(tmp_path: Path, f: str, **options) -> dict:
    options = {"path": {"train": f, "test": f}, "cache_dir": str(tmp_path / "hf_cache"), **options}
    return load_dataset_dict("hf", "train", options, silent=True)


def load_examples(tmp_path: Path, f: str, **options) -> list[dict]:
    options = {"path": {"train": f, "test": f}, "cache_dir": str(tmp_path / "hf_cache"), **options}
    return loading.load_examples(["hf"], "train", {"hf": options}, sft_mode=False, silent=True)


def pairs_of(data: dict) -> list[tuple]:
    return [(k, e["responses"][i], e["responses"][j]) for k, e in data.items() for i, j in e["pairs"]]


def h4_row(conversation: list[dict], good: str, bad: str) -> dict:
    """A row of HuggingFaceH4/ultrafeedback_binarized: ``prompt`` the last user turn's text,
    ``chosen`` / ``rejected`` the whole conversation (earlier turns included) with the answer."""
    return {
        "prompt": conversation[-1]["content"],
        "chosen": [*conversation, bot(good)],
        "rejected": [*conversation, bot(bad)],
        "score_chosen": 8.0,
        "score_rejected": 3.0,
    }


# ----------------------------------------------------------------------------- ultrafeedback's layout


def test_ultrafeedback_layout_read_as_conversational_takes_the_earlier_turns_as_prompt(tmp_path, capsys):
    """Regression: format=conversational trained the whole conversation (earlier user turns and
    role tags) as the response to the last user message."""
    multi = [user("u1"), bot("a1"), user("u2")]
    again = [user("r"), bot("a1"), user("r")]  # the question asked twice: the prompt runs to its last asking
    f = write(tmp_path, [h4_row([user("q")], "good1", "bad1"), h4_row(multi, "good2", "bad2"), h4_row(again, "g", "b")])
    expected = [
        (key([user("q")]), [bot("good1")], [bot("bad1")]),
        (key(multi), [bot("good2")], [bot("bad2")]),
        (key(again), [bot("g")], [bot("b")]),
    ]
    assert pairs_of(load(tmp_path, f, format="conversational")) == expected
    assert pairs_of(load(tmp_path, f)) == expected  # format=auto (implicit) reads the same pairs
    examples = load_examples(tmp_path, f, format="conversational")
    assert [(ex["prompt"], ex["chosen"], ex["rejected"]) for ex in examples] == [
        ([user("q")], [bot("good1")], [bot("bad1")]),
        (multi, [bot("good2")], [bot("bad2")]),
        (again, [bot("g")], [bot("b")]),
    ]
    # rendered and tokenized: the prompt is the whole earlier conversation, the trained tokens only the last answer
    tok = smollm2()
    start, end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    rendered = chat.render_conversations(examples, tok, 256, 128, split="train")
    out = capsys.readouterr().out
    assert "warning" not in out  # no prefix-breaking rendering (the old symptom's warning)
    ex = rendered[1]
    assert ex["prompt"] == (
        SYS + "<|im_start|>user\nu1<|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n<|im_start|>user\nu2<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert (ex["chosen"], ex["rejected"]) == ("good2<|im_end|>", "bad2<|im_end|>")
    nl = enc(tok, "\n")
    system = [start, *enc(tok, "system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"), end, *nl]
    turns = [start, *enc(tok, "user\nu1"), end, *nl, start, *enc(tok, "assistant\na1"), end, *nl]
    prompt = [*system, *turns, start, *enc(tok, "user\nu2"), end, *nl, start, *enc(tok, "assistant\n")]
    el = pd.tokenize_element(
        ex["prompt"], ex["chosen"], ex["rejected"], "keep_end", tok, 256, 128, ex["end_token_id"], ex.get("pieces")
    )
    assert el["prompt_input_ids"] == prompt
    for side, text in (("chosen", "good2"), ("rejected", "bad2")):
        assert el[f"{side}_input_ids"] == prompt + enc(tok, text) + [end]
        assert [t for t in el[f"{side}_labels"] if t != IGNORE_INDEX] == enc(tok, text) + [end]


def test_conversational_prompt_messages_beside_whole_conversations_and_plain_responses(tmp_path):
    """A prompt of messages beside whole conversations that begin with it, or beside the responses alone."""
    system = {"role": "system", "content": "Be brief."}
    rows = [
        {"prompt": [system, user("u")], "chosen": [system, user("u"), bot("A")], "rejected": [system, user("u"), bot("B")]},
        {"prompt": [user("v")], "chosen": [bot("C")], "rejected": [bot("D")]},
    ]
    f = write(tmp_path, rows)
    assert pairs_of(load(tmp_path, f, format="conversational")) == [
        (key([system, user("u")]), [bot("A")], [bot("B")]),
        (key([user("v")]), [bot("C")], [bot("D")]),
    ]
    one_side = [{"prompt": "w", "chosen": [bot("E")], "rejected": [user("w"), bot("F")]}]  # one side whole, one the response
    f = write(tmp_path, one_side, "one_side.parquet")
    assert pairs_of(load(tmp_path, f, format="conversational")) == [(key([user("w")]), [bot("E")], [bot("F")])]


@pytest.mark.parametrize(
    "row, sentence",
    [
        (
            {"prompt": "not in the conversation", "chosen": [user("u"), bot("a")], "rejected": [user("u"), bot("b")]},
            "row 2: 'chosen' starts with a user message, so it holds more than the response, but none of its user turns "
            "followed by the assistant's is the 'prompt' text, so its prompt cannot be told from its response; fix the row, "
            "or set data.hf.format=implicit to split chosen and rejected at their common messages and ignore 'prompt'.",
        ),
        (
            {"prompt": [user("x")], "chosen": [bot("a")], "rejected": [user("y"), bot("b")]},
            "row 2: 'rejected' starts with a user message, so it holds more than the response, but it does not begin "
            "with the 'prompt' messages followed by the assistant's turn, so its prompt cannot be told from its response; "
            "fix the row, or set data.hf.format=implicit to split chosen and rejected at their common messages and ignore 'prompt'.",
        ),
        (
            {"prompt": "u2", "chosen": [user("u1"), bot("a1"), user("u2"), bot("a")], "rejected": [user("u2"), bot("b")]},
            "row 2: 'chosen' and 'rejected' hold different conversations before their responses (3 and 1 messages); "
            "a pair answers one prompt, so give both the same earlier turns.",
        ),
    ],
)
def test_conversational_row_that_fits_no_reading_is_one_sentence_naming_the_row(tmp_path, row, sentence):
    good = {"prompt": [user("p")] if isinstance(row["prompt"], list) else "p", "chosen": [bot("a")], "rejected": [bot("b")]}
    f = write(tmp_path, [good, row], "bad.parquet")
    with pytest.raises(DataError) as e:
        load(tmp_path, f, format="conversational")
    assert str(e.value) == f"{f}, {sentence}"


# ----------------------------------------------------------------------------- roles


@pytest.mark.parametrize("role", ["human", "gpt", "bot", "function"])
def test_a_role_outside_the_standard_four_is_refused_before_any_model(tmp_path, role):
    """Regression: SmolLM2's template renders any role as text, so misspelled roles trained silently."""
    rows = [
        {"chosen": [user("u"), bot("a")], "rejected": [user("u"), bot("b")]},
        {"chosen": [user("v"), {"role": role, "content": "c"}], "rejected": [user("v"), bot("d")]},
    ]
    f = write(tmp_path, rows)
    out = tmp_path / "runs"
    config = compose_config(
        [*TINY, f"output_root={out}", "datasets=[hf]", f"data.hf.path={f}", f"data.hf.cache_dir={tmp_path}/c"]
    )
    with pytest.raises(DataError) as e:
        train.main(config)
    likely = {"human": "user", "gpt": "assistant", "bot": "assistant", "function": "tool"}[role]
    assert str(e.value) == (
        f"{f}, row 2: message 2 of 'chosen' has role {role!r}, which is not one of system, user, assistant, tool; "
        f"map it with 'data.hf.roles={{{role}: {likely}}}'."
    )
    assert not out.exists()


def sharegpt(text: str, speaker: str) -> dict:
    return {"from": speaker, "value": text}


def test_data_hf_roles_maps_roles_and_reads_sharegpt_messages(tmp_path):
    roles = {"human": "user", "gpt": "assistant"}
    # LLaMA-Factory's ShareGPT preference layout: conversations, and one message as chosen / rejected
    factory = [
        {
            "conversations": [sharegpt("hi", "human"), sharegpt("hello", "gpt"), sharegpt("2+2?", "human")],
            "chosen": sharegpt("4", "gpt"),
            "rejected": sharegpt("5", "gpt"),
        }
    ]
    f = str(tmp_path / "factory.json")
    Path(f).write_text(json.dumps(factory, indent=1))  # a JSON list, as LLaMA-Factory's data files
    got = load(tmp_path, f, columns={"prompt": "conversations"}, roles=roles)
    assert pairs_of(got) == [(key([user("hi"), bot("hello"), user("2+2?")]), [bot("4")], [bot("5")])]
    # whole conversations with other role names (implicit prompt)
    implicit = [
        {"chosen": [sharegpt("q", "human"), sharegpt("a", "gpt")], "rejected": [sharegpt("q", "human"), sharegpt("b", "gpt")]}
    ]
    f = write(tmp_path, implicit, "implicit.parquet")
    assert pairs_of(load(tmp_path, f, roles=roles)) == [(key([user("q")]), [bot("a")], [bot("b")])]
    with pytest.raises(DataError) as e:
        load(tmp_path, f)
    assert str(e.value) == (
        f"{f}, row 1: message 1 of 'chosen' has role 'human', which is not one of system, user, assistant, tool; "
        "map it with 'data.hf.roles={human: user}'."
    )
    # the hint names the role found and keeps the mapping given (found by a new user: it repeated a fixed example)
    with pytest.raises(DataError) as e:
        load(tmp_path, f, roles={"gpt": "assistant"})
    assert str(e.value).endswith("map it with 'data.hf.roles={gpt: assistant, human: user}'.")
    with pytest.raises(DataError) as e:
        load(tmp_path, f, roles={"Human": "user", "gpt": "assistant"})  # roles are case-sensitive
    assert str(e.value).endswith("map it with 'data.hf.roles={Human: user, gpt: assistant, human: user}'.")
    with pytest.raises(DataError) as e:
        load(tmp_path, f, roles={"human": "person"})
    assert str(e.value) == (
        "data.hf.roles maps 'human' to 'person', which is not one of system, user, assistant, tool; map each of your "
        "roles to one of them."
    )


def test_readme_sharegpt_command_reads_its_file(tmp_path, monkeypatch):
    """The README's ShareGPT overrides, composed by Hydra and loaded as train.py loads them."""
    rows = [
        {"conversations": [sharegpt(f"q{i}", "human")], "chosen": sharegpt(f"a{i}", "gpt"), "rejected": sharegpt(f"b{i}", "gpt")}
        for i in range(20)
    ]
    datasets.Dataset.from_list(rows).to_json(str(tmp_path / "sharegpt_prefs.jsonl"))
    monkeypatch.chdir(tmp_path)
    readme = "data.hf.path=sharegpt_prefs.jsonl 'data.hf.columns={prompt: conversations}' 'data.hf.roles={human: user, gpt: assistant}'"
    config = compose_config(["datasets=[hf]", *shlex.split(readme), f"data.hf.cache_dir={tmp_path / 'c'}"])
    options = OmegaConf.to_container(config.data, resolve=True)
    splits = [loading.load_examples(["hf"], split, options, sft_mode=False, silent=True) for split in ("train", "test")]
    assert all(splits)  # the held-out slice (holdout_fraction 0.1) takes some prompts, not all
    got = [(ex["prompt"], ex["chosen"], ex["rejected"]) for split in splits for ex in split]
    assert sorted(got, key=json.dumps) == sorted(
        [([user(f"q{i}")], [bot(f"a{i}")], [bot(f"b{i}")]) for i in range(20)], key=json.dumps
    )


def test_rendering_refuses_a_role_a_loader_let_through():
    """A registered loader's conversation (not read through data.hf) is checked as it is rendered."""
    ex = {"prompt": [{"role": "human", "content": "hi"}], "chosen": [bot("a")], "rejected": [bot("b")]}
    ex.update(truncation_mode="keep_end", conversation=True, row="mine.jsonl, row 4")
    with pytest.raises(DataError) as e:
        chat.render_conversations([ex], smollm2(), 64, 32)
    assert str(e.value) == (
        "mine.jsonl, row 4: message 1 of the prompt has role 'human', which is not one of system, user, assistant, tool; "
        "map it to one of them where the data is read (datasets=[hf]: data.hf.roles)."
    )


# ----------------------------------------------------------------------------- tool messages, empty turns

ONLY_CHAT_ROLES = (
    "{% for m in messages %}{% if m['role'] in ['system', 'user', 'assistant'] %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""A template that leaves out every message of another role (a tool message vanishes)."""

RAISES_ON_TOOL = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tool_example(row: str) -> dict:
    prompt = [user("weather?"), bot("calling"), {"role": "tool", "content": "sunny 21C"}, user("so?")]
    return {"prompt": prompt, "chosen": [bot("Sunny.")], "rejected": [bot("Rain.")], "truncation_mode": "keep_end"} | {
        "conversation": True,
        "row": row,
    }


def test_a_tool_message_the_template_cannot_render_is_one_sentence():
    tok = smollm2()
    (ok,) = chat.render_conversations([tool_example("t.jsonl, row 1")], tok, 256, 128, silent=True)
    assert "<|im_start|>tool\nsunny 21C<|im_end|>\n" in ok["prompt"]  # SmolLM2's template renders it
    name = tok.name_or_path
    tok.chat_template = ONLY_CHAT_ROLES
    with pytest.raises(DataError) as e:
        chat.render_conversations([tool_example("t.jsonl, row 2")], tok, 256, 128, silent=True)
    assert str(e.value) == (
        f"t.jsonl, row 2 holds a 'tool' message, which the chat template of {name!r} cannot render (its rendering leaves "
        "the tool message's content out); set model.chat_template to a template that renders tool messages, or leave "
        "such rows out."
    )
    tok.chat_template = RAISES_ON_TOOL
    with pytest.raises(DataError) as e:
        chat.render_conversations([tool_example("t.jsonl, row 3")], tok, 256, 128, silent=True)
    assert str(e.value) == (
        f"t.jsonl, row 3 holds a 'tool' message, which the chat template of {name!r} cannot render (it raises: no tool "
        "role); set model.chat_template to a template that renders tool messages, or leave such rows out."
    )


def test_empty_assistant_turns_inside_conversations_are_one_warning_per_split(capsys):
    def ex(prompt, chosen, row):
        return {"prompt": prompt, "chosen": chosen, "rejected": [bot("no")], "truncation_mode": "keep_end"} | {
            "conversation": True,
            "row": row,
        }

    examples = [
        ex([user("u")], [bot("fine")], "c.jsonl, row 1"),
        ex([user("u1"), bot(""), user("u2")], [bot("x")], "c.jsonl, row 2"),  # empty turn in the prompt
        ex([user("v")], [bot(" "), user("v2"), bot("y")], "c.jsonl, row 3"),  # empty (blank) turn in a response
    ]
    chat.render_conversations(examples, smollm2(), 256, 128, split="test")
    lines = [line for line in capsys.readouterr().out.splitlines() if "warning" in line]
    assert lines == [
        "[data] warning: eval: 66.7% (2 of 3) conversations hold an empty assistant message before their last turn "
        "(the first: c.jsonl, row 2); each is kept as an empty turn (trained as one where it is part of a response): "
        "fix or drop those rows if that is not meant."
    ]


def test_hh_conversations_with_an_empty_assistant_turn_are_warned_too(tmp_path, capsys):
    import gzip

    folder = tmp_path / "hh" / "helpful-base"
    folder.mkdir(parents=True)
    rows = [
        {
            "chosen": "\n\nHuman: a\n\nAssistant:\n\nHuman: b\n\nAssistant: yes",
            "rejected": "\n\nHuman: a\n\nAssistant:\n\nHuman: b\n\nAssistant: no",
        },
        {"chosen": "\n\nHuman: c\n\nAssistant: ok", "rejected": "\n\nHuman: c\n\nAssistant: nope"},
    ]
    with gzip.open(folder / "train.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    examples = loading.load_examples(
        ["hh"], "train", {"hh": {"local_dir": str(tmp_path / "hh"), "conversation": True}}, False, True
    )
    assert examples[0]["prompt"] == [user("a"), bot(""), user("b")]
    chat.render_conversations(examples, smollm2(), 256, 128)
    assert "[data] warning: train: 50.0% (1 of 2) conversations hold an empty assistant message" in capsys.readouterr().out


# ----------------------------------------------------------------------------- duplicates


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_exact_duplicate_pairs_are_counted_per_split_and_a_large_share_is_warned(tmp_path, capsys):
    """Regression: 100,000 copies of one pair trained as 100,000 pairs without a word."""
    copies = [{"prompt": "P", "chosen": "good", "rejected": "bad"}] * 50
    distinct = [{"prompt": f"p{i}", "chosen": "good", "rejected": "bad"} for i in range(10)]
    f = write_jsonl(tmp_path / "d.jsonl", copies + distinct)
    options = {"json": {"path": {"train": f, "test": f}}}
    examples = loading.load_examples(["json"], "train", options, sft_mode=False)
    assert len(examples) == 60  # every copy is kept and trained on
    # 60 pairs of which the 49 copies after the first of P's are exact duplicates: 49 / 60 = 81.7%
    assert capsys.readouterr().out.splitlines() == [
        "[data] json/train: 11 prompts, 60 pairs (49 repeat an earlier pair exactly (kept))",
        "[data] warning: json/train: 81.7% (49 of 60) of the pairs (same prompt, chosen and rejected) repeat an earlier "
        "one exactly; each copy is trained on, so deduplicate the data unless the repetition is meant.",
    ]
    # 2 copies among 20 pairs: 1 duplicate, 5%: counted, no warning; another rejected is no duplicate
    rows = [copies[0], copies[0], {"prompt": "P", "chosen": "good", "rejected": "worse"}] + [
        {"prompt": f"p{i}", "chosen": "good", "rejected": "bad"} for i in range(17)
    ]
    f = write_jsonl(tmp_path / "few.jsonl", rows)
    loading.load_examples(["json"], "train", {"json": {"path": {"train": f, "test": f}}}, sft_mode=False)
    assert capsys.readouterr().out.splitlines() == [
        "[data] json/train: 18 prompts, 20 pairs (1 repeat an earlier pair exactly (kept))"
    ]
    # the eval split's copies are not trained on: the warning says what they do (found by a new user)
    loading.load_examples(["json"], "test", options, sft_mode=False)
    assert (
        capsys.readouterr()
        .out.splitlines()[1]
        .endswith("each copy counts in the eval metrics, so deduplicate the data unless the repetition is meant.")
    )
    # SFT trains each prompt once: the copies are counted, not warned
    assert len(loading.load_examples(["json"], "train", options, sft_mode=True)) == 11
    assert capsys.readouterr().out.splitlines() == [
        "[data] json/train: 11 prompts, 60 pairs (49 repeat an earlier pair exactly (kept))"
    ]


def test_json_rows_of_messages_point_to_the_hf_loader(tmp_path):
    f = write_jsonl(tmp_path / "m.jsonl", [{"prompt": [user("u")], "chosen": [bot("a")], "rejected": [bot("b")]}])
    with pytest.raises(DataError) as e:
        load_dataset_dict("json", "train", {"path": {"train": f, "test": f}}, silent=True)
    assert str(e.value) == (
        f"{f}, row 1: field 'prompt' is a list of messages, which datasets=[json] does not read; read conversations with "
        f"datasets=[hf] data.hf.path={f}."
    )
