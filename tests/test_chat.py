"""Chat templates (issue 12): conversations rendered by the template into token ids and labels,
end-of-turn tokens, BOS written by the template, prefix-breaking templates, truncation by whole
turns, SFT on every assistant turn, generation stopping at end-of-turn, a random model with any
tokenizer. Expected ids are worked out from hand-written renderings, tokenized piece by piece."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY, compose_config, metric_records, needs_shared, run_train
from omegaconf import OmegaConf
from transformers import AutoTokenizer, ByT5Tokenizer

import preference_datasets as pd
import trainers
import utils
from data import chat, screening, splits
from data.chat import end_of_turn_token, stop_token_ids
from evaluation import in_training, sampling
from losses import IGNORE_INDEX
from modeling import models
from utils import DataError

SYS = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
"""SmolLM2's default system message (its template adds it when the first message is not a system one)."""

LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] "
    "+ '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
"""A Llama-3-style template: writes BOS itself, ends each turn with <|eot_id|> (not the EOS)."""

# Adds a default system message only when rendering with the generation prompt: the whole
# conversation's rendering then does not start with the prompt's.
ONE_SIDED = (
    "{% if add_generation_prompt %}{{ '<|im_start|>system\nDefault<|im_end|>\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def smollm2():
    return AutoTokenizer.from_pretrained(str(needs_shared("tokenizers", "smollm2-135m-instruct")))


def llama3_tokenizer():
    """SmolLM2's tokenizer with Llama 3's header / end-of-turn / BOS special tokens and template."""
    tok = smollm2()
    tok.add_special_tokens(
        {
            "bos_token": "<|begin_of_text|>",
            "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        }
    )
    tok.chat_template = LLAMA3
    return tok


def enc(tok, text: str) -> list[int]:
    """Plain text, no special token parsed."""
    return tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def conv(prompt, chosen, rejected=None, **extra):
    ex = {"prompt": prompt, "chosen": chosen, "truncation_mode": "keep_end", "conversation": True, **extra}
    if rejected is not None:
        ex["rejected"] = rejected
    return ex


def element(tok, ex, max_length=256, max_prompt_length=128):
    return pd.tokenize_element(
        ex["prompt"], ex["chosen"], ex.get("rejected"), ex["truncation_mode"], tok, max_length, max_prompt_length,
        ex.get("end_token_id"), ex.get("pieces"),
    )  # fmt: skip


def test_smollm2_pair_ids_and_labels_by_hand(capsys):
    tok = smollm2()
    start, end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    plain = {"prompt": "1+1=", "chosen": " 2", "rejected": " 3", "truncation_mode": "keep_start"}
    out = chat.render_conversations([conv([user("Hi")], [assistant("Yes")], [assistant("No")]), plain], tok, 256, 128)
    assert out[1] is plain  # plain text passes unchanged
    ex = out[0]
    assert ex["prompt"] == SYS + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert (ex["chosen"], ex["rejected"]) == ("Yes<|im_end|>", "No<|im_end|>")  # the newline after <|im_end|> is not trained
    assert "1 conversations rendered" in capsys.readouterr().out
    # the rendering, tokenized between its special tokens by hand
    system = [
        start,
        *enc(tok, "system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"),
        end,
        *enc(tok, "\n"),
    ]
    prompt = [*system, start, *enc(tok, "user\nHi"), end, *enc(tok, "\n"), start, *enc(tok, "assistant\n")]
    el = element(tok, ex)
    assert el["prompt_input_ids"] == prompt  # no BOS added in front of the template's own <|im_start|>
    for side, text in (("chosen", "Yes"), ("rejected", "No")):
        assert el[f"{side}_input_ids"] == prompt + enc(tok, text) + [end]  # one <|im_end|> (= EOS), not two
        assert el[f"{side}_labels"] == [IGNORE_INDEX] * len(prompt) + enc(tok, text) + [end]
        whole = tok(ex["prompt"] + ex[side], add_special_tokens=False)["input_ids"]
        assert whole == el[f"{side}_input_ids"]  # tokenized at the boundary, nothing shifts
    assert tok.convert_tokens_to_ids("<") not in el["chosen_input_ids"]  # <|im_start|> is one token
    # plain text is tokenized as before: special-token text split, BOS added
    assert element(tok, plain)["prompt_input_ids"] == [tok.bos_token_id, *enc(tok, "1+1=")]
    assert element(tok, {**plain, "prompt": "<|im_start|>"})["prompt_input_ids"][1:] == enc(tok, "<|im_start|>")


def test_llama3_style_template_eot_and_its_own_bos():
    tok = llama3_tokenizer()
    bos, eot, header, header_end = tok.convert_tokens_to_ids(
        ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
    )
    assert end_of_turn_token(tok) == "<|eot_id|>"
    assert stop_token_ids(tok) == [tok.eos_token_id, eot]
    (ex,) = chat.render_conversations([conv([user("Hi")], [assistant("Yes")], [assistant("No")])], tok, 256, 128, silent=True)
    assert ex["end_token_id"] == eot
    prompt = [bos, header, *enc(tok, "user"), header_end, *enc(tok, "\n\nHi"), eot, header, *enc(tok, "assistant"), header_end]
    prompt += enc(tok, "\n\n")
    el = element(tok, ex)
    assert el["prompt_input_ids"] == prompt and el["prompt_input_ids"].count(bos) == 1  # the template's BOS, not doubled
    assert el["chosen_labels"] == [IGNORE_INDEX] * len(prompt) + enc(tok, "Yes") + [eot]
    assert tok.eos_token_id not in el["chosen_input_ids"]  # no EOS after <|eot_id|>
    # a response cut by max_length still ends with the end-of-turn token, and keep_end keeps the BOS
    long = conv([user("Hi " * 40)], [assistant("word " * 40)], [assistant("No")])
    (cut,) = chat.render_conversations([long], tok, 24, 12, silent=True)
    el = element(tok, cut, 24, 12)
    assert el["prompt_input_ids"][0] == bos and len(el["prompt_input_ids"]) == 12
    assert el["chosen_input_ids"][-1] == eot and len(el["chosen_input_ids"]) == 24


def test_template_that_breaks_the_prefix_is_said_once_and_labels_do_not_shift(capsys):
    tok = smollm2()
    tok.chat_template = ONE_SIDED
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    examples = [conv([user("Hi")], [assistant("Yes")], [assistant("No")]), conv([user("Ok")], [assistant("A")], [assistant("B")])]
    out = chat.render_conversations(examples, tok, 256, 128, split="train")
    printed = capsys.readouterr().out
    assert printed.count("warning") == 1 and "100.0% (2 of 2)" in printed
    ex = out[0]
    assert ex["prompt"] == "<|im_start|>system\nDefault<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert ex["chosen"] == "Yes<|im_end|>"
    el = element(tok, ex)
    prompt = [start, *enc(tok, "system\nDefault"), end, *enc(tok, "\n"), start, *enc(tok, "user\nHi"), end, *enc(tok, "\n")]
    prompt += [start, *enc(tok, "assistant\n")]
    assert el["prompt_input_ids"] == prompt
    assert el["chosen_labels"] == [IGNORE_INDEX] * len(prompt) + enc(tok, "Yes") + [end]


def test_multi_turn_prompt_loses_whole_earliest_turns_first(capsys):
    tok = smollm2()
    long = "word " * 30
    system = {"role": "system", "content": "S"}
    messages = [system, user(long), assistant(long), user(long), assistant(long), user("Last?")]
    kept = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nLast?<|im_end|>\n<|im_start|>assistant\n"
    n_kept = len(tok(kept, add_special_tokens=False)["input_ids"])
    one_dropped = [system, user(long), assistant(long), user("Last?")]
    n_one_dropped = len(tok(tok.apply_chat_template(one_dropped, tokenize=False, add_generation_prompt=True))["input_ids"])
    max_prompt_length = n_kept + 2
    assert n_one_dropped > max_prompt_length  # so two turns must go
    fits = conv([user("Hi")], [assistant("Yes")], [assistant("No")])
    only_turn = conv([user(long)], [assistant("Yes")], [assistant("No")])  # one user turn: cut by tokens later
    out = chat.render_conversations(
        [conv(messages, [assistant("Yes")], [assistant("No")]), fits, only_turn], tok, max_prompt_length + 8, max_prompt_length
    )
    assert out[0]["messages"] == [system, user("Last?")] and out[0]["prompt"] == kept
    assert out[2]["messages"] == [user(long)]
    assert "1 prompts lost their earliest turns (2 turns in all)" in capsys.readouterr().out
    # a prompt alone (online DPO), without a system message: still starts at a user turn
    (alone,) = chat.render_conversations(
        [{"prompt": [user(long), assistant(long), user("Last?")], "truncation_mode": "keep_end", "conversation": True}],
        tok, 64, 40, silent=True,
    )  # fmt: skip
    assert (
        alone["messages"] == [user("Last?")]
        and alone["prompt"] == SYS + "<|im_start|>user\nLast?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = pd.tokenize_prompt(alone["prompt"], tok, 40, "keep_end", rendered=True)["prompt_input_ids"]
    assert ids == tok(alone["prompt"], add_special_tokens=False)["input_ids"]


def test_sft_on_every_assistant_turn_and_multi_turn_responses():
    tok = smollm2()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ex = conv([user("U1"), assistant("A1"), user("U2")], [assistant("A2")])

    def trained(el):
        return [t for t, label in zip(el["chosen_input_ids"], el["chosen_labels"]) if label != IGNORE_INDEX]

    (only_target,) = chat.render_conversations([ex], tok, 256, 128, silent=True)
    assert trained(element(tok, only_target)) == enc(tok, "A2") + [end]
    (every,) = chat.render_conversations([ex], tok, 256, 128, silent=True, all_assistant_turns=True)
    el = element(tok, every)
    assert trained(el) == enc(tok, "A1") + [end] + enc(tok, "A2") + [end]
    assert el["chosen_input_ids"] == element(tok, only_target)["chosen_input_ids"]  # same tokens, more labels
    labels = el["chosen_labels"]
    assert all(label in (IGNORE_INDEX, t) for t, label in zip(el["chosen_input_ids"], labels))
    # a response of several messages: its user turn (and the next assistant header) are not trained
    (multi,) = chat.render_conversations(
        [conv([user("U1")], [assistant("A1"), user("U2"), assistant("A2")])], tok, 256, 128, silent=True
    )
    el = element(tok, multi)
    assert trained(el) == enc(tok, "A1") + [end] + enc(tok, "A2") + [end]
    assert multi["chosen"] == "A1<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\nA2<|im_end|>"
    # screening decides on exactly these ids
    (t,) = screening.truncated_ids([multi], tok, 256, 128)
    assert t.prompt_ids == el["prompt_input_ids"] and t.response_ids == [el["chosen_input_ids"][len(t.prompt_ids) :]]


def test_bad_conversations_are_one_sentence_naming_the_row():
    ex = conv([user("Hi")], [assistant("Yes")], [assistant("No")], row="prefs.parquet, row 3")
    with pytest.raises(DataError, match=r"prefs.parquet, row 3 is a conversation .* model.chat_template=<file or Jinja string>"):
        chat.render_conversations([ex], ByT5Tokenizer(), 64, 32)
    tok = smollm2()
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('Only user and assistant roles are supported') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    bad_role = conv([{"role": "system", "content": "x"}, user("Hi")], [assistant("Yes")], [assistant("No")], row="f.jsonl, row 7")
    with pytest.raises(
        DataError, match=r"f.jsonl, row 7: the chat template rejects .*Only user and assistant roles are supported"
    ):
        chat.render_conversations([bad_role], tok, 64, 32)
    with pytest.raises(DataError, match=r"train example 1: the rejected response ends with a 'user' message"):
        chat.render_conversations([conv([user("Hi")], [assistant("Yes")], [user("No")])], smollm2(), 64, 32)


def test_random_model_takes_any_tokenizer_and_chat_template_setting(tmp_path):
    path = str(needs_shared("tokenizers", "smollm2-135m-instruct"))
    config = compose_config([f"model.tokenizer_name_or_path={path}"])  # the tiny preset sets tokenizer_class: path wins
    tok = models.load_tokenizer(config.model)
    assert len(tok) == 49152 and tok.convert_tokens_to_ids("<|im_end|>") == 2
    assert models.transformers_config(config.model, tok).vocab_size == 49152
    template = tmp_path / "t.jinja"
    template.write_text(LLAMA3)
    for value in (str(template), LLAMA3):
        model = OmegaConf.merge(config.model, {"chat_template": value})
        assert models.load_tokenizer(model).chat_template == LLAMA3
    with pytest.raises(utils.ConfigError, match="neither a file nor a Jinja template"):
        models.load_tokenizer(OmegaConf.merge(config.model, {"chat_template": str(tmp_path / "missing.jinja")}))
    with pytest.raises(utils.ConfigError, match="vocab_size=512 is smaller than the tokenizer's 49152"):
        models.transformers_config(
            compose_config([f"model.tokenizer_name_or_path={path}", "+model.config.vocab_size=512"]).model, tok
        )


def test_generation_stops_at_end_of_turn(tmp_path):
    tok = llama3_tokenizer()
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    config = compose_config([*TINY, f"output_root={tmp_path}", "n_eval_model_samples=1", "max_length=48"])
    policy = models.load_model(config.model, tok, torch.float32, 0)
    policy.lm_head = torch.nn.Linear(policy.config.hidden_size, len(tok), bias=True)  # always <|eot_id|>
    torch.nn.init.zeros_(policy.lm_head.weight)
    with torch.no_grad():
        policy.lm_head.bias.zero_()[eot] = 50.0
    examples = chat.render_conversations([conv([user("Hi")], [assistant("Yes")], [assistant("No")])], tok, 48, 24, silent=True)
    t = trainers.BasicTrainer(policy, config, str(tmp_path), tok, examples, examples, None)
    lengths = []
    real = policy.generate
    policy.generate = lambda **kw: lengths.append(real(**kw).shape[1] - kw["input_ids"].shape[1]) or real(**kw)
    rows = in_training.sample(t)
    assert rows[0]["policy"] == "<|eot_id|>" and lengths == [1]  # stopped at once, not after max_new_tokens
    t.stop_ids = [tok.eos_token_id]  # the old behaviour: EOS only, it runs to max_length
    lengths.clear()
    in_training.sample(t)
    assert lengths[0] > 1
    completions = torch.tensor([[5, eot, 7, 7], [5, 6, 7, 8]])
    assert sampling.completion_mask(completions, [tok.eos_token_id, eot]).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]


@pytest.mark.parametrize("loss", ["dpo", "sft"])
def test_tiny_run_on_conversations_with_smollm2_tokenizer(tmp_path, monkeypatch, loss):
    import train  # noqa: F401  (registers the plugins the run uses)

    path = str(needs_shared("tokenizers", "smollm2-135m-instruct"))
    topics = ["cats", "dogs", "fish", "owls", "bees", "cows", "ants", "elks"]

    def fake_load(names, split, options, sft_mode, silent=False):
        rows = []
        for i, topic in enumerate(topics):
            prompt = [user(f"Tell me about {topic}."), assistant("Sure."), user("Go on.")]
            rows.append(conv(prompt, [assistant(f"{topic} are nice.")], [assistant("No.")], row=f"{split} row {i + 1}"))
            if sft_mode:
                rows[-1].pop("rejected")
        return rows

    monkeypatch.setattr(splits, "load_examples", fake_load)
    run_dir = run_train(
        [
            f"model.tokenizer_name_or_path={path}",
            f"loss={loss}",
            "n_examples=16",
            "eval_every=8",
            "n_eval_examples=8",
            "sample_during_eval=true",
        ],
        tmp_path,
    )
    records = metric_records(run_dir)
    assert any("loss/eval" in r for r in records)
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["prompt"].endswith("<|im_start|>assistant\n") and s["prompt"].startswith(SYS) for s in samples)


def test_online_dpo_on_conversational_prompts_samples_after_the_rendered_prompt(tmp_path):
    """Online DPO end to end on a prompt-only parquet file of message prompts (datasets=[hf]): the
    policy samples after the template's generation prompt, and the reward model scores that."""
    import datasets
    from conftest import tiny_llama_scorer

    path = str(needs_shared("tokenizers", "smollm2-135m-instruct"))
    tok = AutoTokenizer.from_pretrained(path)
    scorer = tiny_llama_scorer(len(tok), tok.pad_token_id)
    scorer.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    rows = [{"prompt": [user(f"Name a colour, {i}.")]} for i in range(12)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "prompts.parquet"))
    run_dir = run_train(
        [
            f"model.tokenizer_name_or_path={path}",
            "datasets=[hf]",
            f"data.hf.path={tmp_path / 'prompts.parquet'}",
            "data.hf.holdout_fraction=0.5",
            "online.enabled=true",
            "online.max_new_tokens=4",
            "online.n_log_completions=2",
            f"reward_model.name_or_path={tmp_path / 'rm'}",
            "n_examples=8",
            "eval_every=8",
            "eval_batch_size=2",
            "n_eval_examples=2",
            "batch_size=4",
        ],
        tmp_path / "out",
    )
    table = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert table and all(r["prompt"].startswith(SYS) and r["prompt"].endswith("<|im_start|>assistant\n") for r in table)
    assert any("objective/kl" in r for r in metric_records(run_dir))


