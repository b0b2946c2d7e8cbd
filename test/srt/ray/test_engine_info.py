"""The engine-info bootstrap rule and per-rank parallelism configs (arg_groups/engine_info_predicates.py, rdt/plugin.py, model_executor/parallelism_config.py)."""

from __future__ import annotations

import types

import pytest

from sglang.srt.arg_groups.engine_info_predicates import (
    needs_engine_info_bootstrap_of,
    registers_parallelism_config_of,
)
from sglang.srt.model_executor.parallelism_config import (
    ParallelismConfigStore,
    global_rank_of,
    install_parallelism_config_routes,
)


# --------------------------------------------------------------------------- #
# Predicates and parallelism config
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "te, bootstrap, needs, registers",
    [
        (False, False, False, False),
        (True, False, True, False),
        (False, True, True, True),
    ],
)
def test_bootstrap_needed_for_either_flag_but_configs_registered_only_with_bootstrap(te, bootstrap, needs, registers):
    cfg = types.SimpleNamespace(
        remote_instance_weight_loader_start_seed_via_transfer_engine=te,
        enable_engine_info_bootstrap=bootstrap,
    )
    assert needs_engine_info_bootstrap_of(cfg) is needs
    assert registers_parallelism_config_of(cfg) is registers


def test_server_args_predicates_fold_in_the_flags():
    from sglang.srt.server_args import prepare_server_args

    base = ["--model-path", "/nonexistent", "--device", "cpu"]
    plain = prepare_server_args(base)
    assert not plain.needs_engine_info_bootstrap() and not plain.registers_parallelism_config()
    boot = prepare_server_args(base + ["--enable-engine-info-bootstrap"])
    assert boot.needs_engine_info_bootstrap() and boot.registers_parallelism_config()


def test_rdt_flag_declares_engine_info_bootstrap_during_resolution(tiny_model):
    """The rule lives in sglang's resolution record, registered by the fork's
    plugin entry point: the field itself reads True, with its source."""
    from importlib.metadata import entry_points

    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("ray_rdt_weight_sync") == "sglang.srt.ray.rdt.plugin:register"
    load_plugins()  # what the CLI, Engine() and launch_engine do first
    base = ["--model-path", str(tiny_model), "--device", "cpu"]
    rdt = prepare_server_args(base + ["--backend", "ray", "--enable-rdt-weight-sync"])
    assert rdt.enable_engine_info_bootstrap is False  # the operator's input, untouched
    rdt.resolve_once()
    from sglang.srt.arg_groups.model_override_base import resolving_view

    # the resolved value (what publishing projects onto the record every process reads)
    assert resolving_view(rdt).enable_engine_info_bootstrap is True
    assert rdt.needs_engine_info_bootstrap() and rdt.registers_parallelism_config()
    assert ("--enable-rdt-weight-sync", {"enable_engine_info_bootstrap": True}) in rdt._resolved_overrides
    plain = prepare_server_args(base)
    plain.resolve_once()
    assert resolving_view(plain).enable_engine_info_bootstrap is False
    assert not plain.needs_engine_info_bootstrap()


def test_rdt_flag_without_ray_backend_is_refused():
    from sglang.srt.arg_groups.ray_backend_checks import check_weight_sync_args

    args = types.SimpleNamespace(enable_rdt_weight_sync=True, use_ray=False, rdt_pull_timeout=1)
    with pytest.raises(ValueError, match="needs the Ray backend: add --backend ray"):
        check_weight_sync_args(args)
    check_weight_sync_args(types.SimpleNamespace(enable_rdt_weight_sync=True, use_ray=True, rdt_pull_timeout=1))


def test_rdt_flag_without_nixl_says_what_to_install(monkeypatch):
    import builtins

    from sglang.srt.arg_groups.ray_backend_checks import check_weight_sync_args

    real_import = builtins.__import__

    def no_nixl(name, *a, **k):
        if name == "nixl" or name.startswith("nixl."):
            raise ImportError("No module named 'nixl'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_nixl)
    args = types.SimpleNamespace(enable_rdt_weight_sync=True, use_ray=True, rdt_pull_timeout=1)
    with pytest.raises(ValueError, match=r"pip install nixl-cu13==1\.5\.1 && pip install --no-deps nixl==1\.5\.1"):
        check_weight_sync_args(args)


def test_global_rank_counts_tp_then_pp_then_dp_and_attention_dp_folds_into_tp():
    assert global_rank_of(dict(tp_size=2, pp_size=2, tp_rank=1, pp_rank=1, dp_rank=0)) == 3
    assert global_rank_of(dict(tp_size=2, pp_size=1, tp_rank=1, pp_rank=0, dp_rank=2, dp_size=3)) == 5
    # Attention DP folds DP into TP: the rank is the TP/PP position.
    assert global_rank_of(dict(tp_size=4, pp_size=1, tp_rank=3, pp_rank=0, dp_rank=1, attn_dp_size=2)) == 3


def test_parallelism_config_routes_serve_registered_ranks_and_refuse_bad_configs():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()
    store = ParallelismConfigStore()
    install_parallelism_config_routes(app, store)
    client = TestClient(app)
    cfg = dict(tp_rank=1, tp_size=2, pp_rank=0, pp_size=1, dp_rank=0, dp_size=1, device="cuda", device_id=1)
    assert client.put("/register_parallelism_config", json=cfg).status_code == 200
    got = client.get("/parallelism_config", params={"rank": 1}).json()
    assert got == {**cfg, "rank": 1}
    assert client.get("/parallelism_config").json() == {"ranks": {"1": {**cfg, "rank": 1}}}
    r = client.get("/parallelism_config", params={"rank": 0})
    assert r.status_code == 404 and "registered ranks: [1]" in r.text
    bad = client.put("/register_parallelism_config", json={"x": 1})
    assert bad.status_code == 400 and "bad parallelism config" in bad.text
