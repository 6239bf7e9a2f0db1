"""The config schema (meshtron/schema.py): every bad value issue 14 found is refused by the
typed config with one message naming the key, the value and what is allowed."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from meshtron.models.config import ExecutionConfig, GPTConfig
from meshtron.moe.config import ROUTING_FIELDS, MoEConfig
from meshtron.mpu.mesh import ParallelConfig
from meshtron.planning.step_time import LAYOUT_SIZES, Layout
from meshtron.schema import Allowed, help_of, nearest_key
from meshtron.training.config import ConfigError, RunConfig, TrainerConfig, unknown_override


@pytest.mark.parametrize(
    "section,key,value,message",
    [
        ("optim", "lr", float("inf"), "optim.lr=inf must be a finite number > 0"),
        ("optim", "lr", float("nan"), "optim.lr=nan must be a finite number > 0"),
        ("optim", "lr", 0.0, "optim.lr=0.0 must be a finite number > 0"),
        ("trainer", "max_steps", "abc", "trainer.max_steps='abc' must be an integer >= 1"),
        ("optim", "decay", "bogus", "optim.decay='bogus' must be one of cosine, linear, constant"),
        ("optim", "min_lr_ratio", 2, "optim.min_lr_ratio=2 must be a finite number in [0, 1]"),
        ("optim", "warmup_steps", -3, "optim.warmup_steps=-3 must be an integer >= 0"),
        ("optim", "betas", [1.5, 0.9], "optim.betas=(1.5, 0.9): every element must be in [0, 1)"),
        ("optim", "betas", [0.9], "optim.betas=(0.9,) must be a list of 2 finite numbers"),
        ("optim", "eps", -1, "optim.eps=-1 must be a finite number > 0"),
        ("optim", "weight_decay", -5, "optim.weight_decay=-5 must be a finite number >= 0"),
        ("optim", "zero", 4, "optim.zero=4 must be one of 0, 1, 2, 3"),
        ("trainer", "num_threads", -1, "trainer.num_threads=-1 must be an integer >= 1"),
        ("trainer", "progress", 1, "trainer.progress=1 must be true or false"),
        ("trainer", "device", "tpu", "trainer.device='tpu' must be one of auto, cpu, cuda"),
        ("trainer", "max_grad_norm", -1.0, "trainer.max_grad_norm=-1.0 must be a finite number >= 0"),
        ("data", "val_fraction", 1.0, "data.val_fraction=1.0 must be a finite number in [0, 1)"),
        ("checkpoint", "keep", 0, "checkpoint.keep=0 must be an integer >= 1"),
        ("model", "num_layers", 2.5, "model.num_layers=2.5 must be an integer >= 1"),
        ("model", "hidden_size", -128, "model.hidden_size=-128 must be an integer >= 1"),
        ("model", "num_heads", 0, "model.num_heads=0 must be an integer >= 1"),
        ("parallel", "tp", True, "parallel.tp=True must be an integer >= 1"),
        ("trainer", "global_batch_size", 16.5, "trainer.global_batch_size=16.5 must be an integer"),
        ("trainer", "lm_loss_chunk_rows", 0, "trainer.lm_loss_chunk_rows=0 must be an integer >= 1"),
        ("trainer", "fused_lm_loss", "yes", "trainer.fused_lm_loss='yes' must be true or false"),
    ],
)
def test_bad_values_name_key_value_and_what_is_allowed(section, key, value, message):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict({section: {key: value}})
    assert str(err.value) == message


def test_cross_field_rules_and_defaults():
    RunConfig.from_dict({})  # the defaults pass
    with pytest.raises(ConfigError, match=r"^optim.warmup_steps=50 exceeds trainer.max_steps=10$"):
        RunConfig.from_dict({"trainer": {"max_steps": 10}, "optim": {"warmup_steps": 50}})
    with pytest.raises(ConfigError, match="checkpoint.resume=auto needs checkpoint.dir"):
        RunConfig.from_dict({"checkpoint": {"resume": "auto"}})


def test_unknown_keys_suggest_the_nearest():
    with pytest.raises(ConfigError, match=r"^unknown key optim.lrr; did you mean optim.lr\?$"):
        RunConfig.from_dict({"optim": {"lrr": 1e-3}})
    with pytest.raises(ConfigError, match=r"^unknown config section trainr; did you mean trainer\?$"):
        RunConfig.from_dict({"trainr": {}})
    assert unknown_override(["parallel.tpp=2"]) == "unknown key parallel.tpp; did you mean parallel.tp?"
    assert (
        unknown_override(
            [
                "parallel.tp=2",
                "+model=gpt_1b",
                "~data.paths",
                "hydra.run.dir=x",
                "-m",
                "--config-dir",
                "d",
                "trainer.max_steps=3",
            ]
        )
        is None
    )
    assert unknown_override(["optimm.lr=1"]) == "unknown config section optimm; did you mean optim?"
    assert nearest_key("zzz", ["optim.lr"]) is None


def test_allowed_describes_its_range():
    assert Allowed(ge=0, lt=1).describe() == "in [0, 1)"
    assert Allowed(gt=0).describe() == "> 0"
    assert Allowed(choices=(None, True, "a")).describe() == "one of null, true, a"
    assert Allowed(ge=1).holds(1) and not Allowed(ge=1).holds(0)


def _declaration(kind: type, name: str) -> tuple:
    """(type, default, metadata) of `kind`'s field `name`."""
    f = kind.__dataclass_fields__[name]
    return typing.get_type_hints(kind)[name], f.default, dict(f.metadata)


@pytest.mark.parametrize(
    "copy,owner,names",
    [
        (GPTConfig, MoEConfig, ROUTING_FIELDS),
        (
            TrainerConfig,
            ExecutionConfig,
            (
                "recompute",
                "recompute_layers",
                "fused_lm_loss",
                "lm_loss_chunk_rows",
                "compile_moe",
                "moe_dispatch_chunks",
            ),
        ),
        (Layout, ParallelConfig, tuple(n for n in LAYOUT_SIZES if n != "dp")),
    ],
)
def test_a_key_carried_twice_is_declared_once(copy, owner, names):
    """GPTConfig's MoE routing keys are MoEConfig's, TrainerConfig's execution keys
    ExecutionConfig's, the planner's Layout sizes ParallelConfig's: same type, default, range
    and help (`schema.declared_in`); only the annotation is written twice, and must agree."""
    assert names and set(names) <= {f.name for f in dataclasses.fields(copy)}
    for name in names:
        assert _declaration(copy, name) == _declaration(owner, name), name
        assert help_of(owner.__dataclass_fields__[name]), name


def test_layout_dp_is_resolved_and_moe_gets_every_routing_field():
    assert _declaration(Layout, "dp") == (int, 1, dict(ParallelConfig.__dataclass_fields__["dp"].metadata))
    changed = dict(
        capacity_factor=1.5,
        aux_loss_coef=0.02,
        z_loss_coef=0.001,
        router_score="sigmoid",
        router_renormalize=True,
        router_bias_update_rate=0.01,
        aux_loss_scope="sequence",
        aux_loss_layers="pooled",
        router_groups=2,
        router_topk_groups=1,
        shared_experts=1,
        router_scaling_factor=2.5,
        shared_ffn_hidden_size=96,
        shared_expert_gate=True,
    )
    assert set(changed) == set(ROUTING_FIELDS)
    moe = GPTConfig(num_experts=4, top_k=2, **changed).moe()
    assert {name: getattr(moe, name) for name in ROUTING_FIELDS} == changed
    assert GPTConfig(num_experts=4, router_renormalize=False).moe().router_renormalize is False  # sigmoid needs true
