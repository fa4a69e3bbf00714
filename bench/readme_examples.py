"""The README's fenced examples, parsed: each block with its `<!-- example: KIND NOTE -->` mark, and the command
lines of a block.

The one parser of README.md's examples: tests/test_readme.py runs the `cpu` blocks and checks every block is
marked; bench/gpu_check.py --readme runs the `gpu` blocks. It only reads the README (standard library only); it
runs nothing.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"(?:<!-- example: (\w+)([^>]*?)-->\n)?```(\w*)\n(.*?)```", re.S)


def blocks(readme: Path = README) -> list[tuple[int, str | None, str, str, str]]:
    """(line, kind, note, language, code) of every fenced block, in order (kind None: no mark)."""
    text = readme.read_text()
    return [(text[:m.start()].count("\n") + 1, m.group(1), m.group(2).strip(), m.group(3), m.group(4))
            for m in _BLOCK.finditer(text)]


def commands(code: str) -> list[list[str]]:
    """The argv of each command line of a shell block, comments and blank lines dropped."""
    return [argv for line in code.splitlines() if (argv := shlex.split(line, comments=True))]


def gpu_commands(readme: Path = README) -> list[list[str]]:
    """The command lines of the blocks marked `<!-- example: gpu -->`, in order."""
    return [argv for _, kind, _, _, code in blocks(readme) if kind == "gpu" for argv in commands(code)]
