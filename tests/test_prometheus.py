"""The shipped dashboard and alert rules against a real Prometheus scraping a real daemon.

A daemon on loopback answers the same long prompt twice (device hits), is restarted on the same
SSD store and answers it again (disk hits), while Debian's `prometheus` scrapes it every second
(each daemon on a port the system picks: Prometheus's configuration is reloaded with it).
Then every PromQL expression of configs/grafana/dashboards/v4serve.json and configs/alerts.yaml is
evaluated through Prometheus's HTTP API: each must evaluate without error, and the hit-rate panels
must show a rate above zero for both sources. `promtool check rules` must accept the rule file.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.daemon import PATIENCE, ROOT, start_daemon

CONFIGS = ROOT / "configs"
DASHBOARD = CONFIGS / "grafana" / "dashboards" / "v4serve.json"
ALERTS = CONFIGS / "alerts.yaml"

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None or shutil.which("promtool") is None,
    reason="Debian's prometheus package (prometheus, promtool) is not installed: `make test` installs it where "
           "apt-get runs as root",
)

# Grafana's $__rate_interval here: a window that holds every sample the `scraped` fixture leads to,
# however long a busy machine takes between the first daemon's hit and the queries (each of its
# waits is bounded by PATIENCE); what is checked is that the expressions evaluate, and to what sign.
RATE_WINDOW = f"{int(10 * PATIENCE)}s"
HITS = "v4serve_prefix_cache_hits_total"
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
    return expr.replace("$__rate_interval", RATE_WINDOW).replace('"$model"', '".*"')


def listening_port(pid: int) -> int | None:
    """The TCP port process `pid` listens on (from /proc), once it does."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            if (link := os.readlink(fd)).startswith("socket:["):
                inodes.add(link[8:-1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                return int(fields[1].rsplit(":", 1)[1], 16)
    return None


class Prometheus:
    """A real Prometheus on a port the system picks as it binds (`--web.listen-address=127.0.0.1:0`,
    read back from /proc: a port looked up free and bound later could be taken in between), with a
    1 s scrape interval and the alert rules; `scrape` points it at a daemon that already runs."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        shutil.copy(ALERTS, folder / "alerts.yaml")
        self.write_config([])
        self.log = open(folder / "prometheus.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(["prometheus", f"--config.file={folder / 'prometheus.yml'}",
                                      f"--storage.tsdb.path={folder / 'data'}", "--web.listen-address=127.0.0.1:0"],
                                     stdout=self.log, stderr=subprocess.STDOUT)

        def port() -> int | None:
            assert self.proc.poll() is None, f"prometheus exited with {self.proc.returncode}; see {self.log.name}"
            return listening_port(self.proc.pid)

        wait_for(lambda: port() is not None, "Prometheus to listen")
        self.url = f"http://127.0.0.1:{port()}"
        wait_for(lambda: httpx.get(f"{self.url}/-/ready", timeout=PATIENCE).status_code == 200, "Prometheus ready")

    def write_config(self, targets: list[str]) -> None:
        scrape = [{"job_name": "v4serve", "static_configs": [{"targets": targets}]}] if targets else []
        (self.folder / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(self.folder / "alerts.yaml")],
            "scrape_configs": scrape,
        }))

    def scrape(self, daemon_url: str) -> str:
        """Scrape the daemon at `daemon_url` (instead of any other); → its instance label, once it is up."""
        instance = daemon_url.removeprefix("http://")
        self.write_config([instance])
        self.proc.send_signal(signal.SIGHUP)  # reload the configuration
        wait_for(lambda: scraped_up(self.url, instance), f"a scrape of {instance}")
        return instance

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=PATIENCE)
        self.log.close()


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    running = Prometheus(tmp_path_factory.mktemp("prometheus"))
    try:
        yield running
    finally:
        running.stop()


def wait_for(check, what: str) -> None:
    deadline = time.monotonic() + PATIENCE
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"timed out after {PATIENCE:.0f} s waiting for {what}")


def query(url: str, expr: str) -> list[dict]:
    body = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=PATIENCE).json()
    assert body["status"] == "success", f"{expr}: {body}"
    return body["data"]["result"]


def scraped_up(url: str, instance: str) -> bool:
    return any(float(s["value"][1]) == 1 for s in query(url, f'up{{job="v4serve",instance="{instance}"}}'))


def scraped_value(url: str, name: str, instance: str, **labels: str) -> float | None:
    """The latest value Prometheus scraped of one series of the daemon at `instance` (None: none yet)."""
    selector = ",".join(f'{k}="{v}"' for k, v in {"instance": instance, **labels}.items())
    found = query(url, f"{name}{{{selector}}}")
    return float(found[0]["value"][1]) if found else None


def ask(daemon_url: str) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    reply = httpx.post(f"{daemon_url}/v1/completions", json=body, timeout=PATIENCE)
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]


@pytest.fixture(scope="module")
def scraped(prometheus: Prometheus, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Prometheus after device hits in one daemon and disk hits in its successor on the same store."""
    args = ("--served-model-name", "tiny", "--kv-store-dir", str(tmp_path_factory.mktemp("store")))
    serve_a_hit(prometheus, args, "device")
    serve_a_hit(prometheus, args, "disk")  # the same store, restarted: its files are read back
    return prometheus.url


def serve_a_hit(prometheus: Prometheus, args: tuple[str, ...], source: str) -> None:
    """A daemon, scraped once it runs, with a prefix hit from `source` between two of its scrapes
    (so rate() sees the counter rise, whatever the time between), then stopped."""
    daemon = start_daemon(*args)
    try:
        instance = prometheus.scrape(daemon.url)

        def hits() -> float | None:
            return scraped_value(prometheus.url, HITS, instance, source=source)

        wait_for(lambda: hits() == 0, f"a scrape before the {source} hit")
        if source == "device":
            ask(daemon.url)  # a miss that caches the prompt
        usage = ask(daemon.url)
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0, (source, usage)
        wait_for(lambda: (hits() or 0) > 0, f"a scrape after the {source} hit")
    finally:
        assert daemon.stop() == 0


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
    rules = httpx.get(f"{scraped}/api/v1/rules", timeout=PATIENCE).json()["data"]["groups"]
    loaded = {rule["name"] for group in rules for rule in group["rules"]}
    assert loaded == {name for name, _ in alert_exprs()}
    assert all(rule["health"] != "err" for group in rules for rule in group["rules"])


def test_promtool_checks_the_rules() -> None:
    out = subprocess.run(["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alert_exprs())} rules found" in out.stdout
