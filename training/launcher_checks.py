"""Launcher misuse on a `train.py` command line, refused in one line before Hydra starts.

`launcher_override_error` is called by training/cli.py's `main` beside `unknown_override` and
`group_selection_error`. It refuses what Hydra would report in many lines or a traceback, or
what would fail only once the sweep has started:

* `hydra/launcher=NAME` or `hydra.launcher.KEY=...` without `-m`. Decision: an error (exit 2),
  not a warning. Hydra applies a launcher to a sweep (multirun) only, and without `-m` it
  silently runs one process in this one: `python train.py hydra/launcher=torchrun
  hydra.launcher.nproc_per_node=4 parallel.tp=4` would run tp=4 on one rank, not four. It is
  detectable for certain from the command line: multirun is `-m`/`--multirun` (or a prefix
  argparse accepts) or `hydra.mode=MULTIRUN`, and train.yaml does not set hydra.mode. A command
  line naming another primary config (`--config-name`, `--config-path`) is not judged, as its
  config may set hydra.mode itself, nor one that only prints (`--cfg`, `--info`, `--help`).
* an unknown launcher name (with the nearest one), a misspelt option (with the nearest option
  of that launcher) or group (`hydra/launchr`), and a value Hydra cannot merge;
* hydra/launcher=torchrun options the launcher refuses (`nproc_per_node` < 1, a `script` that
  is not a file: the torchrun launcher's own `option_error`);
* submitit's `nodes`, `tasks_per_node`, `timeout_min`, `cpus_per_task` below 1;
* a Slurm launcher (`slurm_gpu`, `slurm_cpu`, `submitit_slurm`) where Slurm's `sbatch` or
  `srun` is not on PATH, and a submitit preset without hydra-submitit-launcher installed.

It composes only the launcher (Hydra's compose API over meshtron.configs, about 0.5 s) and only
when the command line names one; sweep lists of launcher options are Hydra's to judge.
"""

from __future__ import annotations

import importlib.util
import shutil

from meshtron.schema import nearest_key

_MULTIRUN_FLAGS = ("-m", "--multirun")
_PRIMARY_CONFIG_FLAGS = ("--config-path", "-cp", "--config-name", "-cn")
# Hydra's flags that print instead of running the task: a launcher without -m is fine there
_NO_TASK_FLAGS = ("--cfg", "-c", "--info", "-i", "--help", "-h", "--hydra-help", "--shell-completion", "-sc")
_LAUNCHER_CHOICE = "hydra/launcher="
_LAUNCHER_KEY = "hydra.launcher."
_SLURM_LAUNCHER = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
_TORCHRUN_LAUNCHER = "hydra_plugins.meshtron_torchrun_launcher.torchrun_launcher.TorchrunLauncher"
# submitit's integer options that must be >= 1 (a job of 0 tasks fails inside submitit: "Nothing to do!")
_SUBMITIT_POSITIVE = ("nodes", "tasks_per_node", "timeout_min", "cpus_per_task")


def _flag(arg: str) -> str:
    return arg.split("=", 1)[0]


def launcher_override_error(argv: list[str]) -> str | None:
    """The one-line error for the first launcher choice or option on a train.py command line
    that Hydra would refuse badly or too late (module doc); None if all are fine or none is given."""
    args = list(argv)
    if any(_flag(arg) in _PRIMARY_CONFIG_FLAGS for arg in args):
        return None
    misspelt = _misspelt_launcher_group(args)
    if misspelt:
        return misspelt
    choices = [arg for arg in args if arg.startswith(_LAUNCHER_CHOICE)]
    keys = [arg for arg in args if arg.startswith(_LAUNCHER_KEY) and "=" in arg]
    if not choices and not keys:
        return None
    if not _is_multirun(args) and not any(_flag(arg) in _NO_TASK_FLAGS for arg in args):
        named = choices[-1] if choices else _flag(keys[0])
        example = choices[-1] if choices else "hydra/launcher=torchrun"
        return (
            f"{named} applies to a sweep only, and Hydra ignores it without -m (it would run one process "
            f"here); add -m: python train.py -m {example} ..."
        )
    choice = choices[-1].split("=", 1)[1] if choices else None
    if choice is not None and choice.startswith(("slurm_", "submitit_")):
        if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
            return (
                f"hydra/launcher={choice} needs Hydra's submitit launcher, which is not installed: "
                f"pip install -e '.[slurm]' (or use hydra/launcher=torchrun)"
            )
    values = _launcher_values(choice, keys)
    return values if isinstance(values, str) else _option_error(values, choice)


