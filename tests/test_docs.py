"""Every example in the README and in docs/ runs as written: an example that stops working fails
the build.

Python blocks of one page run in order in one fresh interpreter (a page's later blocks may use
its earlier ones' names), in a temporary folder; command lines (``memfit ...`` in bash blocks) run
in order in one temporary folder. The README's first block is the setup that ``.ci/run`` runs
itself (install, demo, test suite).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)
SETUP_COMMANDS = ("python3 -m pip install", "python3 -m pytest")
ENVIRONMENT = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's memfit, from any folder


def blocks(page: Path, language: str) -> list[str]:
    """The fenced code blocks of ``page`` in ``language``, in order."""
    return [body for found, body in FENCE.findall(page.read_text(encoding="utf-8"))
            if found == language]


def command_lines(page: Path) -> list[str]:
    """The ``memfit`` command lines of ``page``'s bash blocks, comments dropped, setup left out."""
    lines = []
    for block in blocks(page, "bash"):
        for line in block.splitlines():
            command = line.split("  #")[0].strip()
            if command.startswith("memfit ") and not command.startswith(SETUP_COMMANDS):
                lines.append(command)
    return lines


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200
    assert lines[3].startswith(SETUP_COMMANDS[0]) and lines[3].endswith("memfit demo")
    assert lines[4] == "python3 -m pytest -q"


def test_every_page_the_readme_links_exists():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        assert (ROOT / target).exists(), target


SOURCE_REFERENCE = re.compile(r"`([\w/]+\.py)(?:::\w+)?`")  # `lowering/rewrite.py::rewrite`


def test_every_source_file_the_pages_name_exists():
    """A file named in the README or docs/ (``lowering/rewrite.py``, a path from the checkout's
    root or from a folder of ``memfit/``) is there: a moved module takes its pages along."""
    files = [path.relative_to(ROOT).as_posix() for folder in ("memfit", "tests", "bench")
             for path in (ROOT / folder).rglob("*.py")]
    missing = [f"{page.name}: {name}" for page in PAGES
               for name in SOURCE_REFERENCE.findall(page.read_text(encoding="utf-8"))
               if not any(file == name or file.endswith("/" + name) for file in files)]
    assert missing == []


def test_there_are_examples_to_run():
    assert sum(len(blocks(page, "python")) for page in PAGES) >= 8
    assert len([line for page in PAGES for line in command_lines(page)]) >= 5


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p, "python")],
                         ids=lambda page: page.name)
def test_python_examples_run(page, tmp_path):
    script = "\n\n".join(blocks(page, "python"))
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=900, env=ENVIRONMENT)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if command_lines(p)],
                         ids=lambda page: page.name)
def test_command_lines_run(page, tmp_path):
    for command in command_lines(page):
        arguments = command.split()
        done = subprocess.run([sys.executable, "-m", "memfit.cli", *arguments[1:]], cwd=tmp_path,
                              capture_output=True, text=True, timeout=900, env=ENVIRONMENT)
        assert done.returncode == 0, f"{command}\n{done.stderr[-4000:]}"
