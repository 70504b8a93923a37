"""bench/serve_bench.py and bench/common/: dataset, arrivals and statistics, and one tiny run on
the real server."""

from __future__ import annotations

import importlib
import importlib.util
import math
import socket
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from kvpilot.engine.server.inprocess import InProcessServer

BENCH = Path(__file__).resolve().parents[2] / "bench" / "serve_bench.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("serve_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_bench"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dataset(bench: ModuleType) -> ModuleType:
    return importlib.import_module("common.dataset")  # bench/ is on sys.path (serve_bench)


@pytest.fixture(scope="module")
def stats(bench: ModuleType) -> ModuleType:
    return importlib.import_module("common.stats")


@pytest.fixture(scope="module")
def client(bench: ModuleType) -> ModuleType:
    return importlib.import_module("common.client")


@pytest.fixture(scope="module")
def peer(bench: ModuleType) -> ModuleType:
    return importlib.import_module("common.peer")


@pytest.fixture(scope="module")
def offline_workers(bench: ModuleType) -> ModuleType:
    return importlib.import_module("common.offline_workers")


def test_dataset_is_seeded_and_within_the_documented_ranges(dataset: ModuleType) -> None:
    a = dataset.synthetic_dataset(200, 100, 20, 0.5, 30, seed=7)
    assert a == dataset.synthetic_dataset(200, 100, 20, 0.5, 30, seed=7)
    assert a != dataset.synthetic_dataset(200, 100, 20, 0.5, 30, seed=8)
    assert all(50 <= r.input_len <= 150 and 10 <= r.output_len <= 30 for r in a)
    assert all(len(r.text.split()) == r.input_len for r in a)
    assert len({r.prefix for r in a}) == 1 and len(a[0].prefix.split()) == 30
    assert abs(statistics.fmean(r.input_len for r in a) - 100) < 8


def test_poisson_arrivals_have_the_requested_rate(dataset: ModuleType) -> None:
    offsets = dataset.arrival_offsets(4000, 5.0, seed=0)
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert abs(len(offsets) / offsets[-1] - 5.0) < 0.3
    assert dataset.arrival_offsets(3, math.inf, seed=0) == [0.0, 0.0, 0.0]


def test_percentiles_interpolate_like_numpy(stats: ModuleType) -> None:
    assert stats.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert stats.percentile([5.0], 99) == 5.0
    assert stats.percentile(list(range(101)), 99) == 99.0


async def test_a_tiny_run_against_the_real_server(
    dataset: ModuleType,
    client: ModuleType,
    server: InProcessServer,
) -> None:
    requests = dataset.synthetic_dataset(4, 8, 4, 0.5, 0, seed=1)
    for endpoint in ("completions", "chat"):
        run = await client.run_workload(
            server.url, endpoint, requests, 50.0, 2, seed=1, show_progress=False
        )
        s = run.report()["summary"]
        assert s["completed"] == 4 and s["failed"] == 0
        assert s["total_output_tokens"] == sum(r.output_len for r in requests)
        assert s["ttft_ms"]["p50"] > 0 and s["e2e_ms"]["p99"] >= s["ttft_ms"]["p99"]
        assert s["request_throughput"] > 0
        assert s["server_metrics_delta"]["vllm:generation_tokens_total"] == s["total_output_tokens"]
        # This process's CPU time over the run (here the in-process server's too), reported.
        assert s["client_cpu_s"] > 0


async def test_a_refused_request_is_recorded_not_raised(
    client: ModuleType,
    server: InProcessServer,
) -> None:
    """An HTTP error answer (here a 400 for a prompt of the wrong type) becomes the request's
    error, with the status, and the run goes on."""
    result = client.RequestResult(0)
    stream = client.StreamClient(server.url)
    body = {"model": "x", "prompt": {"not": "a prompt"}, "max_tokens": 2, "stream": True}
    await client.send(stream, "/v1/completions", body, result, 0.0)
    stream.close()
    assert not result.ok and result.error.startswith("HTTP 400") and result.ttft == 0.0
    assert "prompt" in result.error  # the answer's body, kept


async def test_an_error_event_mid_stream_is_recorded(client: ModuleType) -> None:
    """A stream that ends in an error event (replayed: what a server writes when its engine dies
    mid-request) is a failed request with that error, not a success with fewer tokens."""
    events = [
        b'{"choices":[{"index":0,"text":"a"}]}',
        b'{"error":{"message":"engine died","type":"server_error"}}',
        b"[DONE]",
    ]

    class Replay:
        async def post(
            self, path: str, body: bytes, on_event: Callable[[bytes, float], None]
        ) -> tuple[int, bytes]:
            for event in events:
                on_event(event, time.perf_counter())
            return 200, b""

    result = client.RequestResult(0)
    await client.send(Replay(), "/v1/completions", {}, result, 0.0)
    assert not result.ok and "engine died" in result.error and result.ttft > 0


