"""Tests for training/schedule.py: exact values against the closed-form formulas."""

from __future__ import annotations

import math

import pytest

from meshtron.training.schedule import lr_at

LR, WARMUP, MAX, RATIO = 3e-4, 10, 110, 0.1
MIN_LR = LR * RATIO


def _lr(step: int, decay: str = "cosine", **kw) -> float:
    args = dict(lr=LR, warmup_steps=WARMUP, max_steps=MAX, min_lr_ratio=RATIO, decay=decay)
    args.update(kw)
    return lr_at(step, **args)


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_warmup_is_linear(decay: str):
    assert _lr(0, decay) == pytest.approx(LR / WARMUP, rel=1e-12)
    assert _lr(4, decay) == pytest.approx(LR * 5 / WARMUP, rel=1e-12)
    assert _lr(WARMUP - 1, decay) == pytest.approx(LR, rel=1e-12)
    # First decay step is the peak.
    assert _lr(WARMUP, decay) == pytest.approx(LR, rel=1e-12)


def test_cosine_values():
    mid = WARMUP + (MAX - WARMUP) // 2
    assert _lr(mid) == pytest.approx(MIN_LR + (LR - MIN_LR) * 0.5, rel=1e-12)
    quarter = WARMUP + (MAX - WARMUP) // 4
    expected = MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * 0.25))
    assert _lr(quarter) == pytest.approx(expected, rel=1e-12)
    last = MAX - 1
    expected = MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * (last - WARMUP) / (MAX - WARMUP)))
    assert _lr(last) == pytest.approx(expected, rel=1e-12)
    assert _lr(MAX) == pytest.approx(MIN_LR, rel=1e-12)
    assert _lr(MAX + 50) == pytest.approx(MIN_LR, rel=1e-12)


def test_linear_values():
    mid = WARMUP + (MAX - WARMUP) // 2
    assert _lr(mid, "linear") == pytest.approx((LR + MIN_LR) / 2, rel=1e-12)
    assert _lr(MAX - 1, "linear") == pytest.approx(LR - (LR - MIN_LR) * (MAX - 1 - WARMUP) / (MAX - WARMUP), rel=1e-12)
    assert _lr(MAX, "linear") == pytest.approx(MIN_LR, rel=1e-12)
    assert _lr(MAX + 5, "linear") == pytest.approx(MIN_LR, rel=1e-12)


def test_constant_values():
    for step in (WARMUP, 60, MAX - 1, MAX, MAX + 7):
        assert _lr(step, "constant") == LR


def test_cosine_is_monotone_after_warmup():
    values = [_lr(s) for s in range(WARMUP, MAX + 1)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_no_warmup_and_warmup_only():
    assert lr_at(0, lr=1.0, warmup_steps=0, max_steps=100) == 1.0
    assert lr_at(50, lr=1.0, warmup_steps=0, max_steps=100, min_lr_ratio=0.0) == pytest.approx(0.5)
    assert lr_at(4, lr=1.0, warmup_steps=5, max_steps=5) == pytest.approx(1.0)
    assert lr_at(5, lr=1.0, warmup_steps=5, max_steps=5, min_lr_ratio=0.2) == pytest.approx(0.2)


def test_errors():
    with pytest.raises(ValueError, match=r"unknown lr decay 'step'; allowed: cosine, linear, constant"):
        _lr(0, "step")
    with pytest.raises(ValueError, match=r"warmup_steps \(20\) exceeds max_steps \(10\)"):
        lr_at(0, lr=1.0, warmup_steps=20, max_steps=10)
    with pytest.raises(ValueError, match="step must be >= 0"):
        _lr(-1)
    with pytest.raises(ValueError, match="min_lr_ratio"):
        _lr(0, min_lr_ratio=1.5)
    with pytest.raises(ValueError, match="max_steps must be positive"):
        lr_at(0, lr=1.0, warmup_steps=0, max_steps=0)
