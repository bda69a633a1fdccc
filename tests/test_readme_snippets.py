"""README's "See the cache work" snippet, run verbatim against a real daemon with an SSD store (its
address from V4SERVE_URL, which the snippet reads): what it prints is what README says it prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.daemon import PATIENCE, ROOT, daemon


def snippet(name: str) -> str:
    readme = (ROOT / "README.md").read_text()
    found = re.search(rf"<!-- readme-snippet:{name} -->\n```python\n(.*?)```", readme, re.S)
    assert found, f"README lost its {name} snippet"
    return found.group(1)


def test_the_cache_snippet_prints_what_readme_says(tmp_path) -> None:
    with daemon("--kv-store-dir", str(tmp_path / "store")) as url:
        done = subprocess.run([sys.executable, "-c", snippet("cache")], capture_output=True, text=True,
                              timeout=PATIENCE, env={**os.environ, "V4SERVE_URL": url})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "0 2688" and lines[1] == "2688 True"
    assert 'source="device"' in lines[2] and 'source="disk"' in lines[2]
    cached, first_turn = lines[3].split()
    assert cached == first_turn
    assert lines[4] == "0"
