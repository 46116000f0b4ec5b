"""kvstore.disk: the kvstore's disk tier (--disk-dir, --disk-capacity-bytes as `pdserve`
accepts them) in a folder `blocks` inside a mounted volume (the volume's own root, 0777 or
group-writable, would be refused), an emptyDir by default or an existing claim (then one
pod at a time: Recreate, and the kubelet's fsGroup walk on the volume's root only);
refused with the redis backend."""
from __future__ import annotations

from tests.deploy.chart import container, render, render_error
from tests.deploy.test_chart_pods import deployment, parse

DISK = ("kvstore.disk.enabled=true", "kvstore.disk.capacityGiB=10")


def _volume(pod_spec: dict, name: str) -> dict:
    return next(v for v in pod_spec["volumes"] if v["name"] == name)


def _security(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]["securityContext"]


def test_no_disk_tier_by_default():
    kvstore = deployment(render(), "kvstore")
    args = parse(container(kvstore))
    assert (args.disk_dir, args.disk_capacity_bytes) == (None, None)
    assert "kv-disk" not in [v["name"] for v in kvstore["spec"]["template"]["spec"]["volumes"]]


def test_the_disk_tier_runs_on_a_sized_emptydir_by_default():
    kvstore = deployment(render(sets=DISK), "kvstore")
    c = container(kvstore)
    args = parse(c)
    assert (args.disk_dir, args.disk_capacity_bytes) == ("/var/lib/pdserve/kvstore/blocks", 10 << 30)
    assert {"name": "kv-disk", "mountPath": "/var/lib/pdserve/kvstore"} in c["volumeMounts"]
    # capacity x 1.125 + 1 GiB: file headers, file system blocks and the file being written
    assert _volume(kvstore["spec"]["template"]["spec"], "kv-disk") == {"name": "kv-disk",
                                                                      "emptyDir": {"sizeLimit": "12544Mi"}}
    assert "strategy" not in kvstore["spec"]
    assert "fsGroupChangePolicy" not in _security(kvstore)  # an emptyDir is new with its pod


def test_an_existing_claim_outlives_the_pod_one_pod_at_a_time():
    rendered = render(sets=(*DISK, "kvstore.disk.existingClaim=kv-cache", "kvstore.disk.mountPath=/cache"))
    kvstore = deployment(rendered, "kvstore")
    assert parse(container(kvstore)).disk_dir == "/cache/blocks"
    assert _volume(kvstore["spec"]["template"]["spec"], "kv-disk")["persistentVolumeClaim"] == {"claimName": "kv-cache"}
    assert kvstore["spec"]["strategy"] == {"type": "Recreate"}
    # the kubelet's walk on every mount would make blocks/ 2770 (refused): the root only
    context = _security(kvstore)
    assert (context["fsGroupChangePolicy"], context["fsGroup"], context["runAsUser"]) == ("OnRootMismatch", 10001, 10001)
    assert "fsGroupChangePolicy" not in _security(deployment(rendered, "router"))
    mine = render(sets=(*DISK, "kvstore.disk.existingClaim=kv-cache", "podSecurityContext.fsGroupChangePolicy=Always"))
    assert _security(deployment(mine, "kvstore"))["fsGroupChangePolicy"] == "Always"  # yours wins


def test_a_trailing_slash_on_the_mount_makes_no_empty_folder_name():
    kvstore = deployment(render(sets=(*DISK, "kvstore.disk.mountPath=/cache/")), "kvstore")
    assert parse(container(kvstore)).disk_dir == "/cache/blocks"


def test_a_disk_tier_with_redis_is_refused():
    error = render_error(*DISK, "kvstore.backend.type=redis", "redis.enabled=true")
    assert "kvstore.disk.enabled=true needs kvstore.backend.type=memory" in error, error


def test_the_schema_refuses_a_relative_mount_and_no_capacity():
    assert "/kvstore/disk/mountPath" in render_error("kvstore.disk.mountPath=cache")
    assert "/kvstore/disk/capacityGiB" in render_error("kvstore.disk.capacityGiB=0")
