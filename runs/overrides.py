"""The command line's overrides checked against the composed config before Hydra runs: an unknown key, a near-miss
``+key``, a missing group option or a folder as ``model=``, said in one sentence."""

from __future__ import annotations

import difflib
import os

from omegaconf import DictConfig

from runs import checkpoints


def _keys(node: DictConfig, top: bool) -> str:
    """``node``'s keys, sorted and comma-separated (Hydra's own node left out at the top)."""
    return ", ".join(sorted(str(k) for k in node.keys() if not (top and k == "hydra")))


def override_error(overrides: list[str], config_name: str = "config") -> str | None:
    """One sentence when a command-line override names what ``config_name``'s config lacks (an unknown key, a near-miss ``+key``,
    a missing group option, a folder as ``model=``), else None (Hydra reports other failures)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return None
    problem = _model_folder_error(overrides, parsed)
    if problem is not None:
        return problem
    with initialize_config_dir(config_dir=checkpoints.CONFIG_DIR, version_base="1.3"):
        try:
            config = compose(config_name=config_name, overrides=overrides)
        except MissingConfigException as e:
            return _missing_option_error(e, parsed)
        except ConfigCompositionException as e:
            return _unknown_key_error(e, overrides, parsed)
        added = [  # +key near-misses of top-level keys; nested additions are validate_config's
            (text, o)
            for text, o in zip(overrides, parsed)
            if (o.is_add() or o.is_force_add()) and o.key_or_group in config and not any(c in o.key_or_group for c in "./@")
        ]
        if not added:
            return None
        base = compose(config_name=config_name, overrides=[text for text, o in zip(overrides, parsed) if (text, o) not in added])
    return _added_key_error(added, base)


def _model_folder_error(overrides: list[str], parsed: list) -> str | None:
    """One sentence when ``model=`` names a folder or hub id (a preset name was expected), else None."""
    for text, o in zip(overrides, parsed):
        value = o.value() if o.key_or_group == "model" and not o.is_sweep_override() else None
        if isinstance(value, str) and ("/" in value or os.path.isdir(value)):
            return (
                f"{text}: model= takes a preset of config/model/ (e.g. tiny, pythia28); to load a folder or hub id, "
                f"give model=blank_model model.name_or_path={value}."
            )
    return None


def _missing_option_error(e, parsed: list) -> str | None:
    """One sentence for Hydra's MissingConfigException ``e`` when an override named a group option that does not exist."""
    group, _, option = (e.missing_cfg_file or "").rpartition("/")  # e.missing_cfg_file is "<group>/<option>"
    if not e.options or not any(o.key_or_group == group for o in parsed):
        return None
    close = difflib.get_close_matches(option, e.options, n=1)
    hint = f"; did you mean {group}={close[0]}?" if close else ""
    return f"{group}={option} is not an option of {group}{hint} (options: {', '.join(e.options)})."


def _loss_keys(loss: DictConfig) -> set[str]:
    """The ``loss.*`` keys the objective ``loss.name`` reads with these settings (``loss=wpo``: its loss_type's too)."""
    import losses

    try:
        return set(losses.get_objective(loss.name).keys_for(loss))
    except (losses.ObjectiveConfigError, KeyError, TypeError, ValueError):
        return set()


def _unknown_key_error(e, overrides: list[str], parsed: list) -> str | None:
    """One sentence for Hydra's ConfigCompositionException ``e`` when an override named a key the config lacks, else None."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    cause = e.__cause__
    if not isinstance(cause, (ConfigAttributeError, ConfigKeyError)) or not isinstance(cause.parent_node, DictConfig):
        return None
    missing, name, parent = str(cause.full_key), str(cause.key), cause.parent_node
    typed = next((o.key_or_group for o in parsed if f"{o.key_or_group}.".startswith(f"{missing}.")), missing)
    prefix = missing[: len(missing) - len(name)]  # "loss." for loss.betaa, "" at the top
    where = f" (keys of {prefix[:-1]}: {_keys(parent, False)})" if prefix else f" (keys: {_keys(parent, True)})"
    close = difflib.get_close_matches(name, [str(k) for k in parent.keys() if k != "hydra"], n=1)
    if close:
        return f"{typed} is not a config key; did you mean {prefix}{close[0]}{typed[len(missing) :]}?{where}"
    if prefix == "loss." and parent.get("name") and name not in _loss_keys(parent):  # adding a key no formula reads is no fix
        return f"loss={parent.name} has no key {name!r}{where}; remove it."
    text = next((t for t, o in zip(overrides, parsed) if o.key_or_group == typed), None)
    add = f"; to add it, write +{text}" if prefix and text is not None and not text.startswith("+") else ""
    return f"{typed} is not a config key{where}{add}."


def _added_key_error(added: list[tuple], base: DictConfig) -> str | None:
    """One sentence when a ``+key`` of ``added`` is a near-miss of a key of ``base`` (the config composed without them)."""
    for text, o in added:
        if o.key_or_group not in base:
            close = difflib.get_close_matches(o.key_or_group, [str(k) for k in base.keys()], n=1, cutoff=0.8)
            if close:
                return (
                    f"{o.key_or_group} is not a config key; did you mean {close[0]}? "
                    f"({text} would add a key nothing reads; keys: {_keys(base, True)})"
                )
    return None
