"""deploy/kubernetes/*.yaml: every document parses, and the essentials are there.

Checked without a cluster: the kinds and API versions, the three roles' Deployments and their
flags, probes on the gateway's /health and /ready and on the workers' health listener, the
cluster key Secret mounted as a file with mode 0600 and named by --cluster-key-file, the model
volume behind --model, resource requests, Prometheus scrape annotations, and the Services
(the workers' one published before the gateway is ready, or nothing could ever register).
scripts/kube-play.sh runs the same files under podman (its host ports are checked here to stay
within 100 of PORT_BASE).
"""

import glob
import os
import re
import subprocess

import pytest
import yaml

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
KUBE = os.path.join(ROOT, "deploy", "kubernetes")
API = {"Deployment": "apps/v1", "Service": "v1", "Secret": "v1", "PersistentVolumeClaim": "v1"}


def documents():
    out = []
    for path in sorted(glob.glob(os.path.join(KUBE, "*.yaml"))):
        with open(path) as f:
            out += [(os.path.basename(path), d) for d in yaml.safe_load_all(f) if d is not None]
    return out


DOCS = documents()
BY_NAME = {(d["kind"], d["metadata"]["name"]): d for _, d in DOCS}
ROLES = ["gateway", "prefill", "decode"]


def deployment(role):
    return BY_NAME[("Deployment", f"bulkhead-{role}")]


def container(role):
    (c,) = deployment(role)["spec"]["template"]["spec"]["containers"]
    return c


def flags(role):
    c = container(role)
    assert c["args"][0] == "serve"
    out = {}
    for a in c["args"][1:]:
        assert a.startswith("--") and "=" in a, f"{role}: write flags as --name=value: {a}"
        name, value = a[2:].split("=", 1)
        out[name] = value
    return out


def test_every_document_has_a_known_kind_and_api_version():
    assert DOCS, "no YAML under deploy/kubernetes"
    for path, d in DOCS:
        assert d["kind"] in API, (path, d["kind"])
        assert d["apiVersion"] == API[d["kind"]], (path, d["kind"], d["apiVersion"])
        assert d["metadata"]["labels"]["app.kubernetes.io/name"] == "bulkhead", path


@pytest.mark.parametrize("role", ROLES)
def test_deployment_shape(role):
    d = deployment(role)
    pod = d["spec"]["template"]
    for k, v in d["spec"]["selector"]["matchLabels"].items():
        assert pod["metadata"]["labels"][k] == v
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == role
    spec = pod["spec"]
    # Service links would put BULKHEAD_*_PORT=tcp://... into the flags' environment.
    assert spec["enableServiceLinks"] is False
    f = flags(role)
    assert f["role"] == role
    assert container(role)["image"]


