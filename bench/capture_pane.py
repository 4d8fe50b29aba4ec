"""Render one console pane headless and save it as SVG (for machines without tmux).

    python bench/capture_pane.py --pane 2 --out hardware.svg [--db PATH] [--size 120x40]

Pane keys are the console's number keys (1 Overview, 2 Hardware, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path


async def capture(db: str, pane: str, size: tuple[int, int], out: Path) -> None:
    from ddtree.console.app import make_app

    app = make_app(db)
    async with app.run_test(size=size) as pilot:
        await pilot.pause(1.0)
        await pilot.press(pane)
        await pilot.pause(3.0)  # the hardware view loads in a worker
        out.write_text(app.export_screenshot())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pane", default="2")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--db", default=None)
    parser.add_argument("--size", default="120x40")
    args = parser.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    db = args.db or str(Path(tempfile.mkdtemp(prefix="capture-")) / "ddtree.db")
    asyncio.run(capture(db, args.pane, (width, height), args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
