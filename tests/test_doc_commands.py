"""Every shell command of README.md and docs/*.md, and every command the project prints, runs as written up to just
before its first training step: composed as Hydra composes it, checked (checks.validate_config), its data loaded,
rendered and screened for length, and its eval set sized (splits.load_splits), in-process.

A command that names something this machine has not got runs with a stand-in (:data:`STANDINS`, each with its reason);
a command that cannot run here is in :data:`SKIPS` with its reason. A command in neither fails this test."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import sys
from pathlib import Path

import pytest
from conftest import REPO, SHARED, compose_config, tiny_llama_scorer
from hydra import compose, initialize_config_dir
from PIL import Image

import preference_datasets
from data import splits
from evaluation import reward_functions
from modeling import models
from online import make_pairs
from runs import checks, launch, setup

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# (a word's pattern, its stand-in, why): the run folders a command names come from one tiny run of this module;
# models and data this machine has not got are the ../shared ones of the same kind; a model's weights are not read
# before the first step, so a tokenizer folder stands in for a chat model.
STANDINS = [
    (r"outputs/<sft run>|/shared/runs/<sft run>|<sft run>|outputs/\w+_<timestamp>|<an SFT run>|outputs/<run>|<run folder>"
     r"|<the two folders above>", "{run}", "an earlier run or evaluation (a VAR=$(ls -d ...) too): this module's tiny run"),
    (r"<reward model folder>", "{run}/LATEST/hf", "a reward model folder (only its config.json is read before the first step)"),
    (r"/tmp/smollm2|<your chat model folder or hub id>|<your chat model>", "{chat_model}",
     "SmolLM2 (get-smollm2.sh builds it, 540 MB) or your chat model: its tokenizer and a config.json (no weights are read)"),
    (r"/abs/pairs\.jsonl|(?<![/\w])pairs\.jsonl", "{files}/pairs.jsonl", "make_pairs.py's file (written by its own command)"),
    (r"(?<![/\w])(my_chat\.parquet|prefs\.json|ranking\.json|ranked\.jsonl|factory\.jsonl|rm_train\.jsonl|rm_test\.jsonl)",
     "{files}/\\1", "a small file of the layout the page shows"),
    (r"(?<![/\w])mydata/prefs\.jsonl", "{files}/mydata/prefs.jsonl", "an image preference file (TRL's layout) and its images"),
    (r"\.\./shared", "{shared}", "the shared folder beside the repository"),
    (r"/shared/runs", "{tmp}/runs", "a cluster's output folder"),
    (r"<more>", "96", "a longer length"),
    (r"<[^<>]*\|[^<>]*>", "{choice}", "the first of the choices, e.g. <chosen | reference | policy>: chosen"),
]  # fmt: skip

# hub models and data that load with a ../shared stand-in appended (the hub is not reachable here)
HUB = {
    "model=pythia28": ["model.tokenizer_name_or_path={shared}/tokenizers/gpt-neox-20b"],
    "model=pythia69": ["model.tokenizer_name_or_path={shared}/tokenizers/gpt-neox-20b"],
    "datasets=[hh]": [
        "data.hh.local_dir={shared}/data/hh-rlhf",
        "data.hh.subsets=[harmless-base]",
        "data.hh.holdout_fraction=0.1",
    ],
}

# (the start of a command, why it is not run here)
SKIPS = [
    ("pip install", "installs packages"),
    ("python -m pytest", "the test suite itself"),
    ("python scripts/frontier.py", "trains 27 runs (44 min on busy cores); tests/test_frontier.py runs it small"),
    ("python bench/", "reads a finished sweep's folders (tests/test_compare_objectives.py)"),
    ("scripts/run_node", "torchrun over GPUs (tests/test_launch_scripts.py runs it on CPU)"),
    ("scripts/ray_job.sh", "submits to a Ray cluster (tests/test_launch_scripts.py checks its command line)"),
    ("sbatch", "SLURM (tests/test_launch_scripts.py runs the batch script under a stand-in srun)"),
    ("ray ", "starts or submits to a Ray cluster"),
    ("torchrun", "GPUs"),
    ("hf upload", "the Hugging Face Hub"),
    ("python - outputs/*/eval", "reads finished evaluations' folders"),
    (
        "python train.py model=blank_model model.name_or_path=<an image-text-to-text",
        "an image-text-to-text model and an image preference file of the user's (tests/test_vision_step.py: model=tiny_vlm)",
    ),
]

# pages' commands run as written except these, each a hub source only (a stand-in would test nothing of the command)
HUB_ONLY = {
    "data.hf.path=HuggingFaceH4/ultrafeedback_binarized": "a hub dataset; no hub here",
    "model.name_or_path=HuggingFaceTB/SmolVLM-256M-Instruct": "a hub image-text-to-text model; no hub here",
}


def fenced_bash(page: Path) -> list[tuple[int, str]]:
    """(line number, text) of each ```bash block of ``page``."""
    text = page.read_text()
    return [
        (text[: m.start()].count("\n") + 2, m.group(1))
        for m in re.finditer(r"^ *```(?:bash|sh)\n(.*?)^ *```", text, flags=re.S | re.M)
    ]


def shell_commands(block: str) -> list[tuple[str, str | None]]:
    """(command line, here-document or None) of each command of a shell block: continuation lines joined, ``a && b``
    two commands, a ``for`` loop its body once with the first value."""
    lines = block.replace("\\\n", " ").splitlines()
    out, i = [], 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if not line or line.startswith("#"):
            continue
        loop = re.match(r"for (\w+) in (\S+)[^;]*; do\b", line)
        if loop:  # for s in 1 2 3 4; do <body>; done
            line, i = lines[i].strip().replace(f"${loop.group(1)}", loop.group(2)), i + 1
            line = re.sub(r";\s*done\b", "", line)
        if " && " in line:
            out.extend((part.strip(), None) for part in line.split(" && "))
            continue
        heredoc = re.search(r"<<'?(\w+)'?", line)
        body = None
        if heredoc:
            end = lines.index(heredoc.group(1), i)
            body, i = "\n".join(lines[i:end]) + "\n", end + 1
            line = line[: heredoc.start()] + line[heredoc.end() :]
        out.append((line, body))
    return out


def page_commands() -> list[tuple[str, str, str | None]]:
    """(id, command line, here-document) of every command of README.md and docs/*.md, ``$VAR`` expanded."""
    env: dict[str, str] = {}  # README's $S260 and $HH hold on the pages that use them without defining them
    out = []
    for page in PAGES:
        for line_no, block in fenced_bash(page):
            for line, body in shell_commands(block):
                assign = re.fullmatch(r'([A-Z][A-Z0-9_]*)=("[^"]*"|\$\([^)]*\)[^\s]*|\S+)\s*(#.*)?', line)
                if assign:  # VAR="..." or VAR=$(ls ...)
                    value = assign.group(2)
                    value = value[1:-1] if value.startswith('"') else value
                    value = re.sub(r"\$\([^)]*\)", "<run folder>", value)  # SFT=$(ls -d outputs/hh_sft_* | tail -1)
                    env[assign.group(1)] = re.sub(r"\$([A-Z][A-Z0-9_]*)\b", lambda m: env.get(m.group(1), m.group(0)), value)
                    continue
                line = re.sub(r"\$\([^)]*\)", "<run folder>", line)  # policy=$(ls -d outputs/dpo_nll1_* | tail -1)
                expanded = re.sub(r"\$([A-Z][A-Z0-9_]*)\b", lambda m: env.get(m.group(1), m.group(0)), line)
                out.append((f"{page.relative_to(REPO)}:{line_no}: {line[:60]}", expanded, body))
    return out


COMMANDS = page_commands()


def shell_words(line: str) -> list[str]:
    """The words the shell gives ``line``, ``...`` (the pages' "and the rest") left out."""
    return [w for w in shlex.split(line, comments=True) if w != "..."]


def skip_reason(line: str) -> str | None:
    words = shell_words(line)
    line = " ".join(w for w in words if not re.match(r"^[A-Z_]+=", w))  # MASTER_ADDR=node0 scripts/...
    for start, why in SKIPS:
        if line.startswith(start):
            return why
    for word, why in HUB_ONLY.items():
        if word in words:
            return why
    return None


def stand_in(word: str, places: dict) -> str:
    """``word`` with each :data:`STANDINS` pattern replaced."""

    def first(m: re.Match) -> str:  # <run folder | checkpoint> -> <run folder>, <chosen | reference> -> chosen
        choice = m.group(0)[1:-1].split("|")[0].strip()
        return f"<{choice}>" if " " in choice else choice

    rows = sorted(STANDINS, key=lambda row: row[1] != "{choice}")  # the choices first: their first may be a placeholder
    for pattern, replacement, _ in rows:
        word = re.sub(pattern, first if replacement == "{choice}" else replacement.format(**places), word)
    return word


# ----------------------------------------------------------------------------- the stand-ins


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def small_files(folder: Path) -> None:
    """Twenty rows of each layout the pages show (docs/chat.md's own example rows, numbered)."""
    import datasets

    n = range(20)
    datasets.Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": f"What is {i}+1?"}],
                "chosen": [{"role": "assistant", "content": f"{i + 1}"}],
                "rejected": [{"role": "assistant", "content": f"{i}"}],
            }
            for i in n
        ]
    ).to_parquet(str(folder / "my_chat.parquet"))
    (folder / "prefs.json").write_text(
        json.dumps(
            [
                {"instruction": f"And in French? ({i})", "input": "", "chosen": "Bonjour", "rejected": "Hola",
                 "history": [["Say hello in Spanish.", "Hola"]], "system": "Be brief."}
                for i in n
            ]
        )
    )  # fmt: skip
    (folder / "ranking.json").write_text(
        json.dumps(
            [
                {"instruction": f"Why? ({i})", "input": "Answer briefly.", "output": ["Because it is.", "No idea."],
                 "history": [["Is the sky blue?", "Yes."]]}
                for i in n
            ]
        )
    )  # fmt: skip
    write_jsonl(
        folder / "ranked.jsonl", [{"prompt": f"Capital of France? ({i})", "responses": ["Paris.", "Lyon.", "Rome."]} for i in n]
    )
    write_jsonl(
        folder / "factory.jsonl",
        [
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}, {"from": "human", "value": f"2+{i}?"}],
             "chosen": {"from": "gpt", "value": f"{2 + i}"}, "rejected": {"from": "gpt", "value": "5"}, "system": "Answer briefly."}
            for i in n
        ],
    )  # fmt: skip
    image_rows = []  # docs/vision.md's TRL row: a prompt with an image part, its image by a path relative to the file
    (folder / "mydata" / "img").mkdir(parents=True)
    for i in n:
        red = i % 2 == 0
        Image.new("RGB", (16, 16), (200, 30, 30) if red else (30, 30, 200)).save(folder / "mydata" / "img" / f"{i}.png")
        image_rows.append(
            {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Colour? ({i})"}]}],
             "images": [f"img/{i}.png"], "chosen": [{"role": "assistant", "content": "Red." if red else "Blue."}],
             "rejected": "Blue." if red else "Red."}
        )  # fmt: skip
    write_jsonl(folder / "mydata" / "prefs.jsonl", image_rows)
    pairs = [{"prompt": f"Q: {i}+1=\nA:", "chosen": f" {i + 1}", "rejected": f" {i}"} for i in n]
    write_jsonl(folder / "rm_train.jsonl", pairs[:16])
    write_jsonl(folder / "rm_test.jsonl", pairs[16:])


@pytest.fixture(scope="module")
def places(tmp_path_factory, zoo):
    """Where the stand-ins are: ``run`` (a finished tiny run), ``files`` (small data files), ``shared``, ``tmp``."""
    if not SHARED.exists():
        pytest.skip(f"{SHARED} is absent (the ../shared folder beside the repository)")
    tmp = tmp_path_factory.mktemp("doc_commands")
    files = tmp / "files"
    files.mkdir()
    small_files(files)
    run = zoo("default")
    chat_model = tmp / "chat_model"  # a chat tokenizer and a tiny model config: nothing reads weights before the first step
    chat_model.mkdir()
    for name in ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json"):
        os.symlink(SHARED / "tokenizers" / "smollm2-135m-instruct" / name, chat_model / name)
    tiny_llama_scorer(49152, 0).config.save_pretrained(chat_model)
    found = {"run": str(run), "files": str(files), "shared": str(SHARED), "tmp": str(tmp), "chat_model": str(chat_model)}
    # make_pairs.py's own README command on that run writes the pairs.jsonl the README then trains on
    pairs_command = next(line for _, line, _ in COMMANDS if line.startswith("python make_pairs.py"))
    # reward_functions=[length]: a run of a few seconds answers no sum right, so arithmetic would tie every completion;
    # max_pairs_per_prompt=1: one pair a prompt, as few as a policy that answers most sums right gives
    line = stand_in(pairs_command, found).replace("reward_functions=[arithmetic]", "reward_functions=[length]")
    overrides = [*shell_words(line)[2:], "max_pairs_per_prompt=1"]
    found["train_on_them"] = run_make_pairs(overrides)
    return found


def run_make_pairs(overrides: list[str]) -> str:
    """Run make_pairs.py with ``overrides`` (in-process); returns its printed "Train on them:" command."""
    with initialize_config_dir(config_dir=str(REPO / "config"), version_base="1.3"):
        config = compose(config_name="make_pairs", overrides=[*overrides, "num_threads=1"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        make_pairs.main(config)
    return next(line for line in out.getvalue().splitlines() if line.startswith("Train on them: ")).removeprefix(
        "Train on them: "
    )


# ----------------------------------------------------------------------------- running a command to its first step


def dry_train(overrides: list[str], places: dict, world_size: int | None = None) -> None:
    """``python train.py <overrides>`` up to its first training step: the command-line check, composition, the config
    rules, then (first job of a sweep) the data loaded, rendered, screened and the eval set sized; each stage of
    ``sft_first`` the same way, from the commands launch.stage_commands gives."""
    problem = checks.command_line_error(overrides)
    assert problem is None, problem
    multirun = [o for o in overrides if o in ("-m", "--multirun")]
    overrides = [o for o in overrides if o not in multirun and not re.match(r"^(hydra[./]|\+?hydra)", o)]
    for word, extra in HUB.items():
        if word in overrides and not any(o.startswith(extra[0].split("=")[0]) for o in overrides):
            overrides += [e.format(**places) for e in extra]
    if multirun:  # every job passed command_line_error's sweep check; the first is loaded
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parsed = OverridesParser.create().parse_overrides(overrides)
        overrides = BasicSweeper.split_arguments(parsed, None)[0][0]
    config = compose_config([*overrides, f"output_root={places['tmp']}/outputs"])
    given = checks.given_keys(overrides)
    checks.settle_given(config, given)
    if launch.sft_stage_wanted(config, given):
        sft, second = launch.stage_commands(config, overrides)
        dry_train(sft, places)
        dry_train([*second, f"model.archive={places['run']}/LATEST/policy.pt"], places)
        return
    budget = setup.budget_given(config, given)
    if config.resume not in (None, "auto"):
        assert setup.resume_override_error(config, given) is None
    config = setup.effective_config(config, budget)
    world = world_size or (config.world_size or 2 if config.trainer != "BasicTrainer" else 1)
    checks.validate_config(config, world)
    if config.launcher == "ray":
        checks.validate_ray(config)
    declared = preference_datasets.declared_reward_functions(config.datasets)
    answer_functions = reward_functions.eval_functions(config.eval_reward_functions, declared)
    tokenizer = models.load_tokenizer(config.model)
    train_examples, eval_examples = splits.load_splits(config, tokenizer, 0, answer_functions)
    assert train_examples and eval_examples


def dry_evaluate(overrides: list[str], places: dict) -> None:
    """``python evaluate.py <overrides>`` up to its first sample: composed, checked, its policy and baseline resolved."""
    from evaluation import evaluate, sampling

    with initialize_config_dir(config_dir=str(REPO / "config"), version_base="1.3"):
        config = compose(config_name="evaluate", overrides=overrides)
    config = evaluate.effective_config(config)
    evaluate.check_config(config)
    policy = sampling.resolve_source(config.policy, config, "policy")
    if config.baseline not in ("chosen", "reference"):
        sampling.resolve_source(config.baseline, config, "baseline")
    evaluate.settle_datasets(config, policy, say=False)
    assert sampling.load_items(config, silent=True)


def dry_snippet(words: list[str], body: str, places: dict, cwd: Path) -> None:
    """``python - <args> <<'PY' ... PY``: the snippet run in-process with ``sys.argv`` its arguments, in ``cwd``."""
    argv, here = sys.argv, os.getcwd()
    sys.argv = ["-", *words[2:]]
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(body, "<snippet>", "exec"), {"__name__": "__main__"})
    finally:
        sys.argv = argv
        os.chdir(here)


def run_command(line: str, body: str | None, places: dict) -> None:
    """Run one page command up to its first step (:func:`dry_train`, :func:`dry_evaluate`, :func:`dry_snippet`)."""
    words = shell_words(stand_in(line, places))
    assert not [w for w in words if re.search(r"<[^>]*>|\$[A-Z]", w)], f"a placeholder without a stand-in: {words}"
    if words[:2] == ["python", "train.py"]:
        dry_train(words[2:], places)
    elif words[:2] == ["python", "evaluate.py"]:
        dry_evaluate(words[2:], places)
    elif words[:2] == ["python", "make_pairs.py"]:
        assert places["train_on_them"]  # ran in the fixture: its "Train on them" is tested on its own
    elif words[:2] == ["python", "-"] and body is not None:
        cwd = Path(places["tmp"]) / "cwd"  # a snippet that writes files writes them here; ../shared is beside it
        (cwd / "repo").mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.symlink(SHARED, cwd / "shared")
        for name in ("config",):
            with contextlib.suppress(FileExistsError):
                os.symlink(REPO / name, cwd / "repo" / name)
        dry_snippet(words, body, places, cwd / "repo")
    else:
        pytest.fail(f"no runner and no SKIPS row for {' '.join(words)}; add one")


@pytest.mark.parametrize("where, line, body", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_every_page_command_runs_to_its_first_step(where, line, body, places):
    why = skip_reason(line)
    if why is not None:
        pytest.skip(why)
    run_command(line, body, places)


def test_the_pages_have_the_commands_this_module_knows():
    # by hand: README.md's main job, its json/hf/online/make_pairs/evaluate commands, docs/data.md's snippet
    lines = [line for _, line, _ in COMMANDS]
    assert len(COMMANDS) >= 60
    for start in ("python train.py datasets=[json] data.json.path=/abs/pairs.jsonl", "python make_pairs.py policy=",
                  "python evaluate.py policy=", "python - model=blank_model", "python train.py online.enabled=true"):  # fmt: skip
        assert any(line.startswith(start) for line in lines), start


# ----------------------------------------------------------------------------- the commands the project prints


def test_make_pairs_train_on_them_runs_on_what_it_wrote(places):
    # Regression (issue 34): make_pairs' printed command, for its own defaults (n_prompts=64, k=4), on the tiny
    # default: a held-out tenth of 64 prompts is fewer pairs than model=tiny's eval_batch_size=64.
    words = shlex.split(places["train_on_them"])
    assert words[:3] == ["python", "train.py", "datasets=[json]"]
    archive = next(w.split("=", 1)[1] for w in words if w.startswith("model.archive="))
    assert os.path.isfile(archive) and os.path.realpath(archive).startswith(os.path.realpath(places["run"]))
    dry_train(words[2:], places)


def test_each_sft_first_stage_command_runs_to_its_first_step(places):
    # the default main job's two stages, as train.py prints them, and a README command on the tiny default
    for overrides in ([], ["loss.nll_weight=1.0"], ["datasets=[json]", f"data.json.path={places['files']}/pairs.jsonl"]):
        config = compose_config(overrides)
        given = checks.given_keys(overrides)
        checks.settle_given(config, given)
        assert launch.sft_stage_wanted(config, given)
        sft, second = launch.stage_commands(config, overrides)
        assert "loss=sft" in sft and "sft_first.n_examples=null" in second
        dry_train(sft, places)
        dry_train([*second, f"model.archive={places['run']}/LATEST/policy.pt"], places)


def test_the_resume_hint_runs_to_its_first_step(places, capsys):
    # "Resume with: python train.py resume=<run folder>" (trainers.stop_with_checkpoint) and its extension
    command = f"python train.py resume={places['run']}"
    dry_train(shlex.split(command)[2:], places)
    dry_train([*shlex.split(command)[2:], "n_examples=96"], places)