def test_the_prompt_is_what_the_request_body_sends(dataset: ModuleType) -> None:
    req = dataset.synthetic_dataset(1, 6, 4, 0.0, 3, seed=2)[0]
    body = dataset.request_body(req, "completions", "m")
    assert (
        body["prompt"] == dataset.request_prompt(req, "completions") == f"{req.prefix} {req.text}"
    )
    chat = dataset.request_body(req, "chat", "m")["messages"]
    assert chat == dataset.request_prompt(req, "chat")
    assert chat == [
        {"role": "system", "content": req.prefix},
        {"role": "user", "content": req.text},
    ]


def test_the_vllm_env(peer: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/kvpilot/only")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    env = peer.vllm_env("/v/bin/python", ["LD_PRELOAD=/x.so"])
    assert "PYTHONPATH" not in env and env["PATH"].startswith("/v/bin:")
    assert env["VIRTUAL_ENV"] == "/v" and env["LD_PRELOAD"] == "/x.so"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(peer.os, "sched_getaffinity", lambda pid: {5, 0, 2, 1})
    assert peer.vllm_env("/v/bin/python", [])["VLLM_CPU_OMP_THREADS_BIND"] == "0-2,5"


def _run(system: str, rnd: int, tok_s: float, ttft: float) -> dict:
    summary = {
        "output_throughput": tok_s,
        "ttft_ms": {"p50": ttft},
        "itl_ms": {"p50": 10.0},
        "health_ms": {"p50": 1.0, "p99": 4.0 * rnd, "max": 9.0},
        "failed": 0,
        "total_input_tokens": 1000 + rnd,
        "total_output_tokens": 2000,
        "api_cpu_s": (0.2 if system == "kvpilot" else 0.5) * rnd,
    }
    return {"dtype": "float32", "concurrency": 16, "round": rnd, "system": system,
            "summary": summary}  # fmt: skip


def test_the_peer_summary_takes_medians_and_pairs_rounds(peer: ModuleType) -> None:
    serving = [
        _run("kvpilot", 1, 110.0, 50.0),
        _run("vllm", 1, 100.0, 100.0),
        _run("vllm", 2, 50.0, 100.0),  # a slow round for both: the ratio stays paired
        _run("kvpilot", 2, 60.0, 50.0),
        _run("kvpilot", 3, 130.0, 50.0),
        _run("vllm", 3, 100.0, 100.0),
    ]
    offline_rounds = [
        {
            "round": rnd,
            "kvpilot": {"tokens_per_s": kvp},
            "vllm": {"tokens_per_s": 80.0},
            "prompt_tokens": 1001,
            "ratio": 1.25,
        }
        for rnd, kvp in ((1, 120.0), (2, 50.0), (3, 130.0))
    ]
    offline = [{"dtype": "float32", "batch": 16, "rounds": offline_rounds}]
    (config,) = peer.peer_summary(serving, offline)
    assert config["serving"]["kvpilot"]["median"]["out_tok_s"] == 110.0
    assert config["serving"]["vllm"]["median"]["out_tok_s"] == 100.0
    assert config["serving_ratios"]["out_tok_s"] == [1.1, 1.2, 1.3]
    goals = {g["goal"].split(",")[0]: g for g in config["goals"]}
    # Paired by round (110/120, 60/50, 130/130), not the medians' 110/120 (a missed goal).
    own = goals["kvpilot serving out tok/s / its offline tok/s at batch 16"]
    assert own["value"] == pytest.approx(1.0) and own["met"]
    assert goals["serving out tok/s"]["value"] == 1.2 and goals["serving out tok/s"]["met"]
    assert goals["TTFT p50"]["value"] == 0.5 and goals["TTFT p50"]["met"]
    assert goals["kvpilot /health p99 (ms)"]["value"] == 12.0
    assert goals["offline tok/s"]["value"] == 1.25
    assert config["serving"]["kvpilot"]["rounds"]["api_cpu_us_per_tok"] == pytest.approx(
        [100, 200, 300]
    )
    assert config["serving"]["vllm"]["median"]["api_cpu_us_per_tok"] == pytest.approx(500)
    assert config["prompt_tokens"]["vllm"] == [1001, 1002, 1003]
    assert config["prompt_tokens"]["offline"] == [1001] * 3  # the fake offline rounds differ
    text = peer.format_peer_config(config)
    assert "MISSED" not in text and "prompt tokens per round (DIFFERENT)" in text
    assert "API process CPU per output token (us), median: kvpilot 200 / vLLM 500" in text
    # Each round's serving over its own round's offline run (not the medians'), both systems.
    assert config["serve_vs_offline"]["kvpilot"] == pytest.approx([110 / 120, 1.2, 1.0])
    assert config["serve_vs_offline"]["vllm"] == pytest.approx([1.25, 0.625, 1.25])
    assert "serving / own offline per round (same requests): kvpilot 0.92, 1.20, 1.00" in text
    assert "kvpilot median serving / median offline (maybe different rounds): 0.92" in text


async def test_the_health_probe_runs_beside_the_workload(
    dataset: ModuleType,
    client: ModuleType,
    server: InProcessServer,
) -> None:
    requests = dataset.synthetic_dataset(2, 8, 4, 0.0, 0, seed=3)
    run = await client.run_workload(
        server.url, "completions", requests, math.inf, 2, seed=3, show_progress=False,
        health_interval=0.05,
    )  # fmt: skip
    health = run.report()["summary"]["health_ms"]
    assert health["probes"] >= 1 and health["failed"] == 0
    assert 0 < health["p50"] <= health["p99"] <= health["max"]


def test_the_health_probe_counts_refused_probes_and_keeps_probing(client: ModuleType) -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]  # closed again before the probes: nobody listens there
    probe = client.HealthProbe(f"http://127.0.0.1:{port}/health", interval=0.01)
    with probe:
        time.sleep(0.2)
    assert len(probe.latencies) >= 2 and probe.failures == len(probe.latencies)