@pytest.mark.parametrize("role", ROLES)
def test_cluster_key_secret_mounted_0600(role):
    spec = deployment(role)["spec"]["template"]["spec"]
    (vol,) = [v for v in spec["volumes"] if "secret" in v]
    assert vol["secret"]["secretName"] == "bulkhead-cluster-key"
    assert vol["secret"]["defaultMode"] == 0o600
    (mount,) = [m for m in container(role)["volumeMounts"] if m["name"] == vol["name"]]
    assert mount["readOnly"] is True
    assert flags(role)["cluster-key-file"] == mount["mountPath"] + "/cluster.key"
    secret = BY_NAME[("Secret", "bulkhead-cluster-key")]
    assert list(secret["stringData"]) == ["cluster.key"]
    # Not a usable key: a real one is never committed.
    assert not re.fullmatch(r"[0-9a-f]{64}", secret["stringData"]["cluster.key"])
    # Root owns Secret files: a non-root user could not read a 0600 key.
    sc = container(role)["securityContext"]
    assert sc["runAsUser"] == 0 and sc["capabilities"]["drop"] == ["ALL"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert "fsGroup" not in spec.get("securityContext", {}), "fsGroup adds a group bit the key file may not have"


@pytest.mark.parametrize("role", ROLES)
def test_model_from_the_volume(role):
    spec = deployment(role)["spec"]["template"]["spec"]
    (vol,) = [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
    assert vol["persistentVolumeClaim"]["claimName"] == "bulkhead-models"
    assert ("PersistentVolumeClaim", "bulkhead-models") in BY_NAME
    (mount,) = [m for m in container(role)["volumeMounts"] if m["name"] == vol["name"]]
    assert mount["readOnly"] is True
    model = flags(role)["model"]
    assert model.startswith(mount["mountPath"] + "/") and model.endswith(".gguf")


@pytest.mark.parametrize("role", ROLES)
def test_probes(role):
    c = container(role)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    live, ready = c["livenessProbe"]["httpGet"], c["readinessProbe"]["httpGet"]
    assert (live["path"], ready["path"]) == ("/health", "/ready")
    f = flags(role)
    if role == "gateway":
        assert live["port"] == ready["port"] == "http"
        assert ports["http"] == int(f["port"])
    else:
        assert live["port"] == ready["port"] == "health"
        assert f["health-listen"] == f"0.0.0.0:{ports['health']}"


@pytest.mark.parametrize("role", ROLES)
def test_resource_requests(role):
    r = container(role)["resources"]
    assert r["requests"]["cpu"] and r["requests"]["memory"] and r["limits"]["memory"]
    if role != "gateway":
        threads = {e["name"]: e.get("value") for e in container(role)["env"]}["BULKHEAD_THREADS"]
        assert threads == str(r["requests"]["cpu"]), "compute threads should match the CPU request"


def test_prometheus_scrapes_the_gateway():
    a = deployment("gateway")["spec"]["template"]["metadata"]["annotations"]
    assert a["prometheus.io/scrape"] == "true"
    assert a["prometheus.io/path"] == "/metrics"
    assert a["prometheus.io/port"] == flags("gateway")["port"]


def test_services_and_addresses():
    gw = flags("gateway")
    workers_port = int(gw["worker-listen"].rsplit(":", 1)[1])
    assert gw["worker-listen"].startswith("0.0.0.0:") and gw["host"] == "0.0.0.0"
    reg = BY_NAME[("Service", "bulkhead-gateway")]["spec"]
    # The gateway is ready only once workers registered through this Service.
    assert reg["publishNotReadyAddresses"] is True
    assert [p["port"] for p in reg["ports"]] == [workers_port]
    api = BY_NAME[("Service", "bulkhead-api")]["spec"]
    assert [p["targetPort"] for p in api["ports"]] == ["http"]
    for s in (reg, api):
        assert s["selector"] == deployment("gateway")["spec"]["selector"]["matchLabels"]
    for role in ("prefill", "decode"):
        assert flags(role)["gateway"] == f"bulkhead-gateway:{workers_port}"
    dec = flags("decode")
    kv_port = dec["kv-listen"].rsplit(":", 1)[1]
    assert dec["kv-advertise"] == f"$(POD_IP):{kv_port}"
    env = {e["name"]: e for e in container("decode")["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert deployment("gateway")["spec"]["replicas"] == 1
    assert deployment("gateway")["spec"]["strategy"]["type"] == "Recreate"


def test_kube_play_keeps_every_port_within_100_of_its_base():
    """scripts/kube-play.sh takes PORT_BASE and uses host ports from it alone: a host that opens
    a small range (a firewall's, a sandbox's) must hold them all, so none may sit hundreds of
    ports away (it used +920 and +1020)."""
    script = open(os.path.join(ROOT, "scripts", "kube-play.sh")).read()
    (line,) = [l for l in script.splitlines() if l.startswith("http=$base ")]
    names = re.findall(r"(\w+)=", line)
    assert names == ["http", "health_prefill", "health_decode", "workers", "kv"], line
    # Every port the script checks is free is one of these, and every one is checked.
    (check,) = [l for l in script.splitlines() if l.strip().startswith("for p in ")]
    assert sorted(re.findall(r"\$(\w+)", check)) == sorted(names), check
    for base in (18080, 40000, 65531):
        out = subprocess.run(
            ["bash", "-c", f"base={base}; {line}; echo " + " ".join(f"${n}" for n in names)],
            capture_output=True, text=True, check=True,
        ).stdout.split()
        ports = [int(p) for p in out]
        assert len(set(ports)) == len(ports), ports
        assert all(base <= p < base + 100 and p <= 65535 for p in ports), (base, ports)
