"""Prometheus against real agents, for tests on this host (tests/host/test_prometheus.py) and in the lab
guest (tests/vm/safety_workloads.py `ejections`, whose root is this machine's, so Debian's prometheus binary
is there too): the dashboard's and rules' queries and selectors, and a prometheus process with its own
configuration, port and data directory (never the packaged service)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "gthulhu-node.json"
RULES = REPO / "deploy" / "prometheus" / "gthulhu-node-rules.yaml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "gthulhu-node-rules.test.yaml"
JOB = "gthulhu-node"
# Grafana's variables, as a query of the dashboard would be sent with "All" selected.
GRAFANA_VARIABLES = {"$instance": ".+", "$intent": ".+", "$__rate_interval": "1m"}
# Metric names the dashboard and the rules use, with the selectors that follow them.
SELECTOR = re.compile(r"\b(?P<name>gthulhu_node_[a-z0-9_]+|up)\b(?P<matchers>\{[^}]*\})?")
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dashboard_queries() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    out: list[str] = []
    for panel in doc["panels"]:
        for target in panel.get("targets", ()):
            expr = target["expr"]
            for var, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"unknown Grafana variable in {target['expr']!r}"
            out.append(expr)
    return out


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def selectors(expr: str) -> list[tuple[str, str]]:
    """(metric name, selector) of every metric an expression reads."""
    return [(m["name"], m["name"] + (m["matchers"] or "")) for m in SELECTOR.finditer(expr)]


class Prometheus:
    """The prometheus binary with a scrape job for one agent and the rules (every `for:` set to 0s, so an
    alert whose condition holds fires at the next evaluation)."""

    def __init__(self, base: Path, metrics_port: int, interval: str = "1s") -> None:
        self.base = base
        self.port = free_port()
        instant = []
        for group in yaml.safe_load(RULES.read_text())["groups"]:
            for rule in group["rules"]:
                rule.pop("for", None)
            instant.append(group)
        (base / "rules.yaml").write_text(yaml.safe_dump({"groups": instant}))
        (base / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(base / "rules.yaml")],
            "scrape_configs": [{"job_name": JOB, "static_configs": [
                {"targets": [f"127.0.0.1:{metrics_port}"]}]}],
        }))
        self.log = base / "prometheus.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                ["prometheus", f"--config.file={base / 'prometheus.yml'}",
                 f"--storage.tsdb.path={base / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120  # a safety net: a Go binary starts slowly under emulation
        while not self._ready():
            if time.monotonic() > deadline:
                raise AssertionError("prometheus did not become ready")
            time.sleep(0.2)

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited:\n{self.log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                doc = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            doc = json.loads(exc.read())
        return doc

    def query(self, expr: str) -> list[dict[str, Any]]:
        doc = self.api("query", query=expr)
        assert doc["status"] == "success", f"{expr}: {doc.get('error')}"
        return list(doc["data"]["result"])

    def last(self, selector: str, window: str = "1m") -> list[dict[str, Any]]:
        """Each series' last sample within `window`. A bare selector answers nothing after one failed scrape
        (Prometheus marks the target's series stale), and a 1 s scrape of an agent beside CPU hogs in an
        emulated guest can miss its timeout: CI of 01d4585 read no per-intent count at all while the
        dashboard's rate over the same series had 19 buckets."""
        return self.query(f"last_over_time({selector}[{window}])")

    def firing(self) -> set[str]:
        alerts = self.api("alerts")["data"]["alerts"]
        return {a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}

    def ever_fired(self, alert: str, window: str = "30m") -> bool:
        """Whether an alert fired at any evaluation in the window (ALERTS is kept like any series), for a
        condition that holds only for seconds."""
        return bool(self.query(f'max_over_time(ALERTS{{alertname="{alert}",alertstate="firing"}}[{window}])'))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
