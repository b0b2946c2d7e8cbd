"""Write patches/NAME from a pristine and an edited copy of the upstream wheel tree.

    python tools/make_patch.py NAME.patch HEADER_FILE PRISTINE EDITED FILE...

HEADER_FILE holds the upstream-style commit header (subject, blank line, why).
FILE paths are relative to the wheel root, e.g. sglang/srt/ray/engine.py.
"""
import subprocess
import sys
from pathlib import Path

name, header, a, b, *files = sys.argv[1:]
out = [Path(header).read_text().rstrip() + "\n\n"]
for f in files:
    p = subprocess.run(
        ["diff", "-u", "--label", f"a/{f}", "--label", f"b/{f}", f"{a}/{f}", f"{b}/{f}"],
        capture_output=True, text=True,
    )
    if p.returncode == 0:
        sys.exit(f"{f}: no change")
    out.append(p.stdout)
dest = Path(__file__).resolve().parent.parent / "patches" / name
dest.write_text("".join(out))
print(f"wrote {dest}")
