"""Build the sglang RDT fork wheel from the pinned upstream wheel.

PyPI carries no sdist for sglang 0.5.23, only binary wheels, so the fork is made
from the released wheel's contents:

1. fetch ``sglang==<base-version>`` for the running interpreter and check its
   sha256 against ``[tool.sglang-fork.base-wheels]`` in ``pyproject.toml``;
2. unpack it and apply ``patches/series`` in order; a patch that does not apply
   exactly (no fuzz) fails the build and names the patch;
3. add the modules under ``python/sglang/``; a module that would replace an
   upstream file fails the build (upstream files change only through patches);
4. set the local version (``0.5.23+rdt.1``), replace the requirements of the
   extras named in ``[tool.sglang-fork.extras]``, regenerate RECORD and repack.

It uses the standard library only, and doubles as an in-tree PEP 517 backend so
``pip install ./python`` builds the same wheel.

    python python/fork_build.py --out dist
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

PYTHON_DIR = Path(__file__).resolve().parent
REPO_ROOT = PYTHON_DIR.parent
DEFAULT_CACHE = Path(
    os.environ.get("SGLANG_FORK_CACHE", Path.home() / ".cache" / "sglang-fork")
)


class ForkBuildError(RuntimeError):
    """The fork cannot be built; the message says which input is at fault."""


@dataclass
class ForkConfig:
    base_version: str
    local_version: str
    base_wheels: Dict[str, str]
    extras: Dict[str, List[str]]
    # entry-point group -> {name: "module:function"}, added to entry_points.txt
    entry_points: Dict[str, Dict[str, str]] = field(default_factory=dict)
    patches_dir: Path = REPO_ROOT / "patches"
    modules_dir: Path = PYTHON_DIR / "sglang"
    cache_dir: Path = DEFAULT_CACHE
    python_tag: str = field(
        default_factory=lambda: f"cp{sys.version_info.major}{sys.version_info.minor}"
    )

    @property
    def version(self) -> str:
        return f"{self.base_version}+{self.local_version}"

    @classmethod
    def load(cls, pyproject: Path = PYTHON_DIR / "pyproject.toml", **overrides):
        with open(pyproject, "rb") as f:
            data = tomllib.load(f)
        tool = data["tool"]["sglang-fork"]
        cfg = cls(
            base_version=tool["base-version"],
            local_version=tool["local-version"],
            base_wheels=dict(tool["base-wheels"]),
            extras={k: list(v) for k, v in tool.get("extras", {}).items()},
            entry_points={g: dict(v) for g, v in tool.get("entry-points", {}).items()},
        )
        expected = cfg.version
        if data["project"]["version"] != expected:
            raise ForkBuildError(
                f"pyproject.toml: project.version is {data['project']['version']!r} "
                f"but base-version+local-version is {expected!r}"
            )
        for key, value in overrides.items():
            if value is not None:
                setattr(cfg, key, Path(value) if key.endswith("_dir") else value)
        return cfg


# --------------------------------------------------------------------------- #
# 1. The pinned upstream wheel
# --------------------------------------------------------------------------- #
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def base_wheel_name(cfg: ForkConfig) -> str:
    for name in cfg.base_wheels:
        if f"-{cfg.python_tag}-{cfg.python_tag}-" in name:
            return name
    raise ForkBuildError(
        f"no pinned sglang {cfg.base_version} wheel for {cfg.python_tag}; "
        f"pinned: {sorted(cfg.base_wheels)}"
    )


def fetch_base_wheel(cfg: ForkConfig) -> Path:
    """Return the verified upstream wheel, downloading it into the cache once."""
    name = base_wheel_name(cfg)
    expected = cfg.base_wheels[name]
    cfg.cache_dir.mkdir(parents=True, exist_ok=True)
    path = cfg.cache_dir / name
    if not path.exists():
        with tempfile.TemporaryDirectory(dir=cfg.cache_dir) as tmp:
            cmd = [
                sys.executable, "-m", "pip", "download", "--no-deps",
                "--only-binary=:all:", "--disable-pip-version-check",
                f"sglang=={cfg.base_version}", "-d", tmp,
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            got = Path(tmp) / name
            if proc.returncode != 0 or not got.exists():
                raise ForkBuildError(
                    f"could not download {name}: {proc.stderr.strip()[-2000:]}"
                )
            os.replace(got, path)
    actual = _sha256(path)
    if actual != expected:
        raise ForkBuildError(
            f"{path}: sha256 {actual} does not match the pinned {expected}; "
            "delete the file if it is a broken download"
        )
    return path


# --------------------------------------------------------------------------- #
# 2. Patches
# --------------------------------------------------------------------------- #
def read_series(patches_dir: Path) -> List[Path]:
    series = patches_dir / "series"
    if not series.exists():
        return []
    out = []
    for line in series.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        path = patches_dir / line
        if not path.is_file():
            raise ForkBuildError(f"patches/series names {line!r}, which does not exist")
        out.append(path)
    return out


def apply_patches(tree: Path, patches: List[Path]) -> List[str]:
    """Apply each patch exactly (no fuzz, no offsets beyond what patch allows)."""
    touched: List[str] = []
    for patch in patches:
        base = ["patch", "-p1", "--batch", "--forward", "--fuzz=0", "-d", str(tree),
                "-i", str(patch)]
        check = subprocess.run(base + ["--dry-run"], capture_output=True, text=True)
        if check.returncode != 0:
            raise ForkBuildError(
                f"patch {patch.name} does not apply cleanly to sglang:\n"
                f"{(check.stdout + check.stderr).strip()}"
            )
        subprocess.run(base + ["--silent"], check=True)
        touched += re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), flags=re.M)
    return touched


# --------------------------------------------------------------------------- #
# 3. Our modules
# --------------------------------------------------------------------------- #
def overlay_modules(tree: Path, modules_dir: Path) -> List[str]:
    added = []
    for src in sorted(modules_dir.rglob("*")):
        if src.is_dir() or "__pycache__" in src.parts or src.suffix == ".pyc":
            continue
        rel = Path("sglang") / src.relative_to(modules_dir)
        dst = tree / rel
        if dst.exists():
            raise ForkBuildError(
                f"python/{rel} would overwrite the upstream file {rel}; "
                "change upstream files through a patch in patches/ instead"
            )
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
        added.append(str(rel))
    return added


def check_syntax(tree: Path, rel_paths: List[str]) -> None:
    for rel in rel_paths:
        if rel.endswith(".py"):
            src = (tree / rel).read_text()
            try:
                compile(src, rel, "exec")
            except SyntaxError as e:
                raise ForkBuildError(f"{rel}: syntax error after patching: {e}") from e


# --------------------------------------------------------------------------- #
# 4. Metadata, RECORD, repack
# --------------------------------------------------------------------------- #
def _rewrite_metadata(text: str, cfg: ForkConfig) -> str:
    lines = text.split("\n")
    out = []
    for line in lines:
        if line.startswith("Version: "):
            line = f"Version: {cfg.version}"
        elif line.startswith("Requires-Dist: ") and any(
            re.search(rf'extra == "{re.escape(extra)}"', line) for extra in cfg.extras
        ):
            continue  # replaced below
        out.append(line)
    # Insert the fork's extra requirements right after their Provides-Extra line.
    for extra, reqs in cfg.extras.items():
        header = f"Provides-Extra: {extra}"
        new = [f'Requires-Dist: {r}; extra == "{extra}"' for r in reqs]
        if header in out:
            i = out.index(header)
            out[i + 1 : i + 1] = new
        else:
            body = out.index("") if "" in out else len(out)
            out[body:body] = [header] + new
    return "\n".join(out)


def _record_line(tree: Path, rel: str) -> List[str]:
    data = (tree / rel).read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return [rel, f"sha256={digest.decode()}", str(len(data))]


def finalize_dist_info(tree: Path, cfg: ForkConfig) -> str:
    old = tree / f"sglang-{cfg.base_version}.dist-info"
    if not old.is_dir():
        raise ForkBuildError(f"{old.name} missing from the upstream wheel")
    new_name = f"sglang-{cfg.version}.dist-info"
    new = tree / new_name
    old.rename(new)

    meta = new / "METADATA"
    meta.write_text(_rewrite_metadata(meta.read_text(), cfg))
    if cfg.entry_points:
        eps = new / "entry_points.txt"
        text = eps.read_text() if eps.exists() else ""
        for group, entries in cfg.entry_points.items():
            text = text.rstrip("\n") + ("\n\n" if text.strip() else "") + f"[{group}]\n"
            text += "".join(f"{name} = {target}\n" for name, target in entries.items())
        eps.write_text(text)

    version_py = tree / "sglang" / "_version.py"
    text = version_py.read_text()
    text = re.sub(
        r"^__version__ = version = .*$",
        f"__version__ = version = {cfg.version!r}",
        text,
        flags=re.M,
    )
    text = re.sub(
        r"^__version_tuple__ = version_tuple = .*$",
        "__version_tuple__ = version_tuple = "
        + repr(tuple(int(p) for p in cfg.base_version.split(".")) + (cfg.local_version,)),
        text,
        flags=re.M,
    )
    version_py.write_text(text)

    files = sorted(
        str(p.relative_to(tree)) for p in tree.rglob("*") if p.is_file()
        and p.name != "RECORD"
    )
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for rel in files:
        writer.writerow(_record_line(tree, rel))
    writer.writerow([f"{new_name}/RECORD", "", ""])
    (new / "RECORD").write_text(buf.getvalue())
    return new_name


def repack(tree: Path, dist_info: str, out_path: Path) -> None:
    tmp = out_path.with_suffix(".tmp")
    files = sorted(p for p in tree.rglob("*") if p.is_file())
    # dist-info goes last, as wheel tools write it.
    files.sort(key=lambda p: p.relative_to(tree).parts[0] == dist_info)
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        for p in files:
            zf.write(p, str(p.relative_to(tree)))
    os.replace(tmp, out_path)


def build(cfg: ForkConfig, out_dir: Path, *, log=print) -> Path:
    base = fetch_base_wheel(cfg)
    patches = read_series(cfg.patches_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_path = out_dir / base.name.replace(
        f"sglang-{cfg.base_version}-", f"sglang-{cfg.version}-", 1
    )
    with tempfile.TemporaryDirectory(prefix="sglang-fork-") as tmp:
        tree = Path(tmp) / "wheel"
        with zipfile.ZipFile(base) as zf:
            zf.extractall(tree)
        touched = apply_patches(tree, patches)
        added = overlay_modules(tree, cfg.modules_dir)
        check_syntax(tree, touched + added)
        dist_info = finalize_dist_info(tree, cfg)
        repack(tree, dist_info, out_path)
    log(
        f"built {out_path} from {base.name}: {len(patches)} patch(es), "
        f"{len(added)} module file(s)"
    )
    return out_path


# --------------------------------------------------------------------------- #
# PEP 517 backend (pip install ./python)
# --------------------------------------------------------------------------- #
def get_requires_for_build_wheel(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    path = build(ForkConfig.load(), Path(wheel_directory), log=lambda m: print(m, file=sys.stderr))
    return path.name


def build_sdist(sdist_directory, config_settings=None):
    raise ForkBuildError("the fork has no sdist: it is built from the upstream wheel")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO_ROOT / "dist"), help="output directory")
    p.add_argument("--patches-dir", help="directory with series + *.patch")
    p.add_argument("--modules-dir", help="directory overlaid onto sglang/")
    p.add_argument("--cache-dir", help="where the upstream wheel is cached")
    args = p.parse_args(argv)
    try:
        cfg = ForkConfig.load(
            patches_dir=args.patches_dir,
            modules_dir=args.modules_dir,
            cache_dir=args.cache_dir,
        )
        build(cfg, Path(args.out))
    except ForkBuildError as e:
        print(f"fork build failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
