"""The GPUs `kvpilot serve` counts before the engine core starts: by NVIDIA's device nodes and
CUDA_VISIBLE_DEVICES, without torch (engine/visible_gpus.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvpilot.engine.visible_gpus import count_visible, gpu_node_count, visible_gpu_count


def fake_dev(root: Path, names: list[str]) -> Path:
    """A /dev with these entries (plain files stand for the device nodes; a name ending in / is a
    folder, as /dev/nvidia-caps is)."""
    dev = root / "dev"
    dev.mkdir(parents=True)
    for name in names:
        if name.endswith("/"):
            (dev / name).mkdir()
        else:
            (dev / name).touch()
    return dev


# What the NVIDIA container runtime mounts for a pod given host GPUs 1 and 3 (CUDA numbers them 0
# and 1), beside the driver's other nodes, which are no GPUs.
POD_NODES = ["nvidiactl", "nvidia1", "nvidia3", "nvidia-uvm", "nvidia-uvm-tools",
             "nvidia-modeset", "nvidia-caps/", "null", "nvme0"]  # fmt: skip


def test_the_gpus_are_the_device_nodes_beside_the_control_node(tmp_path: Path) -> None:
    assert gpu_node_count(fake_dev(tmp_path / "pod", POD_NODES)) == 2
    without_control = fake_dev(tmp_path / "none", [n for n in POD_NODES if n != "nvidiactl"])
    assert gpu_node_count(without_control) == 0
    assert gpu_node_count(fake_dev(tmp_path / "cpu", ["null", "nvme0"])) == 0
    assert gpu_node_count(tmp_path / "missing") == 0


@pytest.mark.parametrize(
    ("devices", "cuda_visible_devices", "visible"),
    [
        (2, None, 2),
        (2, "", 0),
        (2, "1", 1),
        (2, "1,0", 2),
        (2, " 0 , 1 ", 2),
        (4, "0,2,1", 3),
        (2, "0,2,1", 1),  # 2 names no device: the list ends there
        (2, "-1", 0),
        (2, "0,-1,1", 1),
        (2, "gpu0", 0),
        (2, "1x", 1),  # CUDA reads the leading number
        (2, "0,0", 0),  # an ordinal twice: CUDA takes the whole list as invalid
        (2, "GPU-8a2c,GPU-77f1", 2),
        (1, "GPU-8a2c,GPU-77f1", 1),
        (2, "MIG-4f1e", 1),
        (2, "GPU-8a2c,1", 1),  # UUIDs and ordinals do not mix
        (0, "0", 0),
        (0, None, 0),
    ],
)
def test_cuda_visible_devices_narrows_the_count_as_cuda_reads_it(
    devices: int, cuda_visible_devices: str | None, visible: int
) -> None:
    assert count_visible(devices, cuda_visible_devices) == visible


def test_the_count_reads_the_environment_given(tmp_path: Path) -> None:
    dev = fake_dev(tmp_path, POD_NODES)
    assert visible_gpu_count(dev, {}) == 2
    assert visible_gpu_count(dev, {"CUDA_VISIBLE_DEVICES": "1"}) == 1


def test_serve_checks_a_gpu_node_placement_without_importing_torch() -> None:
    """startup_settings on a node with two GPUs (their count faked, since this machine has
    none): cuda:1 is taken, cuda:2 and -tp 3 are refused with the numbers, and torch is never
    imported (it would hold back the engine core's start by seconds)."""
    script = textwrap.dedent(
        """
        import sys
        import kvpilot.engine.visible_gpus as visible_gpus
        visible_gpus.gpu_node_count = lambda dev=None: 2
        from kvpilot.contract.engine_flags import build_parser
        from kvpilot.engine.server.cli import startup_settings
        config, _ = startup_settings(build_parser().parse_args(["--device", "cuda:1"]))
        print("taken", config.device)
        for argv in (["--device", "cuda:2"], ["-tp", "3", "--device", "cuda"]):
            try:
                startup_settings(build_parser().parse_args(argv))
            except ValueError as error:
                print("refused", error)
        print("torch imported", "torch" in sys.modules)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    ).stdout.splitlines()
    assert out[0] == "taken cuda:1", out
    assert out[1] == "refused device cuda:2 needs GPU 2, but 2 are visible", out
    assert out[2].startswith("refused tensor_parallel_size 3 needs 3 GPUs, but 2 are visible"), out
    assert out[3] == "torch imported False", out


def test_the_engine_core_checks_again_with_torchs_count() -> None:
    """Where a device node stands for a GPU torch cannot use, the core (which has torch) refuses
    the placement before loading anything, with the same message: here, a GPU asked of a
    machine whose torch sees none."""
    import torch

    from kvpilot.engine.config import CacheConfig, EngineConfig
    from kvpilot.engine.core.client import EngineCoreClient
    from kvpilot.engine.core.messages import CoreFailed

    visible = torch.cuda.device_count()
    config = EngineConfig(device=f"cuda:{visible}", cache=CacheConfig(kv_cache_gib=0.05))
    client = EngineCoreClient(config, num_threads=1)
    client.start()
    try:
        event = None
        for _ in range(240):
            event = client.receive(0.5)
            if event is not None:
                break
    finally:
        client.stop()
        client.close()
    assert isinstance(event, CoreFailed) and event.during_load, event
    expected = "needs a GPU, but none is visible" if not visible else f"but {visible} are visible"
    assert event.message.startswith("loading the model failed: device cuda:"), event.message
    assert expected in event.message, event.message
