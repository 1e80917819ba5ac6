"""Conversations through the tokenizer's chat template: rendered text, the trained assistant spans, one DataError
naming the row when a template cannot render it (docs/chat.md)."""

from __future__ import annotations

from data.conversations import STANDARD_ROLES, Messages, unknown_role
from data.report import _share
from preference_datasets import _encode
from utils import DataError

_PROBE = "Probe1234"  # an assistant's content, to find what a chat template writes after it


def end_of_turn_token(tokenizer) -> str | None:
    """The special token the chat template writes right after an assistant's content (e.g. ``<|im_end|>``), or None."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    import jinja2

    for head in ([], [{"role": "system", "content": "S"}]):
        messages = [*head, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}]
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False)
        except (jinja2.TemplateError, ValueError, TypeError):
            continue
        k = text.find(_PROBE)
        if k < 0:
            continue
        after = _encode(tokenizer, text[k + len(_PROBE) :].lstrip(" \t\n"), rendered=True)
        special = set(tokenizer.all_special_ids) | {
            i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special
        }
        return tokenizer.convert_ids_to_tokens(after[0]) if after and after[0] in special else None
    return None


def stop_token_ids(tokenizer) -> list[int]:
    """The ids at which generation stops: EOS, and the chat template's end-of-turn token when it differs."""
    ids = [tokenizer.eos_token_id]
    eot = end_of_turn_token(tokenizer)
    if eot is not None and tokenizer.convert_tokens_to_ids(eot) not in ids:
        ids.append(tokenizer.convert_tokens_to_ids(eot))
    return ids


def _render(tokenizer, messages: list[dict], row: str, generation_prompt: bool = False) -> str:
    """``messages`` rendered by the chat template as text, else a DataError naming ``row`` with the template's message."""
    import jinja2

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except jinja2.TemplateError as e:
        roles = [m.get("role") for m in messages]
        raise DataError(
            f"{row}: the chat template rejects this conversation (roles {roles}): {e}; fix the roles or set model.chat_template."
        ) from e


def _check_tool_turns(tokenizer, conversations: list[Messages], row: str) -> None:
    """Check that the chat template renders every ``tool`` message of ``conversations`` with its content."""
    import jinja2

    for messages in conversations:
        contents = [m["content"].strip() for m in messages if m["role"] == "tool"]
        if not contents:
            continue
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False)
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            reason = f"it raises: {e}"
        else:
            if all(content in text for content in contents):
                continue
            reason = "its rendering leaves the tool message's content out"
        name = tokenizer.name_or_path or type(tokenizer).__name__
        raise DataError(
            f"{row} holds a 'tool' message, which the chat template of {name!r} cannot render ({reason}); set "
            "model.chat_template to a template that renders tool messages, or leave such rows out."
        )


def drop_earliest_turn(messages: list[dict]) -> list[dict] | None:
    """``messages`` without their earliest user turn (a leading system message kept); None when one user turn is left."""
    head = messages[:1] if messages and messages[0].get("role") == "system" else []
    rest = messages[len(head) :]
    later = [j for j, m in enumerate(rest) if j > 0 and m.get("role") == "user"]
    return head + rest[later[0] :] if later else None


def _assistant_spans(tokenizer, messages, indices, text, end_text, has_eot, row) -> list[tuple[int, int]] | None:
    """Character spans of ``text`` holding the assistant turns ``indices``; None when the template breaks the prefix property."""
    spans = []
    for k in indices:
        head = _render(tokenizer, messages[:k], row, generation_prompt=True)
        if not text.startswith(head):
            return None
        if has_eot:
            end = text.find(end_text, len(head))
            if end < 0:
                return None
            end += len(end_text)
        else:
            upto = _render(tokenizer, messages[: k + 1], row)
            if not text.startswith(upto):
                return None
            end = len(upto)
        spans.append((len(head), end))
    return spans


