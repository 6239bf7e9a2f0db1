"""GPU acceptance (`pytest -m cuda`): every Triton kernel vs torch on CUDA in fp32 and bf16,
a training step per family with triton vs torch kernels and with the self-checked `auto`
backend, and the card command shrunk to the GPUs present over NCCL. The work runs in
`python bench/gpu_acceptance.py` subprocesses with TRITON_INTERPRET removed (other test
modules set it for this process at collection time). On a machine without CUDA the `cuda`
tests are skipped with the reason; the CPU tests here check the script's skip output and that
the shrunken card command is a valid configuration for 1 to 8 GPUs."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu_acceptance import DTYPES, FAMILIES, KERNELS, card_command, card_layout

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_acceptance.py"

NO_GPU = (
    "needs a CUDA GPU (torch.cuda.is_available() is False); on a GPU machine run `pytest -m cuda` and "
    "`python bench/gpu_acceptance.py`"
)


def on_gpu(test):
    """Mark `test` as a `cuda` test, skipped with the reason where there is no GPU."""
    test = pytest.mark.timeout(1800)(test)
    test = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)(test)
    return pytest.mark.cuda(test)


def run_script(*args: str, env: dict | None = None, timeout: float = 1800) -> tuple[int, dict, str]:
    """(exit code, the JSON it printed, stderr) of bench/gpu_acceptance.py."""
    env = dict(os.environ if env is None else env)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no output (exit {proc.returncode}): {proc.stderr[-3000:]}"
    return proc.returncode, json.loads(lines[-1]), proc.stderr


@functools.cache
def gpu_results() -> dict:
    """The kernels and steps sections, run once per pytest session."""
    _, report, stderr = run_script("--sections", "kernels,steps")
    for name in ("kernels", "steps"):
        assert "error" not in report["sections"][name], report["sections"][name].get("traceback", stderr)
    return report["sections"]


# --------------------------------------------------------------------------- CPU


def test_script_prints_the_skip_reason_without_cuda():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    code, report, _ = run_script(env=env, timeout=300)
    assert code == 0
    assert report["bench"] == "gpu_acceptance"
    assert "no CUDA GPU" in report["skipped"] and "torch.cuda.is_available() is False" in report["skipped"]


@pytest.mark.parametrize("gpus", range(1, 9))
def test_shrunken_card_command_is_a_valid_run_for_the_gpu_count(gpus):
    """The card command's overrides, composed by Hydra as train.py does, pass every check a
    run makes before creating process groups, at world size = the GPU count."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from meshtron.training.config import RunConfig
    from meshtron.training.run_checks import check_run_config

    lay = card_layout(gpus)
    assert lay["nproc"] == gpus and gpus % lay["tp"] == 0 and 8 % lay["ep"] == 0 and gpus % lay["ep"] == 0
    if gpus == 8:
        assert (lay["tp"], lay["ep"]) == (4, 8)  # the card command itself
    cmd = card_command(gpus, "/tmp/unused")
    overrides = [a for a in cmd[cmd.index("train.py") + 1 :] if not a.startswith("hydra.")]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    run = RunConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))
    par, _, _ = check_run_config(run, gpus)
    assert (par.tp, par.ep, run.kernels.backend, run.trainer.precision) == (lay["tp"], lay["ep"], "auto", "bf16")


# --------------------------------------------------------------------------- CUDA


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kernel", KERNELS)
@on_gpu
def test_kernel_matches_torch_on_gpu(kernel, dtype):
    entry = gpu_results()["kernels"][dtype][kernel]
    assert entry["passed"], entry


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("family", FAMILIES)
@on_gpu
def test_train_step_triton_matches_torch_on_gpu(family, dtype):
    entry = gpu_results()["steps"][family][dtype]
    assert entry["passed"], entry


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("family", FAMILIES)
@on_gpu
def test_auto_backend_keeps_every_kernel_on_triton_on_gpu(family, dtype):
    assert gpu_results()["steps"]["auto_resolves_to"] == "triton_checked"
    entry = gpu_results()["steps"][family][dtype]["selfcheck"]
    assert not entry["warnings"] and entry["verdicts"] and all(entry["verdicts"].values()), entry


@on_gpu
def test_card_command_shrunk_to_the_gpus_present():
    _, report, stderr = run_script("--sections", "card")
    card = report["sections"]["card"]
    assert card["ok"], {k: v for k, v in card.items() if k != "log_tail"} | {"log_tail": card.get("log_tail", stderr)}
