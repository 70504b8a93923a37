"""Runs a command from a built image the way a restricted pod would, without a container engine:
as a non-root uid, on the image's root filesystem mounted read-only, with only the pod's volumes
writable (fresh, empty folders, as emptyDir volumes start), in a network namespace of its own.

    podrun.py --image localhost/kvpilot:dev --netns kvpilot-image --writable /tmp -- kvpilot router
    podrun.py --image localhost/kvpilot:dev --netns kvpilot-image --engine builtin://smollm2-135m-instruct

--engine takes the engine container the operator builds for an InferenceService of that model
(kvpilot.operator.builders): its command, args, env, writable volume mounts and uid.

Needs root (buildah's store, mount namespaces, chroot). The rootfs is a buildah working container
of the image, mounted; inside a private mount namespace it is bind-mounted onto itself read-only,
then /proc, /dev, a 64 MiB /dev/shm and each writable volume are mounted over it, and the command
runs under chroot --userspec. The network namespace (`ip netns add NAME`) is shared by the
commands given the same name, as the containers of pods on one node reach each other by address:
`ip netns exec NAME curl ...` reaches them."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

STORAGE = ["--storage-driver", os.environ.get("STORAGE_DRIVER", "vfs")]


@dataclass
class PodCommand:
    """What runs: argv, its environment on top of the image's, the writable paths, the user."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    writable: list[str] = field(default_factory=list)
    uid: int = 10001


def engine_command(model_uri: str, served_name: str) -> PodCommand:
    """The engine container the operator builds for an InferenceService serving model_uri."""
    from kvpilot.operator.builders import Owner, build_pod_template
    from kvpilot.operator.spec import InferenceServiceSpec

    spec = InferenceServiceSpec.model_validate(
        {"model": {"uri": model_uri, "servedName": served_name}}
    )
    owner = Owner(name="smollm2", namespace="default", uid="0")
    pod = build_pod_template(owner, spec, "image")["spec"]
    container = pod["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    return PodCommand(
        argv=[*container["command"], *container["args"]],
        env={var["name"]: var["value"] for var in container["env"] if "value" in var},
        writable=[m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")],
        uid=pod["securityContext"]["runAsUser"],
    )


def buildah(*args: str) -> str:
    return subprocess.run(
        ["buildah", *STORAGE, *args], check=True, capture_output=True, text=True
    ).stdout.strip()


def image_env(image: str) -> dict[str, str]:
    config = json.loads(buildah("inspect", "--type", "image", image))["OCIv1"]["config"]
    return dict(item.split("=", 1) for item in config.get("Env", []))


def terminate_children(pid: int) -> None:
    """SIGTERM to the children of pid."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    for child in children.read_text().split() if children.exists() else []:
        os.kill(int(child), signal.SIGTERM)


def report_writes(paths: list[str], scratch: str) -> None:
    """What the command left in its writable volumes (sizes by top folder), on stderr."""
    for index, path in enumerate(paths):
        volume = os.path.join(scratch, f"volume-{index}")
        for entry in sorted(os.listdir(volume)):
            du = subprocess.run(["du", "-sh", os.path.join(volume, entry)], capture_output=True)
            size = du.stdout.decode().split("\t")[0]
            print(f"podrun: wrote {path}/{entry} ({size})", file=sys.stderr)


def run(image: str, netns: str, command: PodCommand, container: str = "") -> int:
    """Runs command in a working container of image: the one named, or a new one removed after
    (with the vfs driver each new one is a full copy of the image's files: minutes)."""
    env = {**image_env(image), **command.env}
    own = not container
    container = container or buildah("from", "--pull-never", image)
    try:
        rootfs = buildah("mount", container)
        with tempfile.TemporaryDirectory(prefix="podrun-") as scratch:
            mounts = []
            for index, path in enumerate(command.writable):
                volume = os.path.join(scratch, f"volume-{index}")
                os.mkdir(volume)
                os.chmod(volume, 0o1777)  # as emptyDir: writable by the pod's uid
                # The runtime makes the mount point when the image lacks it.
                os.makedirs(rootfs + path, exist_ok=True)
                mounts.append(f"mount --bind {volume} {rootfs}{path}")
            env_args = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
            script = "\n".join(
                [
                    "set -e",
                    f"mount --bind {rootfs} {rootfs}",
                    f"mount -o remount,bind,ro {rootfs}",
                    f"mount -t proc proc {rootfs}/proc",
                    f"mount --rbind /dev {rootfs}/dev",
                    f"mount -t tmpfs -o size=64m,mode=1777 shm {rootfs}/dev/shm",
                    *mounts,
                    f"exec chroot --userspec={command.uid}:{command.uid} --groups={command.uid}"
                    f" {rootfs} /usr/bin/env -i {env_args} {shlex.join(command.argv)}",
                ]
            )
            netns_cmd = ["ip", "netns", "exec", netns] if netns else []
            # unshare ignores SIGTERM while it waits: a SIGTERM to podrun goes to the command
            # itself (pid 1 of its namespace), as a kubelet's would; --kill-child ends the
            # command should unshare itself die.
            unshare = ["unshare", "--mount", "--pid", "--fork", "--kill-child"]
            child = subprocess.Popen(
                [*netns_cmd, *unshare, "--propagation", "private", "sh", "-c", script]
            )
            signal.signal(signal.SIGTERM, lambda *_: terminate_children(child.pid))
            code = child.wait()
            report_writes(command.writable, scratch)
            return code
    finally:
        if own:
            buildah("rm", container)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default="localhost/kvpilot:dev")
    parser.add_argument("--netns", default="", help="an `ip netns` name to run in")
    parser.add_argument("--engine", metavar="MODEL_URI", help="run the operator's engine pod")
    parser.add_argument("--served-name", default="SmolLM2-135M-Instruct")
    parser.add_argument("--writable", action="append", default=[], metavar="PATH")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--uid", type=int, default=10001)
    parser.add_argument("--container", default="", help="a working container of IMAGE to use")
    parser.add_argument("argv", nargs="*")
    args = parser.parse_args()
    if args.engine:
        command = engine_command(args.engine, args.served_name)
    else:
        env = dict(item.split("=", 1) for item in args.env)
        command = PodCommand(args.argv, env, args.writable, args.uid)
    print(f"podrun uid={command.uid} writable={command.writable}: {shlex.join(command.argv)}")
    sys.exit(run(args.image, args.netns, command, args.container))


if __name__ == "__main__":
    main()
