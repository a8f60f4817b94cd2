"""Render `sits-trace top` to SVG from a running daemon (docs/top.svg).

Usage: scripts/top_screenshot.py SOCKET OUT.svg [FILTER]
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from sits_trace.agent.top import DaemonSource, make_app


async def shoot(sock: str, out: Path, flt: str) -> None:
    app = make_app(DaemonSource(sock), interval_s=60, filter_text=flt)
    async with app.run_test(size=(130, 24)) as pilot:
        await pilot.pause(0.5)
        out.write_text(app.export_screenshot(title="sits-trace top"))


if __name__ == "__main__":
    asyncio.run(shoot(sys.argv[1], Path(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else ""))
