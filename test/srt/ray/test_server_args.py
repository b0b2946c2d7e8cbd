"""CLI spellings of the Ray backend and its flags."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from sglang.srt.server_args import prepare_server_args

BASE = ["--model-path", "/nonexistent/tiny", "--device", "cpu"]


def _as_dict(args):
    return msgspec.structs.asdict(args)


def test_backend_ray_equals_use_ray():
    a = prepare_server_args(BASE + ["--backend", "ray"])
    b = prepare_server_args(BASE + ["--use-ray"])
    assert a.use_ray is True
    da, db = _as_dict(a), _as_dict(b)
    assert da == db
    assert a._launch_command != b._launch_command  # what differs is only the spelling


def test_backend_mp_and_default_leave_ray_off():
    assert prepare_server_args(BASE).use_ray is False
    assert prepare_server_args(BASE + ["--backend", "mp"]).use_ray is False
    assert _as_dict(prepare_server_args(BASE + ["--backend", "mp"])) == _as_dict(
        prepare_server_args(BASE)
    )


def test_unknown_backend_is_a_clear_error():
    proc = subprocess.run(
        [sys.executable, "-c",
         "import sys; from sglang.srt.server_args import prepare_server_args;"
         "prepare_server_args(sys.argv[1:])", *BASE, "--backend", "slurm"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "unknown backend 'slurm'" in proc.stderr
    assert "choose one of mp, ray" in proc.stderr


def test_backend_mp_contradicting_use_ray_is_an_error(capsys):
    with pytest.raises(SystemExit) as e:
        prepare_server_args(BASE + ["--use-ray", "--backend", "mp"])
    assert e.value.code == 2
    assert "contradicts --use-ray" in capsys.readouterr().err


def test_ray_flags_parse_and_default_to_off():
    a = prepare_server_args(
        BASE + ["--backend", "ray", "--ray-namespace", "rollout", "--ray-address",
                "127.0.0.1:6379", "--ray-startup-timeout", "12.5",
                "--enable-rdt-weight-sync"]
    )
    assert (a.ray_namespace, a.ray_address, a.ray_startup_timeout) == (
        "rollout", "127.0.0.1:6379", 12.5)
    assert a.enable_rdt_weight_sync is True
    d = prepare_server_args(BASE)
    assert (d.ray_namespace, d.ray_address, d.enable_rdt_weight_sync) == (None, None, False)


def test_placement_strategy_flag_parses_and_needs_the_ray_backend(capsys):
    a = prepare_server_args(BASE + ["--backend", "ray", "--ray-placement-strategy", "STRICT_SPREAD"])
    assert a.ray_placement_strategy == "STRICT_SPREAD"
    assert prepare_server_args(BASE + ["--backend", "ray"]).ray_placement_strategy is None
    with pytest.raises(SystemExit) as e:
        prepare_server_args(BASE + ["--backend", "ray", "--ray-placement-strategy", "EVERYWHERE"])
    assert e.value.code == 2 and "STRICT_SPREAD" in capsys.readouterr().err
    # Checked with the other Ray backend checks (ServerArgs.check_server_args).
    from sglang.srt.arg_groups.ray_backend_checks import check_weight_sync_args

    check_weight_sync_args(a)
    with pytest.raises(ValueError, match="--ray-placement-strategy needs the Ray backend"):
        check_weight_sync_args(prepare_server_args(BASE + ["--ray-placement-strategy", "SPREAD"]))
