"""A command against a run or evaluation folder's saved config.yaml: which keys differ, and which values (code, secrets,
addresses) a folder alone may not hand to a resumed job."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from runs.config_text import flat_config, override_text, shell_line

RUN_FOLDER_KEYS = ("resume", "output_root", "ray.storage_path", "ray.name")
"""Keys that name where a run is, not what it trains: left out when a new command is compared
with a run's saved config (:func:`config_differences`)."""


HANDED_KEYS = ("judge.base_url", "judge.api_key_env", "ray.address", "hub.model_id", "wandb.entity")
"""Keys whose value is an address a job sends to or the environment variable of a secret it sends: a run or evaluation
folder's saved value is used on ``resume=`` only when the command gives it too (:func:`handed_values`)."""


REWARD_FUNCTION_KEYS = ("reward_functions", "eval_reward_functions")
"""Keys that take reward functions, whose ``module:function`` entries import code (:func:`handed_values`)."""


def _plain(value):
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def handed_values(saved: DictConfig, given: DictConfig) -> list[tuple[str, object]]:
    """``(key, saved value)`` for each value of ``saved`` (a folder's config.yaml) that names code (a reward function as
    ``module:function``), a secret or an endpoint (:data:`HANDED_KEYS`) and differs from ``given`` (this command's config)."""
    found = []
    for key in REWARD_FUNCTION_KEYS:
        value = _plain(OmegaConf.select(saved, key, default=None))
        names = [value] if isinstance(value, str) else value if isinstance(value, list) else []
        if any(":" in str(name) for name in names) and value != _plain(OmegaConf.select(given, key, default=None)):
            found.append((key, value))  # registered names alone are taken from the folder
    for key in HANDED_KEYS:
        value = _plain(OmegaConf.select(saved, key, default=None))
        if value is not None and value != _plain(OmegaConf.select(given, key, default=None)):
            found.append((key, value))
    return found


def handed_error(folder: str, saved: DictConfig, given: DictConfig, script: str = "train.py") -> str | None:
    """One sentence when ``resume={folder}``'s saved config ``saved`` names code, a secret or an endpoint that the command's
    config ``given`` does not give (:func:`handed_values`), with the command that gives them; else None."""
    found = handed_values(saved, given)
    if not found:
        return None
    values = [f"{key}={override_text(value)}" for key, value in found]
    return (
        f"resume={folder}: its config.yaml names code, a secret or an address to send to ({', '.join(values)}), which a "
        "folder alone never decides, since it may have been handed to you; if you trust them, give them on the command "
        f"line too: {shell_line(script, [f'resume={folder}', *values])}"
    )


def config_differences(saved: DictConfig, new: DictConfig, keys: list[str] | None = None) -> list[tuple[str, object, object]]:
    """``(dotted key, saved value, new value)`` for each leaf where the resolved configs differ (a
    key one lacks: ``"absent"``), in ``saved``'s key order, :data:`RUN_FOLDER_KEYS` left out;
    ``keys`` limits it to those keys and what lies under them (e.g. ``loss`` for ``loss=ipo``)."""
    a, b = flat_config(saved), flat_config(new)

    def inside(key: str, top: str) -> bool:
        return key == top or key.startswith(top + ".")

    out = []
    for key in list(a) + [k for k in b if k not in a]:
        if any(inside(key, skip) for skip in RUN_FOLDER_KEYS):
            continue
        if keys is not None and not any(inside(key, k) for k in keys):
            continue
        va, vb = a.get(key, "absent"), b.get(key, "absent")
        if va != vb:
            out.append((key, va, vb))
    return out


def describe_differences(differences: list[tuple[str, object, object]], limit: int = 3) -> str:
    """``lr (saved 0.003, given 1.0), loss.name (saved dpo, given ipo)``: the first ``limit`` of
    :func:`config_differences`, and how many more."""
    text = ", ".join(f"{k} (saved {override_text(a)}, given {override_text(b)})" for k, a, b in differences[:limit])
    more = len(differences) - limit
    return text + (f" and {more} more" if more > 0 else "")