def test_a_token_cut_prompt_keeps_a_sequence_bos_but_not_a_turn_marker():
    # Regression (fresh-user trial): SmolLM2's BOS is <|im_start|>, which its template writes at
    # every turn; a keep_end cut kept it in front, so cut prompts began "<|im_start|> trained by
    # Hugging Face<|im_end|>..." (a turn marker with no role). Only a BOS the template writes once,
    # to start the sequence (Llama 3's), is kept in front of the cut.
    long = "word " * 60
    for tok, kept in ((smollm2(), False), (llama3_tokenizer(), True)):
        ex = conv([user(long)], [assistant("Yes.")], [assistant("No.")])
        (rendered,) = chat.render_conversations([ex], tok, 64, 32, silent=True, split="train", all_assistant_turns=False)
        el = element(tok, rendered, max_length=64, max_prompt_length=32)
        whole = pd._encode(tok, rendered["prompt"], True)
        assert len(whole) > 32 and len(el["prompt_input_ids"]) == 32
        if kept:
            assert el["prompt_input_ids"] == [tok.bos_token_id] + whole[-31:]
        else:
            assert el["prompt_input_ids"] == whole[-32:]
        assert el["chosen_input_ids"][:32] == el["prompt_input_ids"]


@pytest.mark.parametrize(
    "template, problem",
    [
        (
            "{% include 'base.jinja' %}",
            "loads another template ({% include %}, line 1), which a chat template cannot: transformers renders it "
            "alone, with no files; paste that template's text in its place.",
        ),
        (
            "{{ bos_token }}\n{% from 'macros.jinja' import turn %}",
            "loads another template ({% from ... import %}, line 2), which a chat template cannot: transformers renders it "
            "alone, with no files; paste that template's text in its place.",
        ),
        (
            "{% for m in messages %}{{ m.content }}",
            "is not a valid Jinja template (line 1: Unexpected end of template. Jinja was looking for the following tags: "
            "'endfor' or 'else'. The innermost block that needs to be closed is 'for'); fix it or set model.chat_template "
            "to one that is.",
        ),
    ],
)
def test_a_chat_template_that_cannot_render_alone_is_one_sentence_at_load(tmp_path, template, problem):
    # Before: jinja2's TemplateNotFound at the first row, said as "the chat template rejects this conversation".
    path = tmp_path / "t.jinja"
    path.write_text(template)
    model = OmegaConf.merge(compose_config([]).model, {"chat_template": str(path)})
    with pytest.raises(utils.ConfigError) as e:
        models.load_tokenizer(model)
    assert str(e.value) == f"model.chat_template {problem}"
    folder = tmp_path / "tokenizer"  # a handed tokenizer folder's own template: named by its folder
    tok = models.load_tokenizer(compose_config([]).model)
    tok.chat_template = template
    tok.save_pretrained(folder)
    with pytest.raises(utils.ConfigError) as e:
        models.load_tokenizer(compose_config([f"model.tokenizer_name_or_path={folder}"]).model)
    assert str(e.value) == f"the chat template of {str(folder)!r} {problem}"


def test_model_tokenizer_class_names_a_tokenizer_class_only():
    with pytest.raises(utils.ConfigError) as e:
        models.load_tokenizer(compose_config(["model.tokenizer_class=AutoModel"]).model)
    assert str(e.value) == (
        "model.tokenizer_class=AutoModel is not a tokenizer class of transformers; give one that builds without files "
        "(e.g. ByT5Tokenizer), or a tokenizer folder as model.tokenizer_name_or_path."
    )
