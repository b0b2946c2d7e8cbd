"""The fork build: pinned wheel, patch series, module overlay, metadata."""

from __future__ import annotations

import csv
import importlib.metadata as md
import io
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "python"))

import fork_build  # noqa: E402


@pytest.fixture
def cfg():
    return fork_build.ForkConfig.load()


def _copy_patches(tmp_path: Path) -> Path:
    dst = tmp_path / "patches"
    shutil.copytree(REPO / "patches", dst)
    return dst


# The upstream wheels PyPI publishes for sglang 0.5.23 on Linux x86_64, one per
# interpreter make install accepts, with their sha256.
UPSTREAM_WHEELS = {
    "cp311": (
        "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl",
        "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937",
    ),
    "cp312": (
        "sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl",
        "8d257a319395b322bb1be327d05e5528859358153c8563b04c0a4a3c8af164b6",
    ),
}
RUNNING_TAG = f"cp{sys.version_info.major}{sys.version_info.minor}"


def test_config_pins_exactly_the_supported_wheels(cfg):
    assert cfg.python_tag == RUNNING_TAG
    assert cfg.base_wheels == dict(UPSTREAM_WHEELS.values())


@pytest.mark.parametrize("tag", sorted(UPSTREAM_WHEELS))
def test_base_wheel_is_chosen_by_interpreter(cfg, tag):
    cfg.python_tag = tag
    name, sha = UPSTREAM_WHEELS[tag]
    assert fork_build.base_wheel_name(cfg) == name
    assert cfg.base_wheels[name] == sha


@pytest.mark.parametrize("tag", ["cp310", "cp313"])
def test_unsupported_interpreter_has_no_wheel(cfg, tag):
    cfg.python_tag = tag
    with pytest.raises(fork_build.ForkBuildError, match=f"no pinned sglang 0.5.23 wheel for {tag}"):
        fork_build.base_wheel_name(cfg)


def test_fetched_wheel_is_the_running_interpreters_and_matches_its_pin(cfg):
    path = fork_build.fetch_base_wheel(cfg)
    name, sha = UPSTREAM_WHEELS[RUNNING_TAG]
    assert path.name == name
    assert fork_build._sha256(path) == sha


def test_series_applies_and_version_is_local(cfg, tmp_path):
    out = fork_build.build(cfg, tmp_path, log=lambda m: None)
    assert out.name.startswith(f"sglang-{cfg.base_version}+{cfg.local_version}-{RUNNING_TAG}-{RUNNING_TAG}-")
    with zipfile.ZipFile(out) as zf:
        names = set(zf.namelist())
        meta = zf.read(f"sglang-{cfg.version}.dist-info/METADATA").decode()
        record = zf.read(f"sglang-{cfg.version}.dist-info/RECORD").decode()
        version_py = zf.read("sglang/_version.py").decode()
    assert "sglang/srt/ray/actor_naming.py" in names
    assert f"Version: {cfg.version}\n" in meta
    assert 'Requires-Dist: ray[default]>=2.56.0; extra == "ray"' in meta
    assert 'Requires-Dist: nixl-cu13>=1.5.1; extra == "ray"' in meta
    assert "ray[default]>=2.55.1" not in meta  # upstream's requirement replaced
    assert f"__version__ = version = '{cfg.version}'" in version_py
    # RECORD lists every file with a hash (RECORD itself without).
    rows = list(csv.reader(io.StringIO(record)))
    assert {r[0] for r in rows} == names
    assert all(r[1].startswith("sha256=") for r in rows if not r[0].endswith("RECORD"))


