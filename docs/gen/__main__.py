"""`python -m docs.gen`: rewrite the generated reference blocks; `--check`: exit 1 naming the stale ones."""

from __future__ import annotations

import argparse
import sys

from docs.gen import COMMAND, DOCS, stale, write


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page is out of date")
    args = parser.parse_args(argv)
    pages = stale() if args.check else write()
    for g in pages:
        verb = "out of date" if args.check else "rewritten"
        print(f"{g.page.relative_to(DOCS.parent)}: {g.name} {verb}")
    if args.check and pages:
        print(f"run `{COMMAND}` and commit the pages", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
