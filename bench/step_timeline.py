"""Where a step's GPU sits idle: the gaps between kernels in a torch.profiler Chrome trace, and
what the host was doing when each gap ended.

    python bench/step_timeline.py TRACE.json --out DIR        # DIR/timeline.json, timeline.md

The GPU is busy when any kernel, copy or fill runs on any stream. A gap ends with the launch of
the next GPU event; when that launch (its `cuda_runtime` call, joined by correlation id) came
after the gap began, the GPU waited for the host, and the gap is charged to the innermost and
the outermost CPU operator around the launch (autograd's backward functions show as
`autograd::engine::evaluate_function: ...`). Otherwise it waited on a dependency (another
stream, an event, a copy). Host calls that block (synchronizations, blocking copies) are
listed with the operators around them. With only CUDA activity in the trace, the gaps are
still found and named by the kernels on either side.

Importing this module must stay cheap (no torch): it reads a trace file."""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
from collections import defaultdict
from pathlib import Path
from typing import Any, NamedTuple

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
BLOCKING = ("Synchronize", "cudaMemcpy ", "cudaMemcpy\0")


class Span(NamedTuple):
    start: float
    end: float
    name: str
    correlation: int | None


def _events(trace: dict[str, Any], categories: set[str]) -> list[dict[str, Any]]:
    return [
        e for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") in categories and "dur" in e
    ]  # fmt: skip


def _correlation(event: dict[str, Any]) -> int | None:
    value = event.get("args", {}).get("correlation")
    return int(value) if value is not None else None


class HostOps:
    """The CPU operators of each host thread, to find the ones around a timestamp."""

    def __init__(self, trace: dict[str, Any]) -> None:
        by_thread: dict[Any, list[Span]] = defaultdict(list)
        for e in _events(trace, {"cpu_op", "user_annotation"}):
            by_thread[e["tid"]].append(Span(e["ts"], e["ts"] + e["dur"], e["name"], None))
        self.threads = {tid: sorted(spans) for tid, spans in by_thread.items()}
        self.starts = {tid: [s.start for s in spans] for tid, spans in self.threads.items()}

    def around(self, tid: Any, ts: float) -> tuple[str, str]:
        """The outermost and the innermost operator running on `tid` at `ts`."""
        spans = self.threads.get(tid, [])
        last = bisect.bisect_right(self.starts.get(tid, []), ts)
        enclosing = [s for s in spans[:last] if s.end >= ts]
        if not enclosing:
            return "(no operator)", "(no operator)"
        return enclosing[0].name, enclosing[-1].name


class Busy(NamedTuple):
    """An interval in which some GPU event runs: the one that starts it, the one that ends it."""

    start: float
    end: float
    first: Span
    last: Span


def busy_intervals(spans: list[Span]) -> list[Busy]:
    merged: list[Busy] = []
    for span in sorted(spans):
        if merged and span.start <= merged[-1].end:
            if span.end > merged[-1].end:
                merged[-1] = merged[-1]._replace(end=span.end, last=span)
        else:
            merged.append(Busy(span.start, span.end, span, span))
    return merged