class FakeWorker:
    """An offline worker's call interface (tokenize, run) without a process behind it."""

    UNUSED_PGID = 2**22 - 1  # above Linux's default pid_max: no process group has it

    def __init__(self, name: str, seconds: float, calls: list[tuple[str, str]]) -> None:
        self.name, self.seconds, self.calls = name, seconds, calls
        self.proc = types.SimpleNamespace(pid=self.UNUSED_PGID)

    def __call__(self, op: str, **payload: object) -> object:
        self.calls.append((self.name, op))
        if op == "tokenize":
            return [[1, 2, 3] for _ in payload["prompts"]]  # type: ignore[attr-defined]
        return {"output_tokens": sum(payload["max_tokens"]), "seconds": self.seconds}  # type: ignore[arg-type]


def test_an_offline_round_runs_both_workers_in_the_rounds_order(
    offline_workers: ModuleType,
) -> None:
    """What the peer mode runs after each serving round: the same requests through both
    offline workers, kvpilot first in even rounds (0-based), the ratio from their rates."""
    calls: list[tuple[str, str]] = []
    workers = {"kvpilot": FakeWorker("kvpilot", 2.0, calls), "vllm": FakeWorker("vllm", 4.0, calls)}
    second = offline_workers.offline_round(
        workers, 1, 7, ["a", "b"], [10, 20], quiet_pgids=(FakeWorker.UNUSED_PGID - 1,)
    )
    assert second["round"] == 2 and second["seed"] == 7 and second["order"] == ["vllm", "kvpilot"]
    assert second["prompt_tokens"] == 6
    assert second["kvpilot"]["tokens_per_s"] == 15.0 and second["ratio"] == 2.0
    assert [c for c in calls if c[1] == "run"] == [("vllm", "run"), ("kvpilot", "run")]
    calls.clear()
    first = offline_workers.offline_round(workers, 0, 8, ["a"], [4])
    assert first["order"] == ["kvpilot", "vllm"]
    assert [c for c in calls if c[1] == "run"] == [("kvpilot", "run"), ("vllm", "run")]


def test_the_peer_mode_pairs_offline_rounds_with_serving_rounds_unless_told(
    bench: ModuleType,
) -> None:
    parse = bench.build_parser().parse_args
    paired = parse(["--peer-vllm", "/bin/true"])
    assert not (paired.offline_after or paired.no_offline or paired.offline_only)
    after = parse(["--peer-vllm", "/bin/true", "--offline-after"])
    assert after.offline_after and not after.no_offline
    with pytest.raises(SystemExit):
        parse(["--peer-vllm", "/bin/true", "--offline-after", "--no-offline"])
    assert bench.main(["--offline-after"]) == 2  # only with --peer-vllm


