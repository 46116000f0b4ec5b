"""Values that cannot work are refused at `helm install` time, with a message that names
them: per value by values.schema.json, across values by templates/_validate.tpl."""
from __future__ import annotations

import pytest

from tests.deploy.chart import render_error, render_text

SCHEMA = "values don't meet the specifications of the schema"


@pytest.mark.parametrize("sets,where", [
    (("kvstore.replicas=-1",), "/kvstore/replicas"),
    (("prefill.replicas=-2",), "/prefill/replicas"),
    (("kvstore.backend.type=s3",), "/kvstore/backend/type"),
    (("prefill.imageVariant=rocm",), "/prefill/imageVariant"),
    (("engine.dtype=int4",), "/engine/dtype"),
    (("engine.device=tpu",), "/engine/device"),
    (("router.port=70000",), "/router/port"),
    (("decode.autoscaling.minReplicas=0",), "/decode/autoscaling/minReplicas"),
    (("prefill.autoscaling.metric.quantile=1.5",), "/prefill/autoscaling/metric/quantile"),
    (("prefill.autoscaling.metric.targetSeconds=0",), "/prefill/autoscaling/metric/targetSeconds"),
    (("prefill.autoscaling.metric.name=ttft-p90",), "/prefill/autoscaling/metric/name"),
    (("prefill.autoscaling.metric.window=2 minutes",), "/prefill/autoscaling/metric/window"),
    (("kvstore.capacityGiB=0",), "/kvstore/capacityGiB"),
    (("kvstore.backend.redis.url=memcached://cache:11211",), "/kvstore/backend/redis/url"),
    (("router.sloClasses.fast.ttft_ms=100",), "/router/sloClasses/fast"),   # no itl_ms
    (("router.sloClasses.batch.ttft_ms=-5",), "/router/sloClasses/batch/ttft_ms"),
    (("containerSecurityContext.readOnlyRootFilesystem=false",), "/containerSecurityContext/readOnlyRootFilesystem"),
    (("podSecurityContext.runAsNonRoot=false",), "/podSecurityContext/runAsNonRoot"),
    (("prefil.replicas=3",), "'prefil'"),                     # a typo is not silently ignored
    (("decode.autoscaling.maxReplica=9",), "'maxReplica'"),
])
def test_the_schema_refuses(sets, where):
    error = render_error(*sets)
    assert SCHEMA in error and where in error, error


@pytest.mark.parametrize("sets,message", [
    (("kvstore.replicas=2",), "kvstore.replicas=2 needs kvstore.backend.type=redis"),
    (("kvstore.backend.type=redis",), "kvstore.backend.type=redis needs a Redis"),
    (("kvstore.backend.type=redis", "redis.enabled=true", "kvstore.backend.redis.url=redis://r:6379/0"),
     "choose the in-chart Redis or your own"),
    (("redis.enabled=true",), "the in-chart Redis would be unused"),
    (("prefill.gpus=0",), "prefill: engine.device=cuda needs prefill.gpus >= 1"),
    (("engine.device=cpu",), "prefill: prefill.gpus=1 with engine.device=cpu"),
    (("engine.device=cpu", "prefill.gpus=0", "decode.gpus=0"),
     "engine.attentionBackend=triton needs engine.device=cuda"),
    (("decode.imageVariant=cpu",), "decode: engine.device=cuda needs decode.imageVariant=cuda"),
    (("decode.autoscaling.minReplicas=9", "decode.autoscaling.maxReplicas=4"),
     "decode.autoscaling: minReplicas=9 is above maxReplicas=4"),
    (("router.drainTimeoutSeconds=30",), "router.drainTimeoutSeconds=30 is below decode.drainTimeoutSeconds=105"),
    (("decode.autoscaling.metric.name=pdserve_prefill_ttft_seconds",), "must differ"),
    (("router.http.port=50051",), "router: port, http.port and metricsPort must differ"),
    (("kvstore.port=9090",), "kvstore.port=9090 is also metricsPort"),
])
def test_contradicting_values_are_refused_with_a_message(sets, message):
    error = render_error(*sets)
    assert message in error, error


def test_a_pool_may_override_the_engine_alone():
    """The cross checks read the merged engine: a CPU prefill pool beside a GPU decode pool."""
    text = render_text(sets=("prefill.engine.device=cpu", "prefill.engine.attentionBackend=torch",
                             "prefill.engine.dtype=float32", "prefill.gpus=0", "prefill.imageVariant=cpu"))
    assert "--device=cpu" in text and "--device=cuda" in text
