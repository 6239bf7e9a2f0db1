"""The Hydra entry of a training run: `python train.py ...`, `meshtron-train ...` or
`torchrun ... train.py ...` all land in `main` (config -> mesh -> model -> loop)."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import meshtron.configs
from meshtron.errors import say_one_line
from meshtron.schema import nearest_key
from meshtron.training.config import unknown_override
from meshtron.training.launcher_checks import launcher_override_error
from meshtron.training.loop import main_entry


# configs/ is the package meshtron.configs (pyproject.toml maps it), so Hydra finds it in any install.
@hydra.main(version_base="1.3", config_path="pkg://meshtron.configs", config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    tree = OmegaConf.to_container(cfg, resolve=True)
    main_entry(tree, HydraConfig.get().runtime.output_dir)


CONFIG_DIR = Path(meshtron.configs.__file__).parent
_CONFIG_DIR_FLAGS = ("--config-dir", "-cd")


def config_groups(config_dirs: list[Path]) -> dict[str, set[str]]:
    """Option names of every config group (a folder of .yaml files, `hydra/` aside) in
    configs/ and the given --config-dir folders."""
    groups: dict[str, set[str]] = {}
    for root in [CONFIG_DIR, *config_dirs]:
        for path in root.glob("*/*.yaml"):
            if path.parent.name != "hydra":
                groups.setdefault(path.parent.name, set()).add(path.stem)
    return groups


def default_list_groups() -> set[str]:
    """The groups train.yaml's defaults list names (selected without `+`: parallel=tp2)."""
    defaults = OmegaConf.load(CONFIG_DIR / "train.yaml").get("defaults", [])
    return {key for entry in defaults if isinstance(entry, (dict, DictConfig)) for key in entry}


def group_selection_error(argv: list[str]) -> str | None:
    """The one-line error for the first group selection Hydra would refuse with a multi-line
    message: an unknown option (`parallel=tp3`), `+` on a group of the defaults list
    (`+parallel=tp2`) or a missing `+` on one that is not (`model=gpt_1b`); None if all fine.
    Sweep lists (`parallel=tp2,tp2_sp`) are checked option by option."""
    if any(arg.split("=", 1)[0] in ("--config-path", "-cp", "--config-name", "-cn") for arg in argv):
        return None  # another primary config: its groups are not ours to judge
    config_dirs = [Path(value) for flag, value in zip(argv, argv[1:]) if flag in _CONFIG_DIR_FLAGS]
    config_dirs += [
        Path(arg.split("=", 1)[1]) for arg in argv if arg.split("=", 1)[0] in _CONFIG_DIR_FLAGS and "=" in arg
    ]
    groups, in_defaults = config_groups(config_dirs), default_list_groups()
    for arg in argv:
        if "=" not in arg or arg.startswith(("-", "~")):
            continue
        key, value = arg.split("=", 1)
        plus, group = key.startswith("+"), key.lstrip("+")
        if group not in groups:
            continue
        if plus and group in in_defaults:
            return f"{group} is in the defaults list: select a preset without `+`, e.g. {group}={value}"
        if not plus and group not in in_defaults:
            return f"{group} is not in the defaults list: add it with `+`, e.g. +{group}={value}"
        if any(c in value for c in "()[]{}$"):
            continue  # a sweep function or interpolation: Hydra's to judge
        for option in value.split(","):
            if option not in groups[group]:
                near = nearest_key(option, sorted(groups[group]))
                hint = f"did you mean {group}={near}? " if near else ""
                return f"unknown {group} option {option!r}; {hint}known: {', '.join(sorted(groups[group]))}"
    return None


def compose_run(overrides: list[str]):
    """The RunConfig train.py would run with `overrides`, composed in this process without
    Hydra's app (same pre-checks: unknown keys, group selections). ConfigError with one line
    for a bad key, group selection or value. Used by `meshtron.plan` and `meshtron.verify`."""
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from meshtron.errors import ConfigError
    from meshtron.training.config import RunConfig

    error = unknown_override(overrides) or group_selection_error(overrides)
    if error:
        raise ConfigError(error)
    try:
        with initialize_config_module(config_module="meshtron.configs", version_base="1.3"):
            cfg = compose(config_name="train", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(" ".join(str(err).split())) from None
    return RunConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))


def main() -> None:
    """Refuse an override naming no config key, a group selection Hydra would refuse, or a
    launcher misuse (training/launcher_checks.py), in one line (exit 2)
    before Hydra composes the config, then run Hydra's entry."""
    args = sys.argv[1:]
    error = unknown_override(args) or group_selection_error(args) or launcher_override_error(args)
    if error:
        say_one_line(f"meshtron: configuration error: {error}")
        sys.exit(2)
    _hydra_main()


if __name__ == "__main__":
    main()
