"""Print one of the README's two first-screen commands, exactly as the README has it.

    python .ci/readme_commands.py demo    # the first line of the README's first bash block
    python .ci/readme_commands.py tests   # the second line

CI runs what this prints, so the README and CI cannot drift apart: change the command in the
README and CI runs the new one.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def first_screen_commands(text: str) -> list[str]:
    block = re.search(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)
    if block is None:
        raise SystemExit("README.md has no ```bash block")
    if text.count("\n", 0, block.start()) > 40:
        raise SystemExit("README.md's first bash block is not on its first screen (40 lines)")
    lines = [line.strip() for line in block.group(1).splitlines() if line.strip()]
    if len(lines) != 2:
        raise SystemExit(f"README.md's first bash block must hold two commands, has {len(lines)}")
    return lines


def main() -> None:
    names = ["demo", "tests"]
    if len(sys.argv) != 2 or sys.argv[1] not in names:
        raise SystemExit("usage: readme_commands.py demo|tests")
    print(first_screen_commands(README.read_text())[names.index(sys.argv[1])])


if __name__ == "__main__":
    main()
