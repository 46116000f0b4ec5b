{{/* Checks across values that values.schema.json cannot state well; each fails the
render with a message naming the values. templates/validate.yaml runs them. */}}
{{- define "pdserve.validate" -}}
{{- $v := .Values -}}
{{- if and (eq $v.kvstore.backend.type "memory") (gt (int $v.kvstore.replicas) 1) -}}
{{- fail (printf "kvstore.replicas=%d needs kvstore.backend.type=redis: memory-backend replicas would each hold different blocks" (int $v.kvstore.replicas)) -}}
{{- end -}}
{{- if and $v.kvstore.disk.enabled (ne $v.kvstore.backend.type "memory") -}}
{{- fail (printf "kvstore.disk.enabled=true needs kvstore.backend.type=memory: with %s the blocks live in %s" $v.kvstore.backend.type (ternary "Redis" "Mooncake's store nodes" (eq $v.kvstore.backend.type "redis"))) -}}
{{- end -}}
{{- if eq $v.kvstore.backend.type "mooncake" -}}
{{- include "pdserve.validateMooncake" . -}}
{{- end -}}
{{- if eq $v.kvstore.backend.type "redis" -}}
{{- $r := $v.kvstore.backend.redis -}}
{{- $byo := or $r.url $r.existingSecret.name -}}
{{- if and $r.url $r.existingSecret.name -}}
{{- fail "kvstore.backend.redis: set url or existingSecret.name, not both" -}}
{{- end -}}
{{- if and (not $byo) (not $v.redis.enabled) -}}
{{- fail "kvstore.backend.type=redis needs a Redis: set kvstore.backend.redis.url (or existingSecret.name), or redis.enabled=true for the in-chart one" -}}
{{- end -}}
{{- if and $byo $v.redis.enabled -}}
{{- fail "redis.enabled=true with kvstore.backend.redis.url/existingSecret set: choose the in-chart Redis or your own" -}}
{{- end -}}
{{- else if $v.redis.enabled -}}
{{- fail (printf "redis.enabled=true but kvstore.backend.type=%s: the in-chart Redis would be unused; set kvstore.backend.type=redis" $v.kvstore.backend.type) -}}
{{- end -}}
{{- range $role := list "prefill" "decode" -}}
{{- $pool := index $v $role -}}
{{- $e := include "pdserve.engine" (dict "root" $ "pool" $pool) | fromYaml -}}
{{- $onGPU := hasPrefix "cuda" $e.device -}}
{{- if and $onGPU (eq (int $pool.gpus) 0) -}}
{{- fail (printf "%s: engine.device=%s needs %s.gpus >= 1 (or engine.device=cpu)" $role $e.device $role) -}}
{{- end -}}
{{- if and (not $onGPU) (gt (int $pool.gpus) 0) -}}
{{- fail (printf "%s: %s.gpus=%d with engine.device=cpu would hold GPUs it never uses" $role $role (int $pool.gpus)) -}}
{{- end -}}
{{- if and (eq $e.attentionBackend "triton") (not $onGPU) -}}
{{- fail (printf "%s: engine.attentionBackend=triton needs engine.device=cuda (use torch on cpu)" $role) -}}
{{- end -}}
{{- if and $onGPU (eq $pool.imageVariant "cpu") -}}
{{- fail (printf "%s: engine.device=%s needs %s.imageVariant=cuda" $role $e.device $role) -}}
{{- end -}}
{{- $a := $pool.autoscaling -}}
{{- if and $a.enabled (gt (int $a.minReplicas) (int $a.maxReplicas)) -}}
{{- fail (printf "%s.autoscaling: minReplicas=%d is above maxReplicas=%d" $role (int $a.minReplicas) (int $a.maxReplicas)) -}}
{{- end -}}
{{- end -}}
{{- if $v.prefill.speculativeConfig -}}
{{- fail "prefill.speculativeConfig: prefill workers do not speculate (a prefill-only request ends at its first token); set decode.speculativeConfig" -}}
{{- end -}}
{{- if lt (int $v.router.drainTimeoutSeconds) (int $v.decode.drainTimeoutSeconds) -}}
{{- fail (printf "router.drainTimeoutSeconds=%d is below decode.drainTimeoutSeconds=%d: a stopping router would cut answers its decode workers still finish" (int $v.router.drainTimeoutSeconds) (int $v.decode.drainTimeoutSeconds)) -}}
{{- end -}}
{{- if eq $v.prefill.autoscaling.metric.name $v.decode.autoscaling.metric.name -}}
{{- fail "prefill.autoscaling.metric.name and decode.autoscaling.metric.name must differ (one adapter rule each)" -}}
{{- end -}}
{{- $ports := list (int $v.router.port) (int $v.metricsPort) -}}
{{- if $v.router.http.enabled -}}{{- $ports = append $ports (int $v.router.http.port) -}}{{- end -}}
{{- if ne (len $ports) (len (uniq $ports)) -}}
{{- fail (printf "router: port, http.port and metricsPort must differ, got %v" $ports) -}}
{{- end -}}
{{- range $c := list "prefill" "decode" "kvstore" -}}
{{- if eq (int (index $v $c).port) (int $v.metricsPort) -}}
{{- fail (printf "%s.port=%d is also metricsPort" $c (int (index $v $c).port)) -}}
{{- end -}}
{{- end -}}
{{- end -}}


