"""What `tgq bench` shows of its records: the run's summary (throughputs, latency percentiles,
goodput, failures), the printed table, the JSON file and the PNG plots. The metrics are those of
`cli.bench.records`, after vLLM's `benchmark_serving`.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from tgq.cli import CommandError
from tgq.cli.bench.records import RequestRecord

PERCENTILES = (50, 90, 99)
SLO_NAMES = {"ttft": "ttft", "tpot": "tpot", "e2e": "e2e", "e2el": "e2e"}  # e2el: vLLM's name
UNITS_S = {"ms": 1e-3, "s": 1.0, "": 1e-3}  # a bare number is milliseconds, as vLLM's --goodput
PLOT_SIZE_IN = (8, 5)  # 800x500 pixels at PLOT_DPI
PLOT_DPI = 100
Summary = dict[str, Any]


def parse_slos(text: str) -> dict[str, float]:
    """`ttft=500ms,tpot=50ms,e2e=2s` (or vLLM's `ttft:500 tpot:50`, in ms) -> seconds by name."""
    slos = {}
    for item in re.split(r"[,\s]+", text.strip()):
        match = re.fullmatch(r"(\w+)[=:]([0-9.]+)(ms|s|)", item)
        if match is None or match[1] not in SLO_NAMES:
            raise ValueError(f"expected ttft|tpot|e2e=VALUE[ms|s], got {item!r}")
        slos[SLO_NAMES[match[1]]] = float(match[2]) * UNITS_S[match[3]]
    return slos


def stats_ms(values_s: list[float]) -> dict[str, float | None]:
    """Mean and percentiles in milliseconds (numpy's linear interpolation, as vLLM)."""
    names = [f"p{p}" for p in PERCENTILES]
    if not values_s:
        return dict.fromkeys(["mean", *names])
    values_ms = np.asarray(values_s) * 1e3
    points = np.percentile(values_ms, PERCENTILES).tolist()
    return {"mean": float(values_ms.mean()), **dict(zip(names, points, strict=True))}


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """A completed request within every SLO. One output token has no TPOT and meets a TPOT SLO
    (vLLM counts its TPOT as 0); a request with no content chunk has no TTFT and misses one."""
    values = {
        "ttft": record.ttft_s,
        "tpot": record.tpot_s if record.output_tokens > 1 else 0.0,
        "e2e": record.e2e_s,
    }
    return record.is_ok and all(
        (value := values[name]) is not None and value <= limit for name, limit in slos.items()
    )


def failure_key(record: RequestRecord) -> str:
    """A failure's HTTP status when the server refused (`429`), else its error text."""
    if record.status is not None and record.status != 200:
        return str(record.status)
    return record.error or "unknown"


def throughput_over_time(records: list[RequestRecord], bucket_s: float = 1.0) -> list[float]:
    """Output tokens/s in each `bucket_s` window from the run's start; each completed request's
    tokens are spread evenly over its content chunks (one OpenAI chunk may carry several)."""
    counts: defaultdict[int, float] = defaultdict(float)
    for record in records:
        times = record.content_times_s()
        if record.is_ok and times:
            for at in times:
                counts[int(at // bucket_s)] += record.output_tokens / len(times)
    num_buckets = max(counts) + 1 if counts else 0
    return [counts[i] / bucket_s for i in range(num_buckets)]


def summarize(records: list[RequestRecord], duration_s: float, slos: dict[str, float]) -> Summary:
    done = [r for r in records if r.is_ok]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    num_good = sum(meets_slos(r, slos) for r in done)
    return {
        "duration_s": duration_s,
        "num_requests": len(records),
        "num_completed": len(done),
        "num_failed": len(records) - len(done),
        "failures": dict(Counter(failure_key(r) for r in records if not r.is_ok)),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "slos_ms": {name: limit * 1e3 for name, limit in slos.items()},
        "num_good": num_good if slos else None,
        "goodput": num_good / duration_s if slos else None,
        "ttft_ms": stats_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": stats_ms([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_ms": stats_ms([gap for r in done for gap in r.itl_s]),
        "e2e_ms": stats_ms([r.e2e_s for r in done if r.e2e_s is not None]),
        "output_tokens_per_s_by_second": throughput_over_time(records),
    }


def format_summary(summary: Summary, context: list[tuple[str, str]]) -> str:
    """The run as one table: `context` rows (what ran), counts and rates, then latencies."""
    s = summary
    rows = [
        *context,
        ("requests", f"{s['num_completed']} completed, {s['num_failed']} failed"),
        ("duration", f"{s['duration_s']:.2f} s"),
        ("request rate", f"{s['request_throughput']:.2f} req/s"),
        ("input tokens", f"{s['total_input_tokens']}"),
        ("output tokens", f"{s['total_output_tokens']}  ({s['output_throughput']:.1f} tok/s)"),
        ("total tokens", f"{s['total_input_tokens'] + s['total_output_tokens']}"
         f"  ({s['total_token_throughput']:.1f} tok/s)"),
    ]  # fmt: skip
    if s["goodput"] is not None:
        slos = " ".join(f"{name}<={limit:g}ms" for name, limit in s["slos_ms"].items())
        rows.append(("goodput", f"{s['goodput']:.2f} req/s, {s['num_good']} good ({slos})"))
    if s["failures"]:
        rows.append(("failures", ", ".join(f"{k}: {n}" for k, n in s["failures"].items())))
    lines = [f"{label:<15} {value}" for label, value in rows]
    columns = ("mean", *(f"p{p}" for p in PERCENTILES))
    header = f"{'latency (ms)':<15}" + "".join(f"{name:>10}" for name in columns)
    lines += ["-" * len(header), header]
    for name in ("ttft", "tpot", "itl", "e2e"):
        values = s[f"{name}_ms"].values()
        lines.append(f"{name.upper():<15}" + "".join(_cell(v) for v in values))
    rule = "=" * len(header)
    return "\n".join([rule, *lines, rule])


def _cell(value: float | None) -> str:
    return f"{'-':>10}" if value is None or math.isnan(value) else f"{value:>10.2f}"


def write_json(
    path: Path, config: dict[str, Any], summary: Summary, records: list[RequestRecord]
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    result = {"config": config, "summary": summary, "requests": [r.as_json() for r in records]}
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


def require_matplotlib() -> None:
    """Fails before the run, not after it, when the plots cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CommandError(
            "--plot-dir needs matplotlib: pip install 'tgq[bench]' (or pip install matplotlib)"
        ) from None


def write_plots(plot_dir: Path, records: list[RequestRecord], summary: Summary) -> list[Path]:
    """`latency_cdf.png` (TTFT, TPOT, E2E) and `throughput.png` (output tokens/s per second)."""
    from matplotlib.figure import Figure

    plot_dir.mkdir(parents=True, exist_ok=True)
    done = [r for r in records if r.is_ok]
    cdf = Figure(figsize=PLOT_SIZE_IN, dpi=PLOT_DPI)
    axes = cdf.add_subplot()
    for name, values in (
        ("TTFT", [r.ttft_s for r in done]),
        ("TPOT", [r.tpot_s for r in done]),
        ("E2E", [r.e2e_s for r in done]),
    ):
        points_ms = np.sort([v * 1e3 for v in values if v is not None])
        if points_ms.size:
            fractions = np.arange(1, points_ms.size + 1) / points_ms.size
            axes.step(points_ms, fractions, where="post", label=name)
    axes.set(xscale="log", xlabel="latency (ms)", ylabel="fraction of requests", ylim=(0, 1.02))
    axes.set_title("latency CDF")
    axes.grid(alpha=0.3)
    axes.legend()
    over_time = Figure(figsize=PLOT_SIZE_IN, dpi=PLOT_DPI)
    axes = over_time.add_subplot()
    rates = summary["output_tokens_per_s_by_second"]
    axes.bar(np.arange(len(rates)), rates, width=1.0, align="edge")
    axes.set(xlabel="time since start (s)", ylabel="output tokens/s (1 s buckets)")
    axes.set_title("output throughput over time")
    axes.grid(alpha=0.3)
    paths = [plot_dir / "latency_cdf.png", plot_dir / "throughput.png"]
    for figure, path in zip((cdf, over_time), paths, strict=True):
        figure.tight_layout()
        figure.savefig(path)
    return paths
