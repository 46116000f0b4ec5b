{{/* Checks across values that values.schema.json cannot state well; each fails the
render with a message naming the values. templates/validate.yaml runs them. */}}
{{- define "pdserve.validate" -}}
{{- $v := .Values -}}
{{- if and (eq $v.kvstore.backend.type "memory") (gt (int $v.kvstore.replicas) 1) -}}
{{- fail (printf "kvstore.replicas=%d needs kvstore.backend.type=redis: memory-backend replicas would each hold different blocks" (int $v.kvstore.replicas)) -}}
{{- end -}}
{{- if and $v.kvstore.disk.enabled (ne $v.kvstore.backend.type "memory") -}}
{{- fail "kvstore.disk.enabled=true needs kvstore.backend.type=memory: with Redis the blocks live in Redis" -}}
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
{{- fail "redis.enabled=true but kvstore.backend.type=memory: the in-chart Redis would be unused; set kvstore.backend.type=redis" -}}
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