{{/* kvstore.backend.type=mooncake: the data plane's values against each other and against
the rest (templates/mooncake.yaml). */}}
{{- define "pdserve.validateMooncake" -}}
{{- $v := .Values -}}
{{- $m := $v.kvstore.backend.mooncake -}}
{{- $store := $m.store -}}
{{- if gt (int $v.kvstore.replicas) 1 -}}
{{- fail (printf "kvstore.replicas=%d with kvstore.backend.type=mooncake: the block index lives in the one kvstore process (replicas would each index different blocks); the bytes scale with kvstore.backend.mooncake.store.nodes" (int $v.kvstore.replicas)) -}}
{{- end -}}
{{- if ne $v.kvstore.transport "auto" -}}
{{- fail (printf "kvstore.transport=%s with kvstore.backend.type=mooncake: the workers move the bytes over Mooncake's transfer engine; leave kvstore.transport=auto" $v.kvstore.transport) -}}
{{- end -}}
{{- if gt (int $m.replicas) (int $store.nodes) -}}
{{- fail (printf "kvstore.backend.mooncake.replicas=%d is above kvstore.backend.mooncake.store.nodes=%d: each copy of a block needs a store node of its own" (int $m.replicas) (int $store.nodes)) -}}
{{- end -}}
{{- if eq $m.protocol "rdma" -}}
{{- if not $m.rdma.resources -}}
{{- fail "kvstore.backend.mooncake.protocol=rdma needs kvstore.backend.mooncake.rdma.resources (your RDMA device plugin's resource, e.g. {rdma/hca_shared_devices_a: 1}): without it the store nodes and workers have no RDMA device" -}}
{{- end -}}
{{- else -}}
{{- if $m.rdma.devices -}}
{{- fail (printf "kvstore.backend.mooncake.rdma.devices=%s needs kvstore.backend.mooncake.protocol=rdma" $m.rdma.devices) -}}
{{- end -}}
{{- if $m.rdma.resources -}}
{{- fail (printf "kvstore.backend.mooncake.rdma.resources with kvstore.backend.mooncake.protocol=%s would hold RDMA devices nobody uses" $m.protocol) -}}
{{- end -}}
{{- end -}}
{{- /* the index evicts at 0.85 of what the segments hold (pdserve.mooncakeIndexBytes) */ -}}
{{- if le (float64 $m.master.evictionHighWatermarkRatio) 0.85 -}}
{{- fail (printf "kvstore.backend.mooncake.master.evictionHighWatermarkRatio=%v must be above 0.85, the share the kvstore's index holds: Mooncake would evict blocks the index still names" $m.master.evictionHighWatermarkRatio) -}}
{{- end -}}
{{- $limit := dig "limits" "memory" "" $store.resources -}}
{{- if not $limit -}}
{{- fail "kvstore.backend.mooncake.store.resources.limits.memory is required: each store node's segment is sized against it" -}}
{{- end -}}
{{- $limitBytes := include "pdserve.quantityBytes" (dict "value" $limit) -}}
{{- if not $limitBytes -}}
{{- fail (printf "kvstore.backend.mooncake.store.resources.limits.memory=%v is not a Kubernetes quantity (e.g. 17Gi)" $limit) -}}
{{- end -}}
{{- /* the segment, and 512 MiB for the process (its threads, buffers and metadata: 60 MB measured idle) */ -}}
{{- $needBytes := addf (include "pdserve.mooncakeSegmentBytes" . | float64) 536870912 -}}
{{- if lt ($limitBytes | float64) $needBytes -}}
{{- fail (printf "kvstore.backend.mooncake.store.segmentGiB=%v does not fit kvstore.backend.mooncake.store.resources.limits.memory=%v: a store node needs its segment and 512Mi more (%dMi), or it is OOM-killed once the segment fills" $store.segmentGiB $limit (divf $needBytes 1048576 | ceil | int64)) -}}
{{- end -}}
{{- $first := int $store.transferPorts.first -}}
{{- $last := int $store.transferPorts.last -}}
{{- if lt $last (add $first 1) -}}
{{- fail (printf "kvstore.backend.mooncake.store.transferPorts: first=%d, last=%d leaves fewer than 2 ports (each transfer engine listens on two)" $first $last) -}}
{{- end -}}
{{- /* Mooncake refuses a range that meets the kernel's ephemeral ports (Linux's default in a
pod's network namespace: net.ipv4.ip_local_port_range 32768-60999) and falls back, with a
warning, to 15000-17000, where the NetworkPolicy would not let the workers in */ -}}
{{- if and (le $first 60999) (ge $last 32768) -}}
{{- fail (printf "kvstore.backend.mooncake.store.transferPorts: %d-%d meets the ephemeral port range 32768-60999, which Mooncake refuses (it would listen on 15000-17000 instead, outside the NetworkPolicy); choose a range below 32768 or above 60999" $first $last) -}}
{{- end -}}
{{- range $name, $port := dict "kvstore.backend.mooncake.store.port" (int $store.port) "metricsPort" (int $v.metricsPort) -}}
{{- if and (ge $port $first) (le $port $last) -}}
{{- fail (printf "%s=%d is inside kvstore.backend.mooncake.store.transferPorts (%d-%d)" $name $port $first $last) -}}
{{- end -}}
{{- end -}}
{{- if eq (int $store.port) (int $v.metricsPort) -}}
{{- fail (printf "kvstore.backend.mooncake.store.port=%d is also metricsPort" (int $store.port)) -}}
{{- end -}}
{{- $masterPorts := list (int $m.master.rpcPort) (int $m.master.metadataPort) (int $v.metricsPort) -}}
{{- if ne (len $masterPorts) (len (uniq $masterPorts)) -}}
{{- fail (printf "kvstore.backend.mooncake.master: rpcPort, metadataPort and metricsPort must differ, got %v" $masterPorts) -}}
{{- end -}}
{{- end -}}
