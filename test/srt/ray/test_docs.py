"""The docs' Python snippets run as written: every ```python block of README.md, and of docs/rdt_weight_sync.md in
order (one script: later blocks use what earlier ones made), as a trainer job of its own against a real CPU server
(sglang's model code, LoRA on) that knows only its URL (``ENGINE_URL``), the cluster (``RAY_ADDRESS``) and the
checkpoint (``MODEL_PATH``). What they did is then read back from the engine: versions, adapters, consistency.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
import requests

ROOT = Path(__file__).resolve().parents[3]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(path: Path) -> List[str]:
    return BLOCK.findall(path.read_text())


def test_every_doc_with_python_snippets_is_collected():
    """A guard for the runner below: the blocks are found, and each one compiles."""
    for name, least in (("README.md", 1), ("docs/rdt_weight_sync.md", 5)):
        blocks = python_blocks(ROOT / name)
        assert len(blocks) >= least, name
        for i, block in enumerate(blocks):
            compile(block, f"{name} block {i + 1}", "exec")


def _run(script: str, server, ray_head, tiny_model, tmp_path, name: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(script)
    env = {**os.environ, **ray_head.env, "RAY_ADDRESS": ray_head.address, "ENGINE_URL": server.url,
           "MODEL_PATH": str(tiny_model)}
    env.pop("SGLANG_RDT_API_KEY", None)
    proc = subprocess.run([sys.executable, str(path)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc.stdout


def _sync_status(server):
    return requests.get(f"{server.url}/weight_sync/status", timeout=60).json()


@pytest.mark.slow
def test_the_readme_snippet_runs_against_a_served_engine(lora_server, ray_head, tiny_model, tmp_path):
    out = _run("\n\n".join(python_blocks(ROOT / "README.md")), lora_server, ray_head, tiny_model, tmp_path,
               "readme")
    assert "tensors" in out
    st = _sync_status(lora_server)
    assert st["weights_consistent"] and st["weight_version"] == "readme-1", st


@pytest.mark.slow
def test_the_user_guide_snippets_run_in_order_against_a_served_engine(lora_server, ray_head, tiny_model, tmp_path):
    out = _run("\n\n".join(python_blocks(ROOT / "docs" / "rdt_weight_sync.md")), lora_server, ray_head,
               tiny_model, tmp_path, "user_guide")
    assert out.count("tensors") >= 4  # the summaries printed: two steps, HF, LoRA
    st = _sync_status(lora_server)
    assert st["weights_consistent"] and st["weight_version"] == "lora-1", st
    assert st["ranks"][0]["lora_adapters"]["policy"]["weight_version"] == "lora-1", st