def test_corrupted_patch_fails_naming_the_patch(cfg, tmp_path):
    patches = _copy_patches(tmp_path)
    victim = (patches / "series").read_text().split()[-1]
    lines = (patches / victim).read_text().split("\n")
    # Change the first context line of the first hunk: it no longer matches upstream.
    first_hunk = next(i for i, l in enumerate(lines) if l.startswith("@@"))
    ctx = next(i for i in range(first_hunk + 1, len(lines)) if lines[i].startswith(" "))
    lines[ctx] = " # this line is not in upstream"
    broken = "\n".join(lines)
    (patches / victim).write_text(broken)
    cfg.patches_dir = patches
    with pytest.raises(fork_build.ForkBuildError, match=f"patch {victim} does not apply"):
        fork_build.build(cfg, tmp_path / "out", log=lambda m: None)
    assert not list((tmp_path / "out").glob("*.whl"))


def test_series_naming_a_missing_patch_fails(cfg, tmp_path):
    patches = _copy_patches(tmp_path)
    with open(patches / "series", "a") as f:
        f.write("9999-missing.patch\n")
    cfg.patches_dir = patches
    with pytest.raises(fork_build.ForkBuildError, match="9999-missing.patch"):
        fork_build.build(cfg, tmp_path / "out", log=lambda m: None)


def test_module_overwriting_upstream_file_fails(cfg, tmp_path):
    modules = tmp_path / "sglang"
    shutil.copytree(REPO / "python" / "sglang", modules)
    (modules / "srt" / "ray" / "engine.py").write_text("# shadow\n")
    cfg.modules_dir = modules
    with pytest.raises(
        fork_build.ForkBuildError, match=r"sglang/srt/ray/engine\.py would overwrite the upstream file"
    ):
        fork_build.build(cfg, tmp_path / "out", log=lambda m: None)


@pytest.mark.parametrize("tag", sorted(UPSTREAM_WHEELS))
def test_wrong_sha256_is_refused(cfg, tmp_path, tag):
    cfg.python_tag = tag
    name, sha = UPSTREAM_WHEELS[tag]
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / name).write_bytes(b"not the wheel")
    cfg.cache_dir = cache
    with pytest.raises(fork_build.ForkBuildError, match=f"{name}: sha256 .* does not match the pinned {sha}"):
        fork_build.fetch_base_wheel(cfg)


def test_cli_exit_code_and_message_on_bad_patch(tmp_path):
    patches = _copy_patches(tmp_path)
    first = (patches / "series").read_text().split()[0]
    # A context line of its first hunk that upstream does not have.
    lines = (patches / first).read_text().split("\n")
    hunk = next(i for i, line in enumerate(lines) if line.startswith("@@"))
    ctx = next(i for i in range(hunk + 1, len(lines)) if lines[i][:1] in (" ", "-") and len(lines[i]) > 1)
    lines[ctx] = lines[ctx][0] + "XX" + lines[ctx][1:]
    (patches / first).write_text("\n".join(lines))
    proc = subprocess.run(
        [sys.executable, str(REPO / "python" / "fork_build.py"), "--out", str(tmp_path / "o"),
         "--patches-dir", str(patches)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1
    assert f"fork build failed: patch {first}" in proc.stderr


def test_installed_fork_reports_version_and_requirements(cfg):
    import sglang

    assert sglang.__version__ == cfg.version
    assert md.version("sglang") == cfg.version
    reqs = md.requires("sglang")
    ray_extra = [r for r in reqs if 'extra == "ray"' in r]
    assert any(r.startswith("ray[default]>=2.56.0") for r in ray_extra), ray_extra
    assert any(r.startswith("nixl-cu13") for r in ray_extra), ray_extra
    # And the environment has what the extra asks for.
    assert md.version("ray") == "2.60.0"
    assert md.version("nixl") == "1.5.1"
    assert md.version("nixl-cu13") == "1.5.1"


def test_installed_modules_come_from_this_tree():
    import sglang.srt.ray.actor_naming as mod

    ours = (REPO / "python" / "sglang" / "srt" / "ray" / "actor_naming.py").read_text()
    assert Path(mod.__file__).read_text() == ours, "installed fork is stale: run make install"
