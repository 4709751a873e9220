"""Slow readers behind upstreams whose chunks differ in a field with no content.

Four readers taking 2 KiB per 100 ms through a 4 KiB receive buffer, each of a
5,000-token answer generated at one token per millisecond, side by side in one
run, through:

- nginx (``proxy_buffering off``): what a client gets without tokenwire;
- tokenwire with the per-chunk stamp (``system_fingerprint``, as a gateway
  stamps each chunk with its own time) *not* listed: every chunk is a barrier;
- tokenwire with it listed in ``--volatile-chunk-fields``: chunks merge;
- tokenwire behind an upstream that sends OpenAI's ``obfuscation`` padding
  instead (the default volatile field).

It reports, per target, how late the last token arrived after the upstream
finished generating (median and worst of the four) and whether every reader
got the exact text. ``python bench/slow_reader_bench.py [--events N]``; the
figures go to docs/perf/slow-readers.md (the latest headline to bench/README.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testbed/
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sidecar_bench import client

from testbed.targets import fake_upstream, free_port, nginx, sidecar


def slow(port: int, upstream_port: int, events: int, *extra: str) -> dict[str, Any]:
    result = client("slow", port, upstream_port, "--streams", "4", "--events", str(events),
                    "--read-bytes", "2048", "--read-pause-ms", "100", "--rcvbuf", "4096", *extra,
                    timeout_s=900)
    rows = result["streams"]
    late = [row["last_token_after_generation_s"] for row in rows if row["complete"]]
    return {"complete": sum(row["complete"] for row in rows), "readers": len(rows),
            "last_token_after_generation_s": {"median": statistics.median(late), "max": max(late)}
            if late else None,
            "exact_text": all(row["exact_text"] for row in rows if row["complete"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "slow_reader.json"))
    args = parser.parse_args(argv)
    upstream_port = free_port()
    results: dict[str, Any] = {}
    with fake_upstream(upstream_port):
        port = free_port()
        with nginx(port, upstream_port):
            results["nginx_stamped"] = slow(port, upstream_port, args.events)
        for name, volatile, extra in (
                ("tokenwire_stamp_not_listed", "obfuscation", ()),
                ("tokenwire_stamp_listed", "system_fingerprint,obfuscation", ()),
                ("tokenwire_obfuscation_default", "obfuscation", ("--obfuscate",))):
            port = free_port()
            with sidecar(port, upstream_port, admin=False, flags=("--volatile-chunk-fields", volatile)):
                results[name] = slow(port, upstream_port, args.events, *extra)
            print(name, json.dumps(results[name]), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