def test_serve_vs_offline_places_and_sums_up_as_kvpilot_serve_would(bench: ModuleType) -> None:
    """bench/serve_vs_offline.py: `api-cpus=N` puts the offline engine where `kvpilot serve
    --api-cpus N` puts its engine core, the client on the API's CPUs; medians and the goal count
    per placement."""
    import importlib

    svo = importlib.import_module("serve_vs_offline")  # bench/ is on sys.path (serve_bench)
    try:
        shared = svo.parse_placement("shared", {0, 1, 2, 3}, None)
        assert (shared.serve_args, shared.engine_cpus, shared.client_cpus) == ((), None, None)
        split = svo.parse_placement("api-cpus=1", {12, 13, 14, 15}, None)
        assert split.serve_args == ("--api-cpus", "1")
        assert (split.engine_cpus, split.engine_threads, split.client_cpus) == (
            (12, 13, 14),
            3,
            (15,),
        )
        config = svo.offline_config(svo.build_parser().parse_args(["--concurrency", "8"]), split)
        assert (config["cpus"], config["threads"], config["max_num_seqs"]) == ([12, 13, 14], 3, 8)
        for bad in ("api-cpus", "api-cpus=x", "cores=1"):
            with pytest.raises(ValueError):
                svo.parse_placement(bad, {0, 1}, None)
        records = [
            {"placement": "shared", "ratio": r, "serve_tok_s": 100 * r, "offline_tok_s": 100.0}
            for r in (0.93, 0.96, 0.99)
        ]
        summary = svo.summarize([shared], records)["shared"]
        assert summary["median_ratio"] == 0.96 and summary["rounds_meeting_goal"] == 2
        assert "| shared | all | all | 96.0 | 100.0 | 0.93, 0.96, 0.99 | **0.960** | 2 of 3 |" in (
            svo.format_summary({"shared": summary})
        )
    finally:
        sys.modules.pop("serve_vs_offline", None)


def test_serve_startup_splits_a_start_by_the_servers_log_lines(bench: ModuleType) -> None:
    """bench/serve_startup.py reads the times of `kvpilot serve`'s own log format."""
    import importlib
    import logging

    from kvpilot.engine.server.cli import LOG_FORMAT

    startup = importlib.import_module("serve_startup")  # bench/ is on sys.path (serve_bench)
    formatter = logging.Formatter(LOG_FORMAT)
    t0 = 1_800_000_000.0  # a whole second: the format keeps milliseconds

    def line(name: str, message: str, at: float) -> str:
        record = logging.LogRecord(name, logging.INFO, __file__, 1, message, None, None)
        record.created, record.msecs = at, round((at % 1) * 1000)
        return formatter.format(record)

    lines = [
        line("kvpilot.server", "loading the bundled SmolLM2-135M-Instruct", t0 + 1.5),
        line("uvicorn.error", "Uvicorn running on http://127.0.0.1:1234", t0 + 1.6),
        line("kvpilot", "loading model (bundled SmolLM2-135M-Instruct)", t0 + 2.75),
        line("kvpilot", "using the converted GGUF in /cache/x", t0 + 3.0),
        line("kvpilot", "using the CPU kernels of /k/avx2/cpu_ops.so", t0 + 3.125),
        line("kvpilot", "model weights: 0.5 GiB", t0 + 4.0),
        line("kvpilot", "FP8 KV scales calibrated on 512 tokens: K 0.1..0.2", t0 + 4.5),
        line("kvpilot", "engine core ready in 2.0 s: SmolLM2-135M-Instruct", t0 + 4.75),
    ]
    got = startup.phases(t0, t0 + 5.25, lines)
    # No packing line: that phase took no time of its own; the rest of the core's load is what
    # follows the last phase's line.
    expected = {
        "imports": 1.5,
        "core start": 1.25,
        "model files": 0.25,
        "kernels": 0.125,
        "weights": 0.875,
        "pack": 0.0,
        "kv scales": 0.5,
        "core rest": 0.25,
        "after core": 0.5,
    }
    assert {k: round(v, 3) for k, v in got.items()} == {**expected, "total": 5.25}
    with pytest.raises(RuntimeError, match="engine core ready"):
        startup.phases(t0, t0 + 5.25, lines[:-1])


