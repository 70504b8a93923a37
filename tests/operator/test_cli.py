from __future__ import annotations

import socket
import subprocess
import sys

import httpx
import pytest
from prometheus_client import CollectorRegistry

from kvpilot.operator.autoscaling.metrics import OperatorMetrics
from kvpilot.operator.cli import MetricsPortError, main, serving_metrics
from kvpilot.operator.config import OperatorConfig, config_from
from kvpilot.operator.handlers import retry_delay

from .conftest import free_port


def test_defaults() -> None:
    config = config_from([], {})
    assert config == OperatorConfig()
    assert config.is_clusterwide
    assert config.annotation_prefix == "kvpilot.dev"
    assert config.liveness_endpoint == "http://0.0.0.0:8080/healthz"


def test_environment_then_flags() -> None:
    env = {
        "KVPILOT_WATCH_NAMESPACES": "a, b,",
        "KVPILOT_ENGINE_IMAGE": "env:1",
        "KVPILOT_LOG_LEVEL": "WARNING",
        "KVPILOT_RESYNC_SECONDS": "12.5",
        "KVPILOT_ANNOTATION_PREFIX": "ml.example.com",
        "KVPILOT_LIVENESS_ENDPOINT": "none",
    }
    from_env = config_from([], env)
    assert from_env.namespaces == ("a", "b")
    assert from_env.engine_image == "env:1"
    assert from_env.log_level == "warning"
    assert from_env.resync_seconds == 12.5
    assert from_env.annotation_prefix == "ml.example.com"
    assert from_env.liveness_endpoint is None
    assert from_env.autoscale_interval_seconds == 5.0
    assert from_env.metrics_port == 8081
    flags = config_from(["-n", "c", "--namespace=d,e", "--engine-image", "flag:2"], env)
    assert flags.namespaces == ("c", "d", "e")
    assert flags.engine_image == "flag:2"
    assert not flags.is_clusterwide


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], {"KVPILOT_RESYNC_SECONDS": "often"}, "KVPILOT_RESYNC_SECONDS must be a number"),
        (["--annotation-prefix", "Not A Prefix"], {}, "must be a DNS subdomain"),
        (["--namespace", "Bad_NS"], {}, "is not a valid namespace name"),
        (["--resync-seconds", "0"], {}, "resync seconds must be > 0"),
        ([], {"KVPILOT_LOG_LEVEL": "loud"}, "log level 'loud'"),
        (["--autoscale-interval", "0"], {}, "autoscale interval must be > 0 seconds"),
        ([], {"KVPILOT_SCRAPE_TIMEOUT": "-1"}, "scrape timeout must be > 0 seconds"),
        (["--api-timeout", "0"], {}, "API timeout must be > 0 seconds"),
        (["--adapter-sync-interval", "0"], {}, "adapter sync interval must be > 0 seconds"),
        ([], {"KVPILOT_ADAPTER_LOAD_TIMEOUT": "-1"}, "adapter load timeout must be > 0 seconds"),
        ([], {"KVPILOT_API_TIMEOUT": "inf"}, "API timeout must be > 0 seconds"),
        ([], {"KVPILOT_API_TIMEOUT": "soon"}, "KVPILOT_API_TIMEOUT must be a number"),
        (["--metrics-port", "70000"], {}, r"metrics port must be in \[0, 65535\]"),
        (["--metrics-port", "8080"], {}, "metrics port 8080 is the liveness endpoint's"),
        ([], {"KVPILOT_METRICS_PORT": "eighty"}, "KVPILOT_METRICS_PORT must be a number"),
    ],
)
def test_bad_settings_are_refused_clearly(
    argv: list[str], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        config_from(argv, env)


def test_autoscaler_and_metrics_settings_from_flags_and_environment() -> None:
    env = {"KVPILOT_AUTOSCALE_INTERVAL": "2.5", "KVPILOT_METRICS_PORT": "9100"}
    from_env = config_from([], env)
    assert (from_env.autoscale_interval_seconds, from_env.metrics_port) == (2.5, 9100)
    flags = config_from(["--autoscale-interval", "10", "--scrape-timeout", "0.5"], env)
    assert (flags.autoscale_interval_seconds, flags.scrape_timeout_seconds) == (10, 0.5)
    assert config_from(["--metrics-port", "0"], env).metrics_port == 0  # no metrics server


def test_api_timeout_from_flags_and_environment() -> None:
    assert config_from([], {}).api_timeout_seconds == 30
    assert config_from([], {"KVPILOT_API_TIMEOUT": "7.5"}).api_timeout_seconds == 7.5
    flags = config_from(["--api-timeout", "2"], {"KVPILOT_API_TIMEOUT": "7.5"})
    assert flags.api_timeout_seconds == 2


def test_the_metrics_server_serves_the_registry_it_is_given_and_stops() -> None:
    registry = CollectorRegistry()
    metrics = OperatorMetrics(registry)
    metrics.scale_decisions.labels("ns", "chat", "up").inc()
    port = free_port()
    with serving_metrics(port, registry):
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5, trust_env=False).text
    assert 'kvpilot_operator_scale_decisions_total{direction="up"' in text
    assert "python_gc_objects_collected_total" not in text  # not the global registry
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5, trust_env=False)


def test_a_taken_metrics_port_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with (
            pytest.raises(MetricsPortError, match=f"cannot serve metrics on port {port}"),
            serving_metrics(port, CollectorRegistry()),
        ):
            pass


def test_main_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "--engine-image" in capsys.readouterr().out
    assert main(["--log-level", "loud"]) == 2
    assert main(["--resync-seconds", "-1"]) == 2
    assert "resync seconds must be > 0" in capsys.readouterr().err


def test_the_operator_never_imports_torch() -> None:
    # The operator's image runs `kvpilot operator`: its modules must not pay for torch.
    code = (
        "import sys\n"
        "from kvpilot.operator.cli import main\n"
        "assert main(['--help']) == 0\n"
        "import kvpilot.operator.handlers, kvpilot.operator.reconcile, kvpilot.operator.crdgen\n"
        "import kvpilot.operator.autoscaler\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr


def test_retries_back_off_exponentially_up_to_a_cap() -> None:
    delays = [retry_delay(n) for n in range(10)]
    assert delays[:4] == [2, 4, 8, 16]
    assert delays == sorted(delays)
    assert max(delays) == 120
