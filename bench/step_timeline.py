"""What each engine step held and how long it took, on the host and on the device, for a whole run.

`StepTimeline` wraps a ModelRunner's `launch` for the length of a `with` block. For every launched
step it records what the scheduler put in it (sequences, decode rows, prefill tokens, the context
tokens its attention reads), whether it replayed a CUDA graph, and when the host started and ended
the launch; on CUDA it also records an event as the launch starts and one as it ends, so after the
run each step's device time is known:
- span: start event -> end event, from the moment the stream reached the step (its predecessor done,
  or the host's launch begun, whichever came later) to its last queued kernel. A step whose host
  launch outlasted its kernels counts that wait in its span (host_launch_ms then reaches span_ms);
- gap: the previous step's end event -> this start event, the device idle before the step because
  the host had not begun launching it.
The spans and gaps of a run tile its device timeline, so `summarize` can say where a run's time
went by batch size: how much of it the long tail of a few sequences took, and how much the full
batches.

    python bench/step_timeline.py plot bench/out/gpu/timeline_512.json bench/gpu_step_timeline.png

(the JSON written by `python bench/gpu_offline_throughput.py --parts timeline`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Bins of running sequences per step: the tail (a few long requests left), the ramps, full batches.
DEFAULT_BINS = (1, 16, 64, 128, 256, 400, 10**9)


@dataclass
class StepRecord:
    seqs: int
    decode_rows: int
    prefill_tokens: int
    context_tokens: int  # keys the step's attention reads, summed over its sequences
    graphed: bool
    host_start_s: float  # since the timeline began
    host_launch_ms: float
    span_ms: float = 0.0
    gap_ms: float = 0.0


def composition(scheduled: Sequence[Any]) -> tuple[int, int, int]:
    """(decode rows, prefill tokens, context tokens) of one step's scheduled sequences: a decode
    row computes one token past its prompt; everything else is a prompt chunk (a recomputed
    preempted sequence's included)."""
    decode = prefill = context = 0
    for item in scheduled:
        seq, new = item.seq, item.num_new_tokens
        done = seq.num_computed_tokens + new
        context += done
        if new == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens:
            decode += 1
        else:
            prefill += new
    return decode, prefill, context


class StepTimeline:
    """with StepTimeline(runner) as timeline: ...run...; then timeline.finish() -> records."""

    def __init__(self, runner: Any, *, cuda_events: bool | None = None) -> None:
        import torch

        self.runner = runner
        self.records: list[StepRecord] = []
        self.cuda_events = torch.cuda.is_available() if cuda_events is None else cuda_events
        self._events: list[tuple[Any, Any]] = []
        self._launch: Callable[..., Any] | None = None
        self._origin = 0.0

    def __enter__(self) -> StepTimeline:
        import torch

        launch = self._launch = self.runner.launch
        graphs = getattr(self.runner, "step_graphs", None)
        self._origin = time.perf_counter()

        def timed_launch(scheduled: Any, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            replays = graphs.replays if graphs is not None else 0
            if self.cuda_events:
                begin = torch.cuda.Event(enable_timing=True)
                begin.record()
            result = launch(scheduled, *args, **kwargs)
            if self.cuda_events:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._events.append((begin, end))
            ended = time.perf_counter()
            decode, prefill, context = composition(scheduled)
            self.records.append(
                StepRecord(
                    seqs=len(scheduled),
                    decode_rows=decode,
                    prefill_tokens=prefill,
                    context_tokens=context,
                    graphed=graphs is not None and graphs.replays != replays,
                    host_start_s=started - self._origin,
                    host_launch_ms=(ended - started) * 1e3,
                )
            )
            return result

        self.runner.launch = timed_launch
        return self

    def __exit__(self, *exc: object) -> None:
        del self.runner.launch  # the instance attribute goes; the class's method shows again
        self.finish()

    def finish(self) -> list[StepRecord]:
        """Waits for the device and fills in each step's span and gap (CUDA only)."""
        if not self.cuda_events or not self._events:
            return self.records
        import torch

        torch.cuda.synchronize()
        previous_end = None
        for record, (begin, end) in zip(self.records, self._events, strict=True):
            record.span_ms = begin.elapsed_time(end)
            record.gap_ms = previous_end.elapsed_time(begin) if previous_end is not None else 0.0
            previous_end = end
        self._events = []
        return self.records


def summarize(records: Sequence[StepRecord], bins: Sequence[int] = DEFAULT_BINS) -> dict[str, Any]:
    """Per bin of running sequences [lo, hi): steps, tokens, and the device and host time they
    took, with each bin's share of the run's device time (spans + gaps)."""
    total_ms = sum(r.span_ms + r.gap_ms for r in records)
    rows = []
    for lo, hi in itertools.pairwise(bins):
        chosen = [r for r in records if lo <= r.seqs < hi]
        if not chosen:
            continue
        span = sum(r.span_ms for r in chosen)
        gap = sum(r.gap_ms for r in chosen)
        rows.append(
            {
                "seqs": f"{lo}-{hi - 1}" if hi < 10**9 else f">={lo}",
                "steps": len(chosen),
                "decode_tokens": sum(r.decode_rows for r in chosen),
                "prefill_tokens": sum(r.prefill_tokens for r in chosen),
                "graphed_steps": sum(r.graphed for r in chosen),
                "span_ms": span,
                "gap_ms": gap,
                "host_launch_ms": sum(r.host_launch_ms for r in chosen),
                "ms_per_step": (span + gap) / len(chosen),
                "share_of_device_time": (span + gap) / total_ms if total_ms else 0.0,
            }
        )
    return {
        "steps": len(records),
        "device_time_ms": total_ms,
        "gap_ms": sum(r.gap_ms for r in records),
        "bins": rows,
    }


def to_json(records: Sequence[StepRecord]) -> dict[str, list[Any]]:
    """Column lists (compact for thousands of steps)."""
    columns: dict[str, list[Any]] = {name: [] for name in StepRecord.__dataclass_fields__}
    for record in records:
        for name, value in asdict(record).items():
            columns[name].append(round(value, 4) if isinstance(value, float) else value)
    return columns


def from_json(columns: dict[str, list[Any]]) -> list[StepRecord]:
    names = list(StepRecord.__dataclass_fields__)
    rows = zip(*(columns[name] for name in names), strict=True)
    return [StepRecord(*values) for values in rows]


def format_summary(summary: dict[str, Any]) -> str:
    lines = [
        f"{summary['steps']} steps, device timeline {summary['device_time_ms'] / 1e3:.2f} s "
        f"(idle between steps {summary['gap_ms'] / 1e3:.2f} s)",
        "seqs      steps  decode  prefill  graphed  ms/step  host launch ms/step  share",
    ]
    for row in summary["bins"]:
        lines.append(
            f"{row['seqs']:<9} {row['steps']:>5} {row['decode_tokens']:>7} "
            f"{row['prefill_tokens']:>8} {row['graphed_steps']:>8} {row['ms_per_step']:>8.2f} "
            f"{row['host_launch_ms'] / row['steps']:>20.2f} {row['share_of_device_time']:>6.1%}"
        )
    return "\n".join(lines)


def floor_ms(
    records: Sequence[StepRecord],
    weight_bytes: float,
    bandwidth: float,
    kv_bytes_per_token: float,
    large_step_tokens: int = 4096,
) -> dict[str, Any]:
    """A floor under the run's own steps: each step reads every weight once (weight_bytes at
    bandwidth, bytes/s), computes its tokens no faster than the run's own largest steps did per
    token (they are matmul-bound), and reads its attention's keys and values (context tokens x
    kv_bytes_per_token at bandwidth); per bin of running sequences, measured against the floor."""
    large = [r for r in records if r.decode_rows + r.prefill_tokens >= large_step_tokens]
    if not large:
        raise ValueError(f"no step of {large_step_tokens}+ tokens to take the matmul rate from")
    s_per_token = (
        sum(r.span_ms + r.gap_ms for r in large)
        / 1e3
        / sum(r.decode_rows + r.prefill_tokens for r in large)
    )

    def floor_s(r: StepRecord) -> float:
        tokens = r.decode_rows + r.prefill_tokens
        weights_or_math = max(weight_bytes / bandwidth, tokens * s_per_token)
        return weights_or_math + r.context_tokens * kv_bytes_per_token / bandwidth

    rows = []
    for lo, hi in itertools.pairwise(DEFAULT_BINS):
        chosen = [r for r in records if lo <= r.seqs < hi]
        if chosen:
            rows.append(
                {
                    "seqs": f"{lo}-{hi - 1}" if hi < 10**9 else f">={lo}",
                    "measured_s": sum(r.span_ms + r.gap_ms for r in chosen) / 1e3,
                    "floor_s": sum(map(floor_s, chosen)),
                }
            )
    measured = sum(r.span_ms + r.gap_ms for r in records) / 1e3
    floor = sum(map(floor_s, records))
    return {
        "us_per_token_of_large_steps": s_per_token * 1e6,
        "measured_s": measured,
        "floor_s": floor,
        "fraction_of_floor": floor / measured,
        "bins": rows,
    }


def plot(result_path: Path, png_path: Path) -> None:
    """Per step over the run: device time (span + gap) and running sequences, eager steps marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(result_path.read_text())
    timeline = result["timeline"]
    records = from_json(timeline["steps"])
    clock = []
    elapsed = 0.0
    for r in records:
        elapsed += r.span_ms + r.gap_ms
        clock.append(elapsed / 1e3)
    fig, (ax_time, ax_seqs) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    graphed = [i for i, r in enumerate(records) if r.graphed]
    eager = [i for i, r in enumerate(records) if not r.graphed]
    for chosen, label, colour in ((graphed, "CUDA graph", "tab:blue"), (eager, "eager", "tab:red")):
        ax_time.scatter(
            [clock[i] for i in chosen],
            [records[i].span_ms + records[i].gap_ms for i in chosen],
            s=4,
            c=colour,
            label=label,
        )
    ax_time.set_yscale("log")
    ax_time.set_ylabel("device time per step (ms)")
    ax_time.legend(loc="upper right")
    ax_seqs.plot(clock, [r.seqs for r in records], lw=1.2, c="tab:blue")
    ax_seqs.set_ylabel("sequences in the step", color="tab:blue")
    ax_seqs.set_xlabel("device time since the first step (s)")
    ax_prefill = ax_seqs.twinx()
    ax_prefill.plot(clock, [r.prefill_tokens for r in records], lw=0.6, c="tab:orange")
    ax_prefill.set_ylabel("prompt tokens in the step", color="tab:orange")
    summary = timeline["summary"]
    device = result.get("device", {}).get("gpu", "GPU")
    tail = sum(row["share_of_device_time"] for row in summary["bins"] if row["seqs"] == "1-15")
    fig.suptitle(
        f"{device}: {summary['steps']} steps of the 1000-request run "
        f"(max_num_seqs {result['args']['max_num_seqs']})\nsteps with fewer than 16 sequences: "
        f"{tail:.0%} of the device time"
    )
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    plot_cmd = sub.add_parser("plot", help="plot a gpu_offline_throughput JSON's timeline")
    plot_cmd.add_argument("result", type=Path)
    plot_cmd.add_argument("png", type=Path)
    show = sub.add_parser("summary", help="print a gpu_offline_throughput JSON's timeline summary")
    show.add_argument("result", type=Path)
    bound = sub.add_parser("floor", help="the run's steps against a floor (see floor_ms)")
    bound.add_argument("result", type=Path)
    bound.add_argument("--weights-gb", type=float, default=16.06, help="Llama-3.1-8B in bf16")
    bound.add_argument(
        "--bandwidth-tb-s",
        type=float,
        help="default: the device-to-device copy rate of the JSON's single-stream part",
    )
    bound.add_argument("--kv-bytes-per-token", type=float, default=131072, help="8B, bf16")
    args = p.parse_args(argv)
    if args.command == "plot":
        plot(args.result, args.png)
        print(f"wrote {args.png}")
    elif args.command == "floor":
        result = json.loads(args.result.read_text())
        bandwidth = args.bandwidth_tb_s
        if bandwidth is None:
            bandwidth = result["single_stream"]["copy_bandwidth_gb_s"] / 1e3
        records = from_json(result["timeline"]["steps"])
        found = floor_ms(records, args.weights_gb * 1e9, bandwidth * 1e12, args.kv_bytes_per_token)
        print(json.dumps(found, indent=2))
    else:
        timeline = json.loads(args.result.read_text())["timeline"]
        print(format_summary(timeline["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
