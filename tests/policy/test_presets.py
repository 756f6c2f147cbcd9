"""Presets, parameter counts on the meta device, and `rl model info`."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from policy import build_model
from policy.cli import model_app


def test_k31_pro_counts_on_meta():
    m = build_model("k3.1-pro", device="meta")
    cfg = m.config
    assert cfg.num_hidden_layers == 93
    assert cfg.layer_types.count("kda") == 69 and cfg.layer_types.count("dsa") == 24
    assert cfg.layer_types[3] == "dsa" and cfg.layer_types[-1] == "dsa" and cfg.layer_types[-2] == "dsa"
    c = m.num_parameters()
    assert 2.7e12 < c["total"] < 2.9e12, c
    assert 100e9 < c["active"] < 108e9, c
    assert next(m.parameters()).is_meta


def test_kimi_linear_48b_counts():
    c = build_model("kimi-linear-48b", device="meta").num_parameters()
    assert 47e9 < c["total"] < 50e9 and 2.7e9 < c["active"] < 3.3e9, c


def test_small_is_about_100m():
    c = build_model("small", device="meta").num_parameters()
    assert 80e6 < c["total"] < 120e6, c


def test_cli_info_json():
    r = CliRunner().invoke(model_app, ["info", "k3.1-pro", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["dsa_layers"] == 24 and d["kda_layers"] == 69 and d["layer_pattern"].startswith("kKKD")
    r = CliRunner().invoke(model_app, ["info", "toy"])
    assert r.exit_code == 0 and "active/token" in r.output
    r = CliRunner().invoke(model_app, ["info", "no-such-model"])
    assert r.exit_code != 0


def test_overrides_and_unknown_preset():
    assert build_model("toy", vocab_size=300).config.vocab_size == 300
    with pytest.raises(ValueError, match="unknown preset"):
        build_model("k9")
    with pytest.raises(ValueError, match="unknown fields"):
        build_model("toy", hiden_size=3)