def _split(text: str, spans: list[tuple[int, int]], offset: int = 0) -> list[list]:
    """``text`` cut into [[piece, trained], ...] pieces, trained inside ``spans`` (shifted by ``offset``)."""
    pieces, at = [], 0
    for a, b in spans:
        a, b = max(a - offset, at), min(b - offset, len(text))
        if a >= b:
            continue
        pieces += [[text[at:a], False], [text[a:b], True]]
        at = b
    pieces.append([text[at:], False])
    return [p for p in pieces if p[0]]


def _check_messages(messages, row: str, what: str, last_assistant: bool) -> None:
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise DataError(f"{row}: the {what} is not a non-empty list of {{role, content}} messages.")
    for k, m in enumerate(messages, 1):
        if m["role"] not in STANDARD_ROLES:
            hint = "map it to one of them where the data is read (datasets=[hf]: data.hf.roles)"
            raise unknown_role(m["role"], row, f"message {k} of the {what}", hint)
    if last_assistant and messages[-1]["role"] != "assistant":
        raise DataError(
            f"{row}: the {what} ends with a {messages[-1]['role']!r} message; a response must end with the assistant's message."
        )


def _render_example(ex: dict, prompt: list[dict], tokenizer, eot: str | None, all_turns: bool, row: str) -> tuple[dict, bool]:
    """One conversational example rendered (:func:`render_conversations`), and whether the template broke the prefix."""
    sides = [s for s in ("chosen", "rejected") if ex.get(s) is not None]
    end_text = eot or tokenizer.eos_token
    p = _render(tokenizer, prompt, row, generation_prompt=True)
    new = {k: v for k, v in ex.items() if k not in ("conversation", "prompt", *sides)}
    new.update(prompt=p, end_token_id=tokenizer.convert_tokens_to_ids(end_text), messages=prompt)
    pieces: dict[str, list] = {}
    broke = False
    if all_turns:
        spans = _assistant_spans(
            tokenizer, prompt, [k for k, m in enumerate(prompt) if m["role"] == "assistant"], p, end_text, eot, row
        )
        broke |= spans is None
        if spans:
            pieces["prompt"] = _split(p, spans)
    for side in sides:
        messages = ex[side]
        whole = _render(tokenizer, prompt + messages, row)
        if whole.startswith(p):
            start = len(p)
        else:  # the response starts where the template puts the first response message's content
            broke = True
            probe = _render(tokenizer, prompt + [{**messages[0], "content": _PROBE}], row)
            start = probe.find(_PROBE)
            if start < 0 or not whole.startswith(probe[:start]):
                raise DataError(
                    f"{row}: the chat template renders the {side} conversation so that its response cannot be told apart "
                    "from the prompt (the earlier turns render differently); set model.chat_template to a template that does not."
                )
        rest = whole[start:]
        k = rest.rfind(end_text) if eot else -1
        body = rest[: k + len(end_text)] if k >= 0 else rest  # what follows the end of turn is not trained
        response = body if k >= 0 else body + end_text  # no end-of-turn token: EOS ends it
        new[side] = response
        if len(messages) > 1 and start == len(p):  # a multi-turn response: only its assistant turns are trained
            indices = [len(prompt) + j for j, m in enumerate(messages) if m["role"] == "assistant"]
            spans = _assistant_spans(tokenizer, prompt + messages, indices, whole, end_text, eot, row)
            broke |= spans is None
            if spans:
                pieces[side] = _split(body, spans, offset=start) + ([] if response == body else [[end_text, True]])
    if pieces:
        new["pieces"] = pieces
    return new, broke


def _check_conversation(ex: dict, row: str, tokenizer) -> bool:
    """Check one conversational example's messages and tool turns; True if an assistant message in it is empty."""
    _check_messages(ex["prompt"], row, "prompt", last_assistant=False)
    sides = [ex[side] for side in ("chosen", "rejected") if ex.get(side) is not None]
    for side in ("chosen", "rejected"):
        if ex.get(side) is not None:
            _check_messages(ex[side], row, f"{side} response", last_assistant=True)
    _check_tool_turns(tokenizer, [ex["prompt"] + messages for messages in sides] or [ex["prompt"]], row)
    return any(m["role"] == "assistant" and not str(m.get("content", "")).strip() for m in sum(sides, ex["prompt"]))


