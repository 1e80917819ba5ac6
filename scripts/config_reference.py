"""Write the configuration reference, docs/configuration.md, from config/config.yaml's trailing comments.

    python scripts/config_reference.py            # rewrites the table between the markers of docs/configuration.md
    python scripts/config_reference.py --check    # exit 1 when docs/configuration.md is not what this writes

Every leaf key of the default config (``python train.py`` with no overrides: config.yaml with
model=tiny and loss=dpo, composed by Hydra) and of config.yaml's ``hydra:`` block is one row:
its dotted name, its default (config.yaml's, or blank_model.yaml's for ``model.*``; ``; tiny: ``
and the value where the tiny preset sets another) and its meaning, the comment at the end of its
line in the yaml file, or else its nearest parent's. A key with neither stops the script, naming
it: add a trailing comment to its line. The text around the two markers is kept as written.
"""

import argparse
import re
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "config"
DOC = REPO / "docs" / "configuration.md"
BEGIN = "<!-- configuration reference: written by scripts/config_reference.py from config/*.yaml; edit the yaml comments, not this table -->"
END = "<!-- end of the configuration reference -->"
# Where the comments come from, searched in this order: each file with the prefix of its keys.
SOURCES = [
    (CONFIG / "config.yaml", ""),
    (CONFIG / "model" / "blank_model.yaml", "model."),
    (CONFIG / "loss" / "dpo.yaml", "loss."),
    (CONFIG / "reference_update" / "tr_dpo.yaml", "reference_update."),
]
KEY_LINE = re.compile(r"^(\s*)([A-Za-z_][\w-]*):(.*)$")


def read_lines(path: Path, prefix: str) -> tuple[dict[str, str], dict[str, str]]:
    """Dotted key -> the comment at the end of its line (``# ...``), and -> its value as written there."""
    comments, written, stack = {}, {}, []  # stack: (indent, key) of the enclosing mappings
    for line in path.read_text().splitlines():
        match = KEY_LINE.match(line)
        if not match:  # a comment line, a list item (the defaults list), a blank line
            continue
        indent, key, rest = len(match.group(1)), match.group(2), match.group(3)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        dotted = prefix + ".".join([k for _, k in stack] + [key])
        value, comment = re.match(r"^(.*?)(?:\s#\s?(.*))?$", rest).groups()  # values here hold no ' #'
        if comment and comment.strip():
            comments[dotted] = comment.strip()
        if value.strip() and not value.strip().startswith("{"):  # a flow mapping's keys are its leaves
            written[dotted] = "??? (required)" if value.strip() == "???" else value.strip()
        stack.append((indent, key))
    return comments, written


def leaves(node, prefix: str = "") -> dict:
    """Dotted key -> value for every leaf (a scalar or a list) of a nested dict, in order."""
    if not isinstance(node, dict):
        return {prefix: node}
    out = {}
    for key, value in node.items():
        out.update(leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def text(value) -> str:
    """A default as the yaml file writes it: null, true, 5e-7, [arithmetic]."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return re.sub(r"e([+-])0*(\d)", lambda m: "e" + m.group(1).replace("+", "") + m.group(2), repr(value))
    if isinstance(value, list):
        return "[" + ", ".join(text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {text(v)}" for k, v in value.items()) + "}"
    return "??? (required)" if value == "???" else str(value)


def load(path: Path) -> dict:
    """A yaml file's keys (without Hydra's defaults list), unresolved."""
    node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    node.pop("defaults", None)
    return node


def reference() -> str:
    """The table: one row per leaf key, ``| `key` | default | meaning |``."""
    with initialize_config_dir(config_dir=str(CONFIG), version_base="1.3"):
        composed = OmegaConf.to_container(compose(config_name="config", overrides=[]), resolve=False)
    base = load(CONFIG / "config.yaml")
    hydra = {"hydra": base.pop("hydra")}
    base["model"] = {**base.get("model", {}), **load(CONFIG / "model" / "blank_model.yaml")}
    base["loss"] = load(CONFIG / "loss" / "dpo.yaml")
    base, tiny = leaves(base), leaves(load(CONFIG / "model" / "tiny.yaml"))
    comments, written = {}, {}
    for path, prefix in SOURCES:
        for key, comment in read_lines(path, prefix)[0].items():
            comments.setdefault(key, comment)
        written.update({key: value for key, value in read_lines(path, prefix)[1].items() if key in base})
    tiny_written = read_lines(CONFIG / "model" / "tiny.yaml", "")[1]
    rows, missing = [], []
    for key, value in {**leaves(composed), **leaves(hydra)}.items():
        parts = key.split(".")
        meaning = next((comments[".".join(parts[:n])] for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in comments), None)
        if meaning is None:
            missing.append(key)
            continue
        default = written.get(key, text(base[key])) if key in base else None
        if key in tiny:
            theirs = tiny_written.get(key, text(tiny[key]))
            default = f"{default}; tiny: {theirs}" if default is not None else f"tiny: {theirs}"
        meaning = meaning.replace("|", "\\|")  # a '|' would end the table cell
        rows.append(f"| `{key}` | {default if default is not None else text(value)} | {meaning} |")
    if missing:
        sys.exit(
            "These config keys have no comment, nor has any key above them: "
            + ", ".join(missing)
            + ". Add a trailing comment (# what it means) to each one's line in config/, then run python scripts/config_reference.py."
        )
    return "\n".join(["| key | default | meaning |", "|---|---|---|", *rows])


def document() -> str:
    """docs/configuration.md with its table written anew, the text around the markers kept."""
    current = DOC.read_text()
    if BEGIN not in current or END not in current:
        sys.exit(f"{DOC} has lost its markers; put these two lines back where the table goes:\n{BEGIN}\n{END}")
    head, rest = current.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    return f"{head}{BEGIN}\n{reference()}\n{END}{tail}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1, writing nothing, when docs/configuration.md is not current")
    args = parser.parse_args()
    new = document()
    if args.check:
        sys.exit(0 if new == DOC.read_text() else f"{DOC} is not current: run python scripts/config_reference.py")
    DOC.write_text(new)
    print(f"Wrote {DOC.relative_to(REPO)}")


if __name__ == "__main__":
    main()
