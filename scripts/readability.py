"""Print the code's measures (issue 26): core lines, the longest functions, utils.py's size and imports, and the code
one DPO step runs, traced on the tiny model (import circles: ``python ../shared/scripts/import-circles.py .``)."""

from __future__ import annotations

import ast
import contextlib
import glob
import io
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def core_files() -> list[str]:
    """The top-level .py files: the core modules."""
    return sorted(glob.glob(os.path.join(ROOT, "*.py")))


def functions(path: str) -> list[tuple[int, int, str]]:
    """(first line, last line, qualified name) of every function in ``path``."""
    out = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])  # as code objects count it
                out.append((first, child.end_lineno, prefix + child.name))
                walk(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")

    walk(ast.parse(open(path).read()), "")
    return out


def project_imports(path: str, names: set[str]) -> set[str]:
    """The project modules that ``path`` imports, at any depth."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module.split(".")[0])
    return (found & names) - {os.path.basename(path)[:-3]}


def dpo_step() -> dict[str, tuple[int, int]]:
    """``{file:function: (first, last line)}`` of the project code one DPO step runs on BasicTrainer's default path
    (the training loop, the step from the batch to ``optimizer.step()``), traced on the tiny model."""
    from hydra import compose, initialize_config_dir

    import train
    import trainers

    with initialize_config_dir(os.path.join(ROOT, "config"), version_base=None):
        config = compose("config", [
            "model=tiny", "sft_first.n_examples=null", "n_examples=8", "batch_size=4", "eval_batch_size=4",
            "eval_every=1000000", "n_eval_examples=4", "data.arithmetic.n_train=16", "data.arithmetic.n_test=4",
            "sample_during_eval=false", "eval_reward_functions=null", "save_hf_export=false",
            f"output_root={tempfile.mkdtemp()}", "progress_bar=false",
        ])  # fmt: skip
    spans = {(p, a): (a, b, name) for p in core_files() for a, b, name in functions(p)}
    seen: dict[str, tuple[int, int]] = {}
    state = {"depth": 0}

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_name == "train_step" and state["depth"] == 0:
            state["depth"] = 1
            caller, loop = frame.f_back, []
            while caller is not None:  # the loop that called the step: train() and what it calls on the way
                key = (caller.f_code.co_filename, caller.f_code.co_firstlineno)
                if key in spans:
                    a, b, name = spans[key]
                    loop.append((f"{os.path.basename(key[0])}:{name}", (a, b)))
                    if name == "BasicTrainer.train":
                        break
                caller = caller.f_back
            seen.update(reversed(loop))  # in call order: train() first
        if state["depth"] and event == "call":
            key = (code.co_filename, code.co_firstlineno)
            if key in spans:
                a, b, name = spans[key]
                seen[f"{os.path.basename(code.co_filename)}:{name}"] = (a, b)
        if event == "return" and code.co_name == "train_step" and state["depth"]:
            state["depth"] = 0
            sys.setprofile(None)

    real = trainers.BasicTrainer.train_step

    def traced(self, batch):
        sys.setprofile(profile)
        try:
            return real(self, batch)
        finally:
            sys.setprofile(None)

    trainers.BasicTrainer.train_step = traced
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # the traced run's own log
            train.main(config)
    finally:
        trainers.BasicTrainer.train_step = real
    return seen


def main() -> None:
    files = core_files()
    names = {os.path.basename(p)[:-3] for p in files}
    total = sum(len(open(p).read().splitlines()) for p in files)
    print(f"core modules (top-level .py): {len(files)} files, {total} lines")
    longest = sorted(((b - a + 1, os.path.basename(p), n) for p in files for a, b, n in functions(p)), reverse=True)
    over = [f for f in longest if f[0] > 80]
    print(f"functions over 80 lines: {len(over)}" + "".join(f"\n  {n} lines  {p}:{f}" for n, p, f in over))
    print(f"longest function: {longest[0][0]} lines ({longest[0][1]}:{longest[0][2]})")
    utils = os.path.join(ROOT, "utils.py")
    print(
        f"utils.py: {len(open(utils).read().splitlines())} lines, imports project modules: {sorted(project_imports(utils, names)) or 'none'}"
    )
    step = dpo_step()
    lines = sum(b - a + 1 for a, b in step.values())
    by_file = sorted({k.split(":")[0] for k in step})
    print(f"one DPO step (BasicTrainer, default path, the loop + batch to optimizer.step()): {len(step)} functions, "
          f"{lines} lines, {len(by_file)} files ({', '.join(by_file)})")  # fmt: skip
    for k, (a, b) in step.items():  # in the order first called
        print(f"  {b - a + 1:4d}  {k}")


if __name__ == "__main__":
    main()