def _render_to_fit(ex: dict, tokenizer, eot, all_assistant_turns: bool, row: str, max_length: int, max_prompt_length: int):
    """(rendered example, whether its rendering broke, turns dropped): the earliest turns of a prompt too long dropped."""
    prompt, dropped = ex["prompt"], 0
    while True:
        new, broke = _render_example(ex, prompt, tokenizer, eot, all_assistant_turns, row)
        n_prompt = len(_encode(tokenizer, new["prompt"], rendered=True))
        responses = [len(_encode(tokenizer, new[s], rendered=True)) for s in ("chosen", "rejected") if s in new]
        too_long = n_prompt > max_prompt_length and (not responses or n_prompt + max(responses) > max_length)
        shorter = drop_earliest_turn(prompt) if too_long else None
        if shorter is None:
            return new, broke, dropped
        prompt, dropped = shorter, dropped + 1


def _say_rendered(label: str, n: int, counts: dict, end: str, lengths: str) -> None:
    """Print how many of ``n`` conversations were rendered and cut, and the warnings ``counts`` call for."""
    print(
        f"[data] {label}: {n} conversations rendered with the chat template (end of turn {end!r}); "
        f"{counts['dropped']} prompts lost their earliest turns ({counts['turns']} turns in all) to fit {lengths}"
    )
    if counts["broke"]:
        print(
            f"[data] warning: {label}: the chat template renders {_share(counts['broke'], n)} conversations so that the whole "
            "does not start with the prompt's rendering (it changes earlier turns, e.g. drops a thinking part or adds a "
            "default system message in one rendering only); their responses are tokenized after the prompt as rendered "
            "for generation, so no label shifts."
        )
    if counts["empty"]:
        print(
            f"[data] warning: {label}: {_share(counts['empty'], n)} conversations hold an empty assistant message before "
            f"their last turn (the first: {counts['first_empty']}); each is kept as an empty turn (trained as one where it is "
            "part of a response): fix or drop those rows if that is not meant."
        )


def render_conversations(
    examples: list[dict],
    tokenizer,
    max_length: int,
    max_prompt_length: int,
    silent: bool = False,
    *,
    split: str = "train",
    all_assistant_turns: bool = False,
) -> list[dict]:
    """Render conversational examples by the chat template into texts with ``end_token_id``, ``messages`` and ``pieces``."""
    label = "eval" if split == "test" else split
    todo = [i for i, ex in enumerate(examples) if ex.get("conversation") and "images" not in ex]  # images: vision/
    if not todo:
        return examples
    rows = {i: examples[i].get("row") or f"{label} example {i + 1}" for i in todo}
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"{rows[todo[0]]} is a conversation but the tokenizer {tokenizer.name_or_path or type(tokenizer).__name__!r} "
            "has no chat template; set one with model.chat_template=<file or Jinja string>."
        )
    eot = end_of_turn_token(tokenizer)
    out = list(examples)
    counts = {"broke": 0, "dropped": 0, "turns": 0, "empty": 0, "first_empty": None}
    for i in todo:
        if _check_conversation(examples[i], rows[i], tokenizer):
            counts["empty"] += 1
            counts["first_empty"] = counts["first_empty"] or rows[i]
        out[i], broke, dropped = _render_to_fit(
            examples[i], tokenizer, eot, all_assistant_turns, rows[i], max_length, max_prompt_length
        )
        counts["broke"] += broke
        counts["dropped"] += dropped > 0
        counts["turns"] += dropped
    if not silent:
        lengths = f"max_length={max_length} / max_prompt_length={max_prompt_length}"
        _say_rendered(label, len(todo), counts, eot or tokenizer.eos_token, lengths)
    return out
