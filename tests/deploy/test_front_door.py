"""The front door (deploy/haproxy): the Kubernetes config is what render.py writes, and on
loopback the real HAProxy in front of three replicas refuses calls without a key, replaces a
spoofed tenant header, keeps each tenant on one replica and resumes a stream exactly when that
replica dies (load_tests/front_door.py, also `make front-door`)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from deploy.haproxy import render
from load_tests import front_door
from tests.deploy.test_replicas import model_dir  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parents[2]
KUBE_CFG = ROOT / "deploy" / "kubernetes" / "overlays" / "front-door" / "haproxy.cfg"
NO_HAPROXY = "HAProxy is not installed (`apt-get install haproxy`; `make setup` installs it where it can)"


def _kube_config() -> str:
    return render.config(
        "/etc/haproxy/keys/keys.map",
        [],
        "batchserve-headless.default.svc.cluster.local:50051:8000:16",
        ":8080",
        ":50051",
    )


def test_the_kubernetes_config_is_what_render_writes() -> None:
    lines = KUBE_CFG.read_text().splitlines(keepends=True)
    assert lines[0].startswith("# Rendered by") and "".join(lines[3:]) == _kube_config()


def test_render_refuses_no_replicas_and_a_bad_key_file(tmp_path) -> None:
    with pytest.raises(ValueError, match="name the replicas"):
        render.config("/k", [], None, ":1", ":2")
    with pytest.raises(ValueError, match="line 1"):
        render.keys("acme short\n")
    assert render.keys(f"acme {'k' * 20}\n") == f"{render.sha256_hex('k' * 20)} acme\n"


@pytest.mark.skipif(shutil.which("haproxy") is None, reason=NO_HAPROXY)
def test_haproxy_takes_both_configs(tmp_path) -> None:
    keys = tmp_path / "keys.map"
    keys.write_text(render.keys(f"acme {'k' * 20}\n"))
    for name, text in (
        ("kube.cfg", _kube_config().replace("/etc/haproxy/keys/keys.map", str(keys))),
        ("loopback.cfg", render.config(str(keys), ["127.0.0.1:1:2", "127.0.0.1:3:4"], None, ":18080", ":18051")),
    ):
        (tmp_path / name).write_text(text)
        done = subprocess.run(["haproxy", "-c", "-f", str(tmp_path / name)], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(shutil.which("haproxy") is None, reason=NO_HAPROXY)
def test_the_front_door_on_loopback(model_dir, tmp_path, capsys) -> None:  # noqa: F811
    code = front_door.run(str(model_dir), tmp_path / "out", ["--kv-cache-gb", "0.02"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert printed.count("\nok ") + printed.startswith("ok ") >= 20 and "FAILED" not in printed
