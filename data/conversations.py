"""Conversations: {role, content} messages checked and their roles mapped, pairs keyed by their prompt messages and
split at their common turns."""

from __future__ import annotations

import collections
import json

from data.readers import _json_kind
from data.report import DatasetDict, _append_pair, note_row
from utils import DataError

Messages = list[dict]  # a conversation: [{"role": str, "content": str}, ...]


def conversation_key(prompt_messages: Messages) -> str:
    """The DatasetDict key of a conversational prompt: its messages as JSON text (hashed and counted as a text prompt)."""
    return json.dumps(prompt_messages, ensure_ascii=False)


def add_conversation_pair(
    data: DatasetDict,
    prompt_messages: Messages,
    chosen_messages: Messages,
    rejected_messages: Messages,
    report: collections.Counter,
    row: str | None = None,
) -> bool:
    """Add one conversational pair (message lists ending with the assistant's) under :func:`conversation_key`; True if added."""
    key = conversation_key(prompt_messages)
    if not chosen_messages[-1]["content"].strip() or not rejected_messages[-1]["content"].strip():
        note_row(report, "skipped: empty response", key)
        return False
    if chosen_messages == rejected_messages:
        note_row(report, "skipped: identical responses", key)
        return False
    entry = data.setdefault(
        key, {"responses": [], "pairs": [], "sft_target": chosen_messages, "prompt_messages": prompt_messages}
    )
    _append_pair(entry, chosen_messages, rejected_messages, row)
    return True


STANDARD_ROLES = ("system", "user", "assistant", "tool")  # others are refused: templates (SmolLM2's) render any role as text

ROLES_EXAMPLE = "'data.hf.roles={human: user, gpt: assistant}'"


def check_roles_mapping(roles) -> dict[str, str]:
    """``data.hf.roles`` (your role -> one of :data:`STANDARD_ROLES`) as a dict, else a DataError."""
    if roles is None:
        return {}
    if not isinstance(roles, dict):  # e.g. bash split an unquoted {a: b, c: d} into two overrides
        raise DataError(
            f"data.hf.roles must be a mapping such as {{human: user, gpt: assistant}}, got {roles!r}; "
            f"quote the whole override in the shell: {ROLES_EXAMPLE}."
        )
    for name, role in roles.items():
        if role not in STANDARD_ROLES:
            raise DataError(
                f"data.hf.roles maps {name!r} to {role!r}, which is not one of {', '.join(STANDARD_ROLES)}; map each of "
                "your roles to one of them."
            )
    return {str(name): role for name, role in roles.items()}


def _role_and_content(m, roles: dict[str, str]) -> tuple:
    """A message's (role, content): ``role`` / ``content``, else ShareGPT's ``from`` / ``value``, the role mapped by ``roles``."""
    if not isinstance(m, dict):
        return None, None
    if m.get("role") is None and m.get("content") is None and ("from" in m or "value" in m):  # ShareGPT's keys
        role, content = m.get("from"), m.get("value")
    else:
        role, content = m.get("role"), m.get("content")
    return roles.get(role, role) if isinstance(role, str) else role, content


# role names other formats use (lower-cased) -> the standard role each usually means, for role_hint
LIKELY_ROLES = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant", "chatgpt": "assistant"}
LIKELY_ROLES |= {"function": "tool", "observation": "tool", "ipython": "tool", "function_call": "assistant"}


def role_hint(role: str, roles: dict[str, str]) -> str:
    """How to map the non-standard ``role`` with ``data.hf.roles`` (``roles``: the mapping given so far)."""
    target = LIKELY_ROLES.get(role.lower(), "<user, assistant, system or tool>")
    mapping = ", ".join(f"{name}: {standard}" for name, standard in {**roles, role: target}.items())
    return f"map it with 'data.hf.roles={{{mapping}}}'"


def unknown_role(role: str, where: str, what: str, hint: str) -> DataError:
    """The one sentence for a message of ``what`` (e.g. "message 2 of 'chosen'") in ``where`` whose role is not standard."""
    return DataError(f"{where}: {what} has role {role!r}, which is not one of {', '.join(STANDARD_ROLES)}; {hint}.")


def check_messages(value, where: str, column: str, roles: dict[str, str] | None = None, part=None) -> Messages:
    """``value`` (column ``column`` of row ``where``) as a non-empty list of standard ``{role, content}`` messages
    (ShareGPT's ``from`` / ``value`` read, roles renamed by ``roles``, other keys dropped); with ``part`` (``(part,
    message number) -> part``), a content may also be a list of parts, each checked by it (vision/formats.py)."""
    roles = roles or {}
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value:
        raise DataError(
            f"{where}: column {column!r} is not a list of messages ({_json_kind(value)}); give a list of {{role, content}}."
        )
    messages = []
    for k, m in enumerate(value, 1):
        role, content = _role_and_content(m, roles)
        if not isinstance(role, str) or not isinstance(content, (str, list) if part else str):
            shown = json.dumps(m, ensure_ascii=False, default=str)[:80]
            what = "no 'content' text or parts" if part else "'content'"
            raise DataError(
                f"{where}: message {k} of {column!r} has no string 'role' and {what} ({shown}); every message needs both."
            )
        if role not in STANDARD_ROLES:
            raise unknown_role(role, where, f"message {k} of {column!r}", role_hint(role, roles))
        messages.append({"role": role, "content": content if isinstance(content, str) else [part(x, k) for x in content]})
    return messages


def check_ends_with_assistant(messages: Messages, where: str, column: str) -> None:
    """Raises DataError (naming the row and column) if the last message of ``messages`` is not the assistant's."""
    if messages[-1]["role"] != "assistant":
        raise DataError(
            f"{where}: the last message of {column!r} is the {messages[-1]['role']}'s, not the assistant's; "
            "a response must end with the assistant's turn."
        )


def split_conversations(chosen: Messages, rejected: Messages) -> tuple[Messages, Messages, Messages] | None:
    """Split two conversations after their longest common messages before an assistant turn, or None."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    for k in range(min(n, len(chosen) - 1, len(rejected) - 1), 0, -1):
        if chosen[k]["role"] == "assistant" and rejected[k]["role"] == "assistant":
            return chosen[:k], chosen[k:], rejected[k:]
    return None


def check_sharegpt_roles(row: dict, columns: dict[str, str], where: str, roles: dict[str, str]) -> None:
    """Check that ``roles`` maps every non-standard role of a ShareGPT row, else a DataError naming them all."""
    unknown = []
    for column in (columns["prompt"], columns["chosen"], columns["rejected"]):
        value = row.get(column)
        for m in [value] if isinstance(value, dict) else value if isinstance(value, list) else []:
            role = _role_and_content(m, roles)[0]
            if isinstance(role, str) and role not in STANDARD_ROLES and role not in unknown:
                unknown.append(role)
    if unknown:
        mapping = roles | {role: LIKELY_ROLES.get(role.lower(), "<user, assistant, system or tool>") for role in unknown}
        raise DataError(
            f"{where}: the ShareGPT messages have role(s) {', '.join(map(repr, unknown))}, not one of "
            f"{', '.join(STANDARD_ROLES)}; map them with 'data.hf.roles={{{', '.join(f'{k}: {v}' for k, v in mapping.items())}}}'."
        )