def timeline(trace: dict[str, Any], min_gap_us: float = 10.0, top: int = 40) -> dict[str, Any]:
    gpu = sorted(
        Span(e["ts"], e["ts"] + e["dur"], e["name"], _correlation(e))
        for e in _events(trace, GPU_CATEGORIES)
    )
    if not gpu:
        raise ValueError("the trace holds no GPU event (was CUDA activity profiled?)")
    launches = {
        c: e for e in _events(trace, {"cuda_runtime", "cuda_driver"})
        if (c := _correlation(e)) is not None
    }  # fmt: skip
    host = HostOps(trace)
    busy = busy_intervals(gpu)
    span_us = busy[-1].end - busy[0].start
    busy_us = sum(b.end - b.start for b in busy)
    gaps = []
    for previous, following in itertools.pairwise(busy):
        gap_start, gap_end = previous.end, following.start
        if gap_end - gap_start < min_gap_us:
            continue
        before, after = previous.last, following.first
        launch = launches.get(after.correlation) if after.correlation is not None else None
        gap: dict[str, Any] = {
            "start_us": gap_start - busy[0].start,
            "us": gap_end - gap_start,
            "before": before.name[:100],
            "after": after.name[:100],
        }
        if launch is not None:
            gap["host_bound"] = launch["ts"] > gap_start
            gap["outer"], gap["inner"] = host.around(launch["tid"], launch["ts"])
        gaps.append(gap)
    by_operator: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "us": 0.0})
    for gap in gaps:
        key = f"{gap.get('outer', '?')} > {gap.get('inner', '?')}"
        by_operator[key]["count"] += 1
        by_operator[key]["us"] += gap["us"]
    blocking = defaultdict(lambda: {"count": 0, "us": 0.0})
    for e in _events(trace, {"cuda_runtime"}):
        if any(b.strip("\0") in e["name"] for b in BLOCKING):
            outer, inner = host.around(e["tid"], e["ts"])
            key = f"{e['name']} in {outer} > {inner}"
            blocking[key]["count"] += 1
            blocking[key]["us"] += e["dur"]
    gap_us = sum(g["us"] for g in gaps)
    host_us = sum(g["us"] for g in gaps if g.get("host_bound"))
    return {
        "span_ms": span_us / 1e3,
        "busy_ms": busy_us / 1e3,
        "idle_ms": (span_us - busy_us) / 1e3,
        "gaps_over_min": len(gaps),
        "min_gap_us": min_gap_us,
        "gap_ms": gap_us / 1e3,
        "host_bound_gap_ms": host_us / 1e3,
        "by_operator": sorted(
            ({"operators": k, **v} for k, v in by_operator.items()), key=lambda r: -r["us"]
        )[:top],
        "largest_gaps": sorted(gaps, key=lambda g: -g["us"])[:top],
        "blocking_calls": sorted(
            ({"call": k, **v} for k, v in blocking.items()), key=lambda r: -r["us"]
        )[:top],
    }


def table(report: dict[str, Any], steps: int = 1) -> str:
    per = f" per step ({steps} steps)" if steps > 1 else ""
    lines = [
        f"GPU span {report['span_ms'] / steps:.2f} ms{per}, busy {report['busy_ms'] / steps:.2f}, "
        f"idle {report['idle_ms'] / steps:.2f}; gaps of {report['min_gap_us']:.0f} us or more: "
        f"{report['gap_ms'] / steps:.2f} ms, of which the host was late for "
        f"{report['host_bound_gap_ms'] / steps:.2f}",
        "",
        "| idle ms | gaps | host operator (outermost > innermost) at the next launch |",
        "| ---: | ---: | --- |",
    ]
    for row in report["by_operator"]:
        lines.append(
            f"| {row['us'] / 1e3 / steps:.2f} | {row['count'] / steps:.0f} | {row['operators'][:150]} |"
        )
    lines += [
        "",
        "| at ms | gap us | host late | before | after |",
        "| ---: | ---: | --- | --- | --- |",
    ]
    for gap in report["largest_gaps"]:
        lines.append(
            f"| {gap['start_us'] / 1e3:.2f} | {gap['us']:.0f} | {gap.get('host_bound', '?')} | "
            f"{gap['before'][:60]} | {gap['after'][:60]} |"
        )
    if report["blocking_calls"]:
        lines += ["", "| blocking host call | count | ms |", "| --- | ---: | ---: |"]
        for row in report["blocking_calls"]:
            lines.append(f"| {row['call'][:160]} | {row['count']} | {row['us'] / 1e3:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--steps", type=int, default=1, help="steps in the trace (per-step figures)"
    )
    parser.add_argument("--min-gap-us", type=float, default=10.0)
    args = parser.parse_args()
    report = timeline(json.loads(args.trace.read_text()), args.min_gap_us)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "timeline.json").write_text(json.dumps(report, indent=1) + "\n")
    text = table(report, args.steps)
    (args.out / "timeline.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
