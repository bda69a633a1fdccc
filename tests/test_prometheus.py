"""The shipped dashboard and alert rules against a real Prometheus scraping a real daemon.

A daemon on loopback answers the same long prompt twice (device hits), is restarted on the same
SSD store and answers it again (disk hits), while Debian's `prometheus` scrapes it every second.
Then every PromQL expression of configs/grafana/dashboards/v4serve.json and configs/alerts.yaml is
evaluated through Prometheus's HTTP API: each must evaluate without error, and the hit-rate panels
must show a rate above zero for both sources. `promtool check rules` must accept the rule file.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest
import yaml

from tests.daemon import ROOT, free_port, start_daemon

CONFIGS = ROOT / "configs"
DASHBOARD = CONFIGS / "grafana" / "dashboards" / "v4serve.json"
ALERTS = CONFIGS / "alerts.yaml"

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None or shutil.which("promtool") is None,
    reason="Debian's prometheus package (prometheus, promtool) is not installed: `make test` installs it where "
           "apt-get runs as root",
)

# A prompt of three 128-token blocks (the byte tokenizer: one token per byte).
PROMPT = "".join(f"line {i:03d} of a long shared document that many requests ask about.\n" for i in range(7))


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target, with Grafana's variables as a query would send them."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], concrete(t["expr"])) for p in panels for t in p["targets"]]


def alert_exprs() -> list[tuple[str, str]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [(rule["alert"], rule["expr"]) for group in groups for rule in group["rules"]]


def concrete(expr: str) -> str:
    return expr.replace("$__rate_interval", "1m").replace('"$model"', '".*"')


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """(Prometheus base URL, the port it scrapes) with a 1 s scrape interval and the alert rules."""
    tmp = tmp_path_factory.mktemp("prometheus")
    target = free_port()
    shutil.copy(ALERTS, tmp / "alerts.yaml")
    (tmp / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(tmp / "alerts.yaml")],
        "scrape_configs": [{"job_name": "v4serve", "static_configs": [{"targets": [f"127.0.0.1:{target}"]}]}],
    }))
    port = free_port()
    log = open(tmp / "prometheus.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(f"{url}/-/ready", timeout=1).status_code == 200, 30, "Prometheus ready")
        yield url, target
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        log.close()


def wait_for(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def query(url: str, expr: str) -> list[dict]:
    body = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert body["status"] == "success", f"{expr}: {body}"
    return body["data"]["result"]


def scraped_up(url: str) -> bool:
    return any(float(s["value"][1]) == 1 for s in query(url, 'up{job="v4serve"}'))


def ask(daemon_url: str) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    reply = httpx.post(f"{daemon_url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]


@pytest.fixture(scope="module")
def scraped(prometheus: tuple[str, int], tmp_path_factory: pytest.TempPathFactory) -> str:
    """Prometheus after device hits in one daemon and disk hits in its successor on the same store."""
    url, port = prometheus
    store = tmp_path_factory.mktemp("store")
    args = ("--served-model-name", "tiny", "--kv-store-dir", str(store))
    for expect in ("device", "disk"):
        daemon = start_daemon(*args, port=port)
        try:
            # A first scrape at zero before any hit, so rate() sees the counters rise.
            time.sleep(1.5)
            wait_for(lambda: scraped_up(url), 20, "a scrape of the daemon")
            if expect == "device":
                ask(daemon.url)
            usage = ask(daemon.url)
            assert usage["prompt_tokens_details"]["cached_tokens"] > 0, (expect, usage)
            time.sleep(3)  # several scrapes after the hit
        finally:
            assert daemon.stop() == 0
    return url


def test_every_dashboard_expression_evaluates(scraped: str) -> None:
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    for _title, expr in exprs:
        query(scraped, expr)  # asserts status success


def test_hit_rate_panels_show_both_sources(scraped: str) -> None:
    panels = {title: expr for title, expr in dashboard_exprs()}
    by_source = {s["metric"]["source"]: float(s["value"][1]) for s in query(scraped, panels["Hit rate by source"])}
    assert by_source.get("device", 0) > 0 and by_source.get("disk", 0) > 0, by_source
    overall = query(scraped, panels["Prefix-cache hit rate (tokens)"])
    assert overall and 0 < float(overall[0]["value"][1]) <= 1


def test_every_alert_expression_evaluates_and_rules_load(scraped: str) -> None:
    for _name, expr in alert_exprs():
        query(scraped, expr)
    rules = httpx.get(f"{scraped}/api/v1/rules", timeout=10).json()["data"]["groups"]
    loaded = {rule["name"] for group in rules for rule in group["rules"]}
    assert loaded == {name for name, _ in alert_exprs()}
    assert all(rule["health"] != "err" for group in rules for rule in group["rules"])


def test_promtool_checks_the_rules() -> None:
    out = subprocess.run(["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alert_exprs())} rules found" in out.stdout
