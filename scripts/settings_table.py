"""Write the README's settings table from the serve config's fields (``trio_gym/config.py``).

    python scripts/settings_table.py          # rewrite the table in README.md

The fields are the one source: their :class:`~trio_gym.config.Setting` (variable, flag), their
defaults and descriptions. ``tests/test_config.py`` fails while the README says otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trio_gym.config import settings_table  # noqa: E402

BEGIN = "<!-- settings: from trio_gym/config.py by scripts/settings_table.py -->\n"
END = "<!-- settings end -->\n"


def table_in(readme: str) -> tuple[int, int]:
    """Where the table between the markers starts and ends in ``readme``."""
    start = readme.index(BEGIN) + len(BEGIN)
    return start, readme.index(END, start)


def main() -> int:
    path = ROOT / "README.md"
    readme = path.read_text(encoding="utf-8")
    start, end = table_in(readme)
    path.write_text(readme[:start] + settings_table() + readme[end:], encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
