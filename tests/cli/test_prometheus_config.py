"""The Prometheus scrape config for a `pdserve up` plan (tests/prometheus.py): one target per
process, with the labels the chart's ServiceMonitor gives a cluster's pods, accepted by
the real `promtool`. tests/services/test_prometheus.py runs it on a real Prometheus."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from pdserve.autoscale.adapter_query import parse_rules
from pdserve.cli.launcher import PlatformConfig, plan
from tests.deploy.chart import FULLNAME, render
from tests.prometheus import LOCAL_NAMESPACE, scrape_config, targets, write_scrape_config

SPECS = plan(PlatformConfig(model="m", num_prefill=2, num_decode=1, metrics_base_port=7300), [0, 1])


def _targets_by_pod(config: dict) -> dict[str, tuple[str, str, dict]]:
    """pod -> (job, address, labels)."""
    return {s["labels"]["pod"]: (job["job_name"], s["targets"][0], s["labels"])
            for job in config["scrape_configs"] for s in job["static_configs"]}


def test_every_process_is_one_target_named_as_in_a_cluster():
    found = _targets_by_pod(scrape_config(targets(SPECS, "127.0.0.1"), interval_s=1.0))
    assert found == {
        s.name: (f"pdserve-{s.name.split('-')[0]}", f"127.0.0.1:{s.metrics_port}",
                 {"namespace": LOCAL_NAMESPACE, "pod": s.name, "service": f"pdserve-{s.name.split('-')[0]}",
                  "endpoint": "metrics"})
        for s in SPECS}
    # the dashboard tells the pools apart by Service name, as the chart names them
    assert re.fullmatch(".*-prefill", found["prefill-1"][2]["service"])
    assert re.fullmatch(".*-decode", found["decode-0"][2]["service"])


def test_the_labels_the_adapter_rules_select_on_are_set():
    rules = parse_rules(render().get("ConfigMap", f"{FULLNAME}-adapter-rules")["data"]["config.yaml"])
    wanted = {label for r in rules for label in r.resource_labels.values()}
    for _, _, labels in _targets_by_pod(scrape_config(targets(SPECS, "127.0.0.1"))).values():
        assert wanted <= labels.keys() and all(labels[k] for k in wanted)


def test_promtool_accepts_the_config(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed (`make prometheus`: apt-get install -y prometheus)")
    path = write_scrape_config(str(tmp_path / "prometheus.yml"), scrape_config(targets(SPECS, "127.0.0.1"), 0.5))
    assert yaml.safe_load(open(path))["global"]["scrape_interval"] == "500ms"
    done = subprocess.run([promtool, "check", "config", path], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match="interval_s"):
        scrape_config(targets(SPECS, "127.0.0.1"), interval_s=0)
    with pytest.raises(ValueError, match="'worker-0'"):
        targets([type(SPECS[0])("worker-0", [], "127.0.0.1:1", 9000)], "127.0.0.1")