def test_kv_spec_peer_parses_its_variants_and_sums_up_paired_rounds(bench: ModuleType) -> None:
    """bench/kv_spec_peer.py: variants and server flags, a refused server's root-cause line, the
    metrics it samples, and the summaries' medians and paired-round ratios."""
    peer = importlib.import_module("kv_spec_peer")  # bench/ is on sys.path (serve_bench)
    try:
        variants = peer.parse_kv_variants("kvpilot:float32:fp8_e4m3,vllm:float32:auto")
        assert [v.name for v in variants] == ["kvpilot float32 kv fp8_e4m3", "vllm float32"]
        for bad in ("kvpilot:float32", "sglang:float32:auto", "vllm:float32:int8", "a,a"):
            with pytest.raises(ValueError):
                peer.parse_kv_variants(bad)
        cmd = peer.server_cmd(variants[1], "/v/python", "/hf", 8123, 1000, "{}")
        assert cmd[:3] == ["/v/python", "-m", peer.VLLM_SERVER_MODULE]
        joined = " ".join(cmd)
        assert "--kv-cache-memory-bytes 1000" in joined and "--block-size 32" in joined
        assert "--speculative-config" not in joined
        spec = peer.server_cmd(peer.Variant("kvpilot", speculative=True), "p", "h", 1, None, "{}")
        assert "--speculative-config" in spec and "--kv-cache-memory-bytes" not in spec
        log = (
            "WARNING x OSError: [Errno 24] Too many open files\n"
            "ERROR y NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX.\n"
            "RuntimeError: Worker failed with error 'FP8 KV cache ...'\n"
        )
        assert peer.error_line(log) == (
            "NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX."
        )
        metrics = peer.parse_metrics(
            '# HELP x\nvllm:num_requests_running{model_name="m"} 3.0\n'
            'vllm:cache_config_info{block_size="32",num_gpu_blocks="136"} 1.0\n'
            'vllm:num_preemptions_total{a="1"} 2.0\nvllm:num_preemptions_total{a="2"} 1.0\n'
        )
        assert metrics == {
            "vllm:num_requests_running": 3.0,
            "num_gpu_blocks": 136.0,
            "vllm:num_preemptions_total": 3.0,
        }
        samples = [
            {"vllm:num_requests_running": r, "vllm:num_requests_waiting": w}
            for r, w in ((10, 5), (16, 3), (17, 1), (8, 0))
        ]
        figures = peer.capacity_figures(samples)
        assert figures["max_running"] == 17 and figures["median_running_while_waiting"] == 16

        def kv_record(variant: str, rnd: int, tok_s: float) -> dict:
            return {
                "phase": "throughput", "variant": variant, "round": rnd, "out_tok_s": tok_s,
                "itl_p50_ms": 1000 / tok_s, "itl_p99_ms": 1.0, "ttft_p50_ms": 1.0, "failed": 0,
                "preemptions": 0.0, "num_gpu_blocks": 10, "max_running": 4,
                "median_running_while_waiting": None, "max_kv_cache_usage": 0.5,
            }  # fmt: skip

        records = [kv_record("a", 1, 110.0), kv_record("vllm float32", 1, 100.0)]
        records += [kv_record("a", 2, 150.0), kv_record("vllm float32", 2, 100.0)]
        row = peer.summarize_kv(records, "vllm float32")["throughput"]["a"]
        assert row["out_tok_s"] == 130.0 and row["tok_s_ratio_rounds"] == [1.1, 1.5]
        assert row["tok_s_ratio"] == pytest.approx(1.3) == row["itl_p50_speedup"]

        def spec_record(variant: str, rnd: int, itl: float) -> dict:
            return {
                "concurrency": 1, "variant": variant, "round": rnd, "itl_mean_ms": itl,
                "itl_p99_ms": itl, "out_tok_s": 1.0, "failed": 0, "draft_tokens": 4.0,
                "accepted_tokens": 3.0,
            }  # fmt: skip

        itls = {"kvpilot float32": 100.0, "kvpilot float32 ngram": 40.0}
        itls |= {"vllm float32": 120.0, "vllm float32 ngram": 60.0}
        spec_rows = [spec_record(name, 1, itl) for name, itl in itls.items()]
        summary = peer.summarize_spec(spec_rows)["1"]
        assert summary["kvpilot float32 ngram"]["acceptance"] == 0.75
        assert summary["ratios"] == {
            "kvpilot_ngram_speedup": 2.5,
            "vllm_ngram_speedup": 2.0,
            "kvpilot_vs_vllm_ngram": 1.5,
            "kvpilot_vs_vllm_plain": 1.2,
        }
        assert peer.build_parser().parse_args(["spec"]).concurrencies == "1,8,64"
        assert [v.name for v in peer.parse_spec_variants("kvpilot+ngram,vllm")] == [
            "kvpilot float32 ngram",
            "vllm float32",
        ]
        for bad in ("sglang", "vllm+eagle"):
            with pytest.raises(ValueError):
                peer.parse_spec_variants(bad)
    finally:
        sys.modules.pop("kv_spec_peer", None)
