"""`python -m manual_train.docs`: write docs/diffs/, check them (--check), print the lesson budget (--stats), build
the static site (--html OUT). The command line sits here, above both manual_train.docs (the lessons) and
manual_train.site (which renders them), so that neither imports the other back."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from manual_train import docs, site
from manual_train.docs import REPO, existing_loops, page_path, problems, render, stats_table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m manual_train.docs", description=docs.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check; exit 1 on stale pages, unmarked lines, "
                        "comment blocks over 3 lines in marked hunks or loop docstrings over 15 lines")
    parser.add_argument("--stats", action="store_true", help="print the lesson budget table (diff sizes, lengths)")
    parser.add_argument("--html", metavar="OUT", type=Path, help="write the lessons as a static site to OUT (opens "
                        "offline: OUT/index.html); with --check, exit 1 when the site built in OUT is stale")
    args = parser.parse_args(argv)
    if args.stats:
        print(stats_table())
        return 0
    if args.check:
        files = site.render_site()
        found = problems() + site.site_problems(files=files)
        if args.html is not None:
            found += site.stale_files(args.html, files=files) if (args.html / "index.html").exists() else \
                [f"{args.html}: no site built there: run python -m manual_train.docs --html {args.html}"]
        print("\n".join(found) if found else "docs/diffs and the site are up to date and every loop change is marked")
        return 1 if found else 0
    if args.html is not None:
        if site.refusal(args.html):  # a folder of the user's own is never replaced by the site
            print(f"error: --html: {site.refusal(args.html)}", file=sys.stderr)
            return 2
        files = site.build(args.html)
        print(f"wrote {len(files)} files to {args.html} (open {args.html / 'index.html'})")
        for line in problems() + site.site_problems(files=files):
            print(f"warning: {line}", file=sys.stderr)
        return 0
    for loop in existing_loops():
        page = page_path(loop)
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(render(loop))
        print(f"wrote {page.relative_to(REPO)}")
    for line in problems():
        print(f"warning: {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