def _misspelt_launcher_group(args: list[str]) -> str | None:
    """`hydra/launchr=torchrun`, `hydra.lancher.nproc_per_node=2`: the key named, with `launcher`."""
    for arg in args:
        key = _flag(arg).lstrip("+")
        if "=" in arg and key.startswith(("hydra/", "hydra.")):
            part = key[len("hydra/") :].replace("/", ".").split(".", 1)[0]
            if part != "launcher" and nearest_key(part, ["launcher"]):
                meant = key[: len("hydra/")] + "launcher" + key[len("hydra/") + len(part) :]
                return f"unknown key {key}; did you mean {meant}={arg.split('=', 1)[1]}?"
    return None


def _launcher_values(choice: str | None, keys: list[str]) -> dict | str:
    """The composed `hydra.launcher` section for `choice` and the option overrides `keys`, or
    the one-line error naming the launcher, the key or the override Hydra refuses."""
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    base = [f"{_LAUNCHER_CHOICE}{choice}"] if choice is not None else []
    plain = [arg for arg in keys if not any(c in arg.split("=", 1)[1] for c in ",()[]{}$")]
    with initialize_config_module(config_module="meshtron.configs", version_base="1.3"):
        options = GlobalHydra.instance().config_loader().get_group_options("hydra/launcher")
        if choice is not None and choice not in options:
            near = nearest_key(choice, options)
            hint = f"did you mean hydra/launcher={near}? " if near else ""
            return f"unknown hydra/launcher option {choice!r}; {hint}known: {', '.join(options)}"
        try:
            try:
                values = _composed_launcher([*base, *plain])  # one composition when all is well
            except (HydraException, OmegaConfBaseException):
                values = None
            if values is None or keys != plain:  # name the key, then the override, that fails
                unknown = _unknown_launcher_key(choice, base, keys)
                if unknown:
                    return unknown
                for arg in plain:
                    _composed_launcher([*base, arg])
                if values is None:
                    values = _composed_launcher([*base, *plain])
            return values
        except (HydraException, OmegaConfBaseException) as err:
            cause = err.__cause__ if err.__cause__ is not None else err
            detail = " ".join(str(cause).split("full_key:")[0].split())
            return f"{' '.join(str(err).splitlines()[0].split())}: {detail}" if cause is not err else detail


def _composed_launcher(overrides: list[str]) -> dict:
    from hydra import compose
    from omegaconf import OmegaConf

    cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
    return OmegaConf.to_container(cfg.hydra.launcher, resolve=True)


def _unknown_launcher_key(choice: str | None, base: list[str], keys: list[str]) -> str | None:
    """The first option override in `keys` that the chosen launcher does not have, named with
    the nearest one it has; None when every key is one of its options."""
    known = [key for key in _composed_launcher(base) if not key.startswith("_")]
    for arg in keys:
        key = _flag(arg)
        option = key[len(_LAUNCHER_KEY) :].split(".", 1)[0]
        if option in known:
            continue
        if not choice:
            return (
                f"unknown key {key}: Hydra's default launcher has no options; select one, "
                f"e.g. -m hydra/launcher=torchrun {arg}"
            )
        near = nearest_key(option, known)
        hint = f"did you mean {_LAUNCHER_KEY}{near}? " if near else ""
        return f"unknown key {key} of hydra/launcher={choice}; {hint}its options: {', '.join(known)}"
    return None


def _option_error(values: dict, choice: str | None) -> str | None:
    """The launcher's own refusal of its composed options `values` (module doc)."""
    target = str(values.get("_target_", ""))
    if target == _TORCHRUN_LAUNCHER:
        from hydra_plugins.meshtron_torchrun_launcher.torchrun_launcher import option_error

        return option_error(
            values.get("nproc_per_node"), values.get("timeout_s"), values.get("torchrun_args", []), values.get("script")
        )
    if "submitit" in target:
        for key in _SUBMITIT_POSITIVE:
            value = values.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                return f"{_LAUNCHER_KEY}{key}={value!r} must be an integer >= 1 (hydra/launcher={choice})"
    if target == _SLURM_LAUNCHER:
        missing = [tool for tool in ("sbatch", "srun") if shutil.which(tool) is None]
        if missing:
            return (
                f"hydra/launcher={choice} submits Slurm jobs, but {' and '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not on PATH (Slurm is not installed here); run the "
                f"sweep on a Slurm login node, or use hydra/launcher=slurm_local to run the same path on this machine"
            )
    return None


def _is_multirun(argv: list[str]) -> bool:
    """Whether Hydra runs this command line as a sweep: -m, --multirun or a prefix of it
    (argparse's abbreviations), or hydra.mode=MULTIRUN."""
    for arg in argv:
        if arg in _MULTIRUN_FLAGS or (len(arg) >= 3 and "--multirun".startswith(arg)):
            return True
        if "=" in arg and _flag(arg).lstrip("+") == "hydra.mode" and arg.split("=", 1)[1].upper() == "MULTIRUN":
            return True
    return False
