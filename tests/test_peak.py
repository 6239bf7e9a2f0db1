"""Peak FLOP/s: datasheet table lookups and the CPU measurement (planning/peak.py)."""

from __future__ import annotations

import math

import pytest
import torch

from meshtron.planning.peak import gpu_peak_entry, known_gpu_peak_flops, measure_cpu_peak_flops, peak_flops

T = 1e12


@pytest.mark.parametrize(
    "name, dtype, tflops",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4),
        ("NVIDIA H100 80GB HBM3", torch.float16, 989.4),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756.5),
        ("NVIDIA H100 NVL", torch.bfloat16, 835.5),
        ("NVIDIA H200", torch.bfloat16, 989.4),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0),
        ("NVIDIA A100 80GB PCIe", torch.float16, 312.0),
        ("NVIDIA A10", torch.bfloat16, 125.0),
        ("NVIDIA L4", torch.float16, 121.0),
        ("NVIDIA GeForce RTX 4090", torch.bfloat16, 165.2),
        ("Tesla V100-SXM2-16GB", torch.float16, 125.0),
        ("Tesla V100-PCIE-32GB", torch.float16, 112.0),
    ],
)
def test_known_gpu_table(name, dtype, tflops):
    assert known_gpu_peak_flops(name, dtype) == pytest.approx(tflops * T)


def test_fp32_plain_vs_tf32():
    assert known_gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.float32, tf32=False) == pytest.approx(67.0 * T)
    assert known_gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.float32, tf32=True) == pytest.approx(494.7 * T)
    assert known_gpu_peak_flops("NVIDIA A100-SXM4-40GB", torch.float32, tf32=False) == pytest.approx(19.5 * T)
    _, desc = gpu_peak_entry("NVIDIA A100-SXM4-40GB", torch.float32, tf32=True)
    assert "TF32" in desc and "dense" in desc
    # Volta has no TF32: fp32 stays the CUDA-core rate.
    assert known_gpu_peak_flops("Tesla V100-SXM2-16GB", torch.float32, tf32=True) == pytest.approx(15.7 * T)


def test_unknown_or_unsupported():
    assert known_gpu_peak_flops("NVIDIA A10G", torch.bfloat16) is None  # not the A10
    assert known_gpu_peak_flops("AMD Instinct MI300X", torch.bfloat16) is None
    assert known_gpu_peak_flops("Tesla V100-SXM2-16GB", torch.bfloat16) is None  # no bf16 tensor cores
    assert known_gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.float64) is None


def test_description_names_part():
    flops, desc = gpu_peak_entry("NVIDIA H100 80GB HBM3", torch.bfloat16)
    assert desc == "datasheet: NVIDIA H100 SXM bf16 dense"
    assert flops == pytest.approx(989.4 * T)


def test_cpu_measurement_positive():
    flops = measure_cpu_peak_flops(size=128, seconds=0.02)
    assert math.isfinite(flops) and flops > 0


def test_peak_flops_cpu_measured_and_cached():
    flops, desc = peak_flops(torch.device("cpu"), torch.float32)
    assert math.isfinite(flops) and flops > 0
    assert desc.startswith("measured:") and "fp32" in desc and f"{torch.get_num_threads()} thread" in desc
    assert peak_flops("cpu", torch.float32) == (flops, desc)  # cached per (dtype, threads)


def test_peak_flops_rejects_other_devices():
    with pytest.raises(ValueError, match="device type"):
        peak_flops(torch.device("meta"), torch.float32)
