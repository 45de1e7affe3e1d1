"""The `statecache` console script: `statecache demo ...` runs the demo (producer.demo), anything else is the
library's own CLI (statecache.cli: `statecache score`). It lives here so that the library never imports the demo."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:
        from producer.demo import main as demo_main

        return demo_main(argv[1:]) or 0
    from statecache.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
