"""The deployment files agree with the code they deploy: the Dockerfile (read as Docker reads it),
the compose file, Prometheus's config, Grafana's provisioning and the Kubernetes example name the
same image, port, volumes, health and metrics paths, environment variables and shutdown timing as
the CLI and the app; README's configuration reference is what the CLI prints.

The images themselves are built and run (without a Docker daemon) in tests/test_image.py."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from dockerfile_parse import DockerfileParser

from tests.daemon import ROOT
from v4serve.server.cli import SERVE_FLAGS, build_parser, config_reference, serve_settings, shown_default
from v4serve.server.serve import ServeConfig, build

CONFIGS = ROOT / "configs"
PORT = ServeConfig().port
STORE, MODELS = "/var/cache/v4serve", "/models"
ENV_VARS = {"V4SERVE_" + flag[2:].replace("-", "_").upper() for flag, _, _ in SERVE_FLAGS}


def stages() -> dict[str, list[dict]]:
    """Instructions of each named build stage, in order (the last stage is the default target)."""
    out: dict[str, list[dict]] = {}
    current: list[dict] = []
    for item in DockerfileParser(str(ROOT / "Dockerfile")).structure:
        if item["instruction"] == "FROM":
            current = out.setdefault(item["value"].split(" AS ")[-1].strip(), [])
        elif item["instruction"] != "COMMENT":
            current.append(item)
    return out


def mount_target(volume: str) -> str:
    """The container path of a compose volume `SOURCE:TARGET[:MODE]` (SOURCE may hold `${VAR:-x}`)."""
    parts = volume.rsplit(":", 2)
    return parts[-2] if parts[-1] in ("ro", "rw") else parts[-1]


def one(stage: list[dict], instruction: str) -> str:
    values = [i["value"] for i in stage if i["instruction"] == instruction]
    assert len(values) == 1, (instruction, values)
    return values[0]


@pytest.fixture(scope="module")
def routes() -> set[str]:
    app, engine = build(ServeConfig(no_kv_store=True))
    engine.shutdown()
    return {route.path for route in app.routes}


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_dockerfile_final_stages(target: str, routes: set[str]) -> None:
    stage = stages()[target]
    assert one(stage, "USER") not in ("root", "0")
    assert json.loads(one(stage, "ENTRYPOINT")) == ["v4serve", "serve"]
    assert not [i for i in stage if i["instruction"] == "CMD"]  # arguments after the image are flags
    assert one(stage, "EXPOSE") == str(PORT)
    assert set(json.loads(one(stage, "VOLUME"))) == {MODELS, STORE}
    assert one(stage, "STOPSIGNAL") == "SIGTERM"
    health = one(stage, "HEALTHCHECK")
    path = re.search(rf"http://127\.0\.0\.1:{PORT}(/\w+)", health)
    assert path and path.group(1) == "/health" and "/health" in routes
    start = re.search(r"--start-period=(\d+)s", health)
    assert start and int(start.group(1)) >= 600  # loading a large checkpoint takes minutes
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(i["value"] for i in stage if i["instruction"] == "ENV")))
    assert env["V4SERVE_KV_STORE_DIR"] == STORE
    assert {k for k in env if k.startswith("V4SERVE_")} <= ENV_VARS


def test_dockerfile_targets_and_package() -> None:
    all_stages = stages()
    assert list(all_stages)[-1] == "gpu"  # `docker build .` gives the GPU image
    assert "nvidia/cuda" in next(i for i in DockerfileParser(str(ROOT / "Dockerfile")).structure
                                 if i["instruction"] == "FROM" and i["value"].endswith("AS gpu"))["value"]
    copied = {i["value"].split()[0] for i in all_stages["wheel"] if i["instruction"] == "COPY"}
    package_dirs = set(re.findall(r'^"v4serve\.\w+" = "(\w+)"', (ROOT / "pyproject.toml").read_text(), re.M))
    assert package_dirs and package_dirs <= copied
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not set(ignored) & package_dirs


def test_compose_prometheus_and_grafana_agree() -> None:
    compose = yaml.safe_load((CONFIGS / "docker-compose.yaml").read_text())["services"]
    serve = compose["v4serve"]
    assert serve["image"] == "v4serve:gpu" and serve["build"]["target"] == "gpu"
    assert serve["ports"] == [f"{PORT}:{PORT}"]
    assert {mount_target(v) for v in serve["volumes"]} == {MODELS, STORE}
    assert serve["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert set(serve["environment"]) <= ENV_VARS
    grace = int(serve["stop_grace_period"].removesuffix("s"))
    assert grace > int(serve["environment"]["V4SERVE_SHUTDOWN_TIMEOUT"]) + 5
    mounts = {mount_target(v): v.split(":")[0] for v in compose["prometheus"]["volumes"]}
    prometheus = yaml.safe_load((CONFIGS / mounts["/etc/prometheus/prometheus.yml"]).read_text())
    assert prometheus["rule_files"] == ["/etc/prometheus/alerts.yaml"] and mounts["/etc/prometheus/alerts.yaml"]
    job = prometheus["scrape_configs"][0]
    assert job["job_name"] == "v4serve" and job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == [f"v4serve:{PORT}"]
    grafana = {mount_target(v): v.split(":")[0] for v in compose["grafana"]["volumes"]}
    provider = yaml.safe_load((CONFIGS / "grafana/provisioning/dashboards/v4serve.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    assert (CONFIGS / grafana["/var/lib/grafana/dashboards"].removeprefix("./") / "v4serve.json").is_file()
    source = yaml.safe_load((CONFIGS / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert source["datasources"][0]["url"] == "http://prometheus:9090"


def test_every_dashboard_panel_has_a_description_and_queries() -> None:
    dashboard = json.loads((CONFIGS / "grafana/dashboards/v4serve.json").read_text())
    for panel in dashboard["panels"]:
        assert len(panel["description"]) > 60, panel["title"]
        assert panel["targets"] and all("v4serve_" in t["expr"] for t in panel["targets"]), panel["title"]
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Prefix-cache hit rate (tokens)", "Hit rate by source", "Restore points used", "Time to first token",
            "Inter-token latency", "Preemptions", "SWA recompute tokens/s", "SSD store errors by kind"} <= titles


def test_kubernetes_example_agrees() -> None:
    docs = {d["kind"]: d for d in yaml.safe_load_all((CONFIGS / "k8s/v4serve.yaml").read_text())}
    pod = docs["Deployment"]["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["image"] == "v4serve:gpu"
    assert container["ports"][0]["containerPort"] == PORT
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    assert {m["mountPath"] for m in container["volumeMounts"]} >= {MODELS, STORE}
    claim = next(v for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v)
    assert claim["persistentVolumeClaim"]["claimName"] == docs["PersistentVolumeClaim"]["metadata"]["name"]
    store_mount = next(m for m in container["volumeMounts"] if m["mountPath"] == STORE)
    assert store_mount["name"] == claim["name"]
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(PORT)
    assert docs["ServiceMonitor"]["spec"]["endpoints"][0]["path"] == "/metrics"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert set(env) <= ENV_VARS
    assert pod["spec"]["terminationGracePeriodSeconds"] > int(env["V4SERVE_SHUTDOWN_TIMEOUT"]) + 5


def test_readme_configuration_reference_is_the_cli() -> None:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- config-reference:begin -->\n(.*?)<!-- config-reference:end -->", readme, re.S)
    assert block, "README lost its configuration reference markers"
    assert block.group(1) == config_reference(), "README is stale: paste `v4serve config-reference` into it"
    assert len(block.group(1).splitlines()) == len(SERVE_FLAGS) + 2


def test_one_set_of_defaults_in_help_readme_and_the_example_config(tmp_path) -> None:
    """--help, config-reference (checked above), README's settings table and configs/serve.example.yaml
    give each default as ServeConfig has it (or what it comes to at start): a change to one that the
    others miss fails here."""
    kinds = {flag: kind for flag, kind, _ in SERVE_FLAGS}
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| flag | default | meaning |"):].split("\n\n", 1)[0]
    rows = re.findall(r"^\| `(--[\w-]+)` \| ([^|]*) \|", table, re.M)
    assert len(rows) >= 20
    for flag, shown in rows:
        assert shown.strip() == shown_default(flag[2:].replace("-", "_"), kinds[flag], "`"), flag
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["serve"].format_help().split())
    assert "[default: min(the model's max_position_embeddings, 32768)]" in help_text
    assert "[default: 34359738368 (32 GiB)]" in help_text and "[default: periodic]" in help_text
    example = ROOT / "configs" / "serve.example.yaml"
    assert "configs/serve.example.yaml" in readme
    settings = serve_settings(build_parser().parse_args(["serve", "--config", str(example)]), {})
    defaults = {f: getattr(ServeConfig(), f) for f in settings}
    assert {k: v for k, v in settings.items() if defaults[k] is not None} == \
        {k: v for k, v in defaults.items() if v is not None}  # it shows the defaults, not other values
