"""docs/configuration.md is what scripts/config_reference.py writes, and lists every key of the default config."""

import re
import runpy
import subprocess
import sys

from conftest import REPO, compose_config
from omegaconf import OmegaConf

SCRIPT = REPO / "scripts" / "config_reference.py"
DOC = REPO / "docs" / "configuration.md"


def leaf_keys(node, prefix=""):
    """Dotted names of every leaf (a scalar or a list) of a nested dict."""
    if not isinstance(node, dict):
        return [prefix]
    return [k for key, value in node.items() for k in leaf_keys(value, f"{prefix}.{key}" if prefix else key)]


def table_keys() -> dict[str, tuple[str, str]]:
    """Key -> (default, meaning) of each row of the generated table."""
    rows = {}
    for line in DOC.read_text().splitlines():
        match = re.match(r"^\| `([^`]+)` \| (.*?) \| (.*) \|$", line)
        if match:
            rows[match.group(1)] = (match.group(2), match.group(3))
    return rows


def test_the_configuration_reference_is_current():
    new = runpy.run_path(str(SCRIPT))["document"]()
    assert new == DOC.read_text(), "docs/configuration.md is not current: run python scripts/config_reference.py"


def test_every_leaf_key_of_the_default_config_has_a_row_with_a_meaning():
    config = OmegaConf.to_container(compose_config([]), resolve=False)
    keys = leaf_keys(config)
    rows = table_keys()
    assert len(keys) > 100  # model.*, loss.*, data.*, ray.*, ... all there
    missing = [k for k in keys if k not in rows]
    assert not missing, f"not in docs/configuration.md: {missing}; run python scripts/config_reference.py"
    assert all(meaning.strip() for _, meaning in rows.values())


def test_defaults_are_config_yamls_and_the_tiny_presets():
    # Worked out from the yaml files by hand: config.yaml's lr is 5e-7, tiny.yaml's 3e-4; tiny sets no seed.
    rows = table_keys()
    assert rows["lr"][0] == "5e-7; tiny: 3e-4"
    assert rows["seed"][0] == "0"
    assert rows["model.name_or_path"][0] == "??? (required); tiny: null"
    assert rows["model.config.hidden_size"][0] == "tiny: 64"
    assert rows["data.hf.path"][0] == "null"
    assert rows["loss.beta"][0] == "0.1"
    # a key without a comment of its own shows its parent's
    assert rows["ray.reference_resources.GPU"][1] == "per reference actor"


def test_a_key_without_a_comment_stops_the_script_naming_it(tmp_path):
    config = tmp_path / "config"
    subprocess.run(["cp", "-r", str(REPO / "config"), str(config)], check=True)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "configuration.md").write_text(DOC.read_text())
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "config_reference.py").write_text(SCRIPT.read_text())
    with open(config / "config.yaml", "a") as f:
        f.write("my_new_key: 3\n")
    result = subprocess.run(
        [sys.executable, str(tmp_path / "scripts" / "config_reference.py")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    assert "have no comment" in result.stderr and "my_new_key" in result.stderr
    with open(config / "config.yaml", "a") as f:
        f.write("my_other_key: 4   # what it means\n")
    (config / "config.yaml").write_text((config / "config.yaml").read_text().replace("my_new_key: 3\n", ""))
    result = subprocess.run(
        [sys.executable, str(tmp_path / "scripts" / "config_reference.py")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "| `my_other_key` | 4 | what it means |" in (tmp_path / "docs" / "configuration.md").read_text()
