{{/* Names, labels and the pod parts every component shares. */}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's prefix of every object name; components append -router, -prefill, ... */}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else if contains (include "pdserve.name" .) .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "pdserve.name" .) | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Selector labels of one component: (dict "root" $ "component" "router") */}}
{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pdserve.labels" -}}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/part-of: pdserve
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Labels of release-wide objects (no component). */}}
{{- define "pdserve.releaseLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: pdserve
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* image:tag-variant, e.g. pdserve:0.1.0-cuda: (dict "root" $ "variant" "cuda") */}}
{{- define "pdserve.image" -}}
{{- $tag := default .root.Chart.AppVersion .root.Values.image.tag -}}
{{- printf "%s:%s-%s" .root.Values.image.repository $tag .variant -}}
{{- end -}}

{{- define "pdserve.kvstoreAddress" -}}
{{- printf "%s-kvstore:%d" (include "pdserve.fullname" .) (int .Values.kvstore.port) -}}
{{- end -}}

{{/* How the workers move KV bytes (--kvstore-transport): over Mooncake's transfer engine
with the mooncake backend, else kvstore.transport, where auto is tcp (a decode receiving a
long prompt's KV over gRPC spends its own CPU on it: docs/kvstore.md). */}}
{{- define "pdserve.kvTransport" -}}
{{- $t := .Values.kvstore.transport -}}
{{- if eq .Values.kvstore.backend.type "mooncake" -}}mooncake{{- else if eq $t "auto" -}}tcp{{- else -}}{{ $t }}{{- end -}}
{{- end -}}

{{/* The Mooncake master's Service (and Deployment) name: the endpoint every Mooncake
client is given. Short, so that a 50-character fullname still makes a valid Service name. */}}
{{- define "pdserve.mooncakeMasterHost" -}}
{{- printf "%s-mooncake" (include "pdserve.fullname" .) -}}
{{- end -}}

{{- define "pdserve.mooncakeMaster" -}}
{{- printf "%s:%d" (include "pdserve.mooncakeMasterHost" .) (int .Values.kvstore.backend.mooncake.master.rpcPort) -}}
{{- end -}}

{{/* The transfer engine's metadata server: the master's HTTP one. */}}
{{- define "pdserve.mooncakeMetadata" -}}
{{- printf "http://%s:%d/metadata" (include "pdserve.mooncakeMasterHost" .) (int .Values.kvstore.backend.mooncake.master.metadataPort) -}}
{{- end -}}

{{/* Bytes of one store node's segment. */}}
{{- define "pdserve.mooncakeSegmentBytes" -}}
{{- mulf .Values.kvstore.backend.mooncake.store.segmentGiB 1073741824 | int64 -}}
{{- end -}}

{{/* The kvstore's --capacity-bytes with the mooncake backend: 0.85 (cli/mooncake_procs.py's
INDEX_SHARE) of what the segments hold once each block has its copies, so the index evicts
(and removes from Mooncake) before the master's own eviction watermark. */}}
{{- define "pdserve.mooncakeIndexBytes" -}}
{{- $m := .Values.kvstore.backend.mooncake -}}
{{- divf (mulf (include "pdserve.mooncakeSegmentBytes" . | float64) (int $m.store.nodes) 0.85) (int $m.replicas) | int64 -}}
{{- end -}}

{{/* The RDMA device plugin's resources a Mooncake transfer engine's pod asks for: those of
kvstore.backend.mooncake.rdma.resources with the rdma protocol, else none (a YAML map). */}}
{{- define "pdserve.mooncakeRdmaResources" -}}
{{- $m := .Values.kvstore.backend.mooncake -}}
{{- if and (eq .Values.kvstore.backend.type "mooncake") (eq $m.protocol "rdma") -}}
{{- toYaml $m.rdma.resources -}}
{{- else -}}
{}
{{- end -}}
{{- end -}}

{{/* Environment of Mooncake's own programs (master, store nodes): glog to stderr, at
logLevel, except that INFO shows WARNING and up (Mooncake logs every connection and
segment at INFO; DEBUG shows all). The transfer engine sets glog's level again from
MC_LOG_LEVEL (INFO when unset), so both are set. */}}
{{- define "pdserve.mooncakeEnv" -}}
{{- $glog := dict "DEBUG" "0" "INFO" "1" "WARNING" "1" "ERROR" "2" "CRITICAL" "2" -}}
{{- $mc := dict "DEBUG" "INFO" "INFO" "WARNING" "WARNING" "WARNING" "ERROR" "ERROR" "CRITICAL" "ERROR" -}}
- name: GLOG_logtostderr
  value: "1"
- name: GLOG_minloglevel
  value: {{ index $glog .Values.logLevel | quote }}
- name: MC_LOG_LEVEL
  value: {{ index $mc .Values.logLevel | quote }}
- name: HOME
  value: /tmp
{{- end -}}

{{/* A Kubernetes quantity ("17Gi", "18253611008", "500M") in bytes, as a float; "" when it
is not one. (dict "value" .) */}}
{{- define "pdserve.quantityBytes" -}}
{{- $v := .value -}}
{{- if or (kindIs "float64" $v) (kindIs "int64" $v) (kindIs "int" $v) -}}
{{- $v | float64 -}}
{{- else if kindIs "string" $v -}}
{{- $num := regexFind "^[0-9]+(\\.[0-9]+)?" $v -}}
{{- $units := dict "" 1.0 "m" 0.001 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 -}}
{{- $unit := trimPrefix $num $v -}}
{{- if and $num (hasKey $units $unit) -}}
{{- mulf ($num | float64) (index $units $unit) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The engine settings of a pool: the global engine with the pool's overrides. */}}
{{- define "pdserve.engine" -}}
{{- toYaml (merge (deepCopy .pool.engine) .root.Values.engine) -}}
{{- end -}}

{{/* The worker command line of a pool: (dict "root" $ "role" "prefill" "pool" .Values.prefill) */}}
{{- define "pdserve.workerArgs" -}}
{{- $root := .root -}}
{{- $e := include "pdserve.engine" . | fromYaml -}}
- {{ .role }}
- --model={{ $root.Values.model.name }}
{{- with $root.Values.model.quantization }}
- --quantization={{ . }}
{{- end }}
{{- with $root.Values.router.servedModelName }}
{{- /* the workers label their vllm: metrics (model_name) with the name clients use */}}
- --served-model-name
{{- range (kindIs "string" . | ternary (list .) .) }}
- {{ . | quote }}
{{- end }}
{{- end }}
- --host={{ $root.Values.listenHost }}
- --port={{ .pool.port }}
- --metrics-port={{ $root.Values.metricsPort }}
- --kvstore={{ include "pdserve.kvstoreAddress" $root }}
- --kvstore-transport={{ include "pdserve.kvTransport" $root }}
- --drain-timeout-s={{ .pool.drainTimeoutSeconds }}
- --device={{ $e.device }}
- --dtype={{ $e.dtype }}
- --attention-backend={{ $e.attentionBackend }}
- --max-num-seqs={{ $e.maxNumSeqs }}
- --max-num-batched-tokens={{ $e.maxNumBatchedTokens }}
- --long-prefill-token-threshold={{ $e.longPrefillTokenThreshold }}
{{- if $e.maxModelLen }}
- --max-model-len={{ $e.maxModelLen }}
{{- end }}
{{- if $e.kvCacheMemoryBytes }}
- --kv-cache-memory-bytes={{ int64 $e.kvCacheMemoryBytes }}
{{- end }}
{{- with .pool.gpuMemoryUtilization }}
- --gpu-memory-utilization={{ . }}
{{- end }}
{{- if not $e.prefixCaching }}
- --no-prefix-caching
{{- end }}
{{- with .pool.speculativeConfig }}
- {{ printf "--speculative-config=%s" (toJson .) | quote }}
{{- end }}
{{- range .pool.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* The pod-level fields every pdserve pod has. (dict "root" $ "component" "router" "spec" .Values.router "serviceAccount" name
[ "securityContext" dict: in place of .Values.podSecurityContext ]) */}}
{{- define "pdserve.podSpecCommon" -}}
serviceAccountName: {{ .serviceAccount }}
automountServiceAccountToken: {{ eq .component "router" }}
enableServiceLinks: false
securityContext:
  {{- toYaml (get . "securityContext" | default .root.Values.podSecurityContext) | nindent 2 }}
terminationGracePeriodSeconds: {{ include "pdserve.terminationGrace" .spec }}
{{- with .root.Values.image.pullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* A pod's grace period. Router and workers: the preStop pause, then their drain
(--drain-timeout-s, the same value) and a margin to exit after it (final messages, the
last KV writes, the engine's stop), so Kubernetes never kills a drain it asked for. The
kvstore, with no drain of its own, sets terminationGracePeriodSeconds. */}}
{{- define "pdserve.terminationGrace" -}}
{{- if hasKey . "drainTimeoutSeconds" -}}
{{- add (int .preStopSleepSeconds) (int .drainTimeoutSeconds) 10 -}}
{{- else -}}
{{- .terminationGracePeriodSeconds -}}
{{- end -}}
{{- end -}}

{{/* Environment of every pdserve container: caches on the writable /tmp. */}}
{{- define "pdserve.env" -}}
- name: PDSERVE_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/.cache
- name: TRITON_CACHE_DIR
  value: /tmp/.cache/triton
- name: HF_HOME
  value: /tmp/.cache/huggingface
- name: PYTHONUNBUFFERED
  value: "1"
{{- end -}}

{{- define "pdserve.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if .Values.model.persistentVolumeClaim }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "pdserve.volumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmpSizeLimit }}
{{- if .Values.model.persistentVolumeClaim }}
- name: model
  persistentVolumeClaim:
    claimName: {{ .Values.model.persistentVolumeClaim }}
    readOnly: true
{{- end }}
{{- end -}}

{{/* Probes on the standard gRPC health service. Readiness follows the health status (a
draining server answers NOT_SERVING and leaves the EndpointSlices); liveness only asks
that the port accepts connections, so a pod that drains is not killed for it. */}}
{{- define "pdserve.probes" -}}
startupProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: {{ .startup.periodSeconds }}
  failureThreshold: {{ .startup.failureThreshold }}
readinessProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: 5
  timeoutSeconds: 2
  failureThreshold: 2
livenessProbe:
  tcpSocket:
    port: grpc
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- end -}}

{{/* A pause before SIGTERM, so every router has seen the pod leave the EndpointSlices.
The sleep action needs no binary in the image (beta, on by default, from 1.30). */}}
{{- define "pdserve.preStop" -}}
{{- if semverCompare ">=1.30.0-0" .root.Capabilities.KubeVersion.Version -}}
preStop:
  sleep:
    seconds: {{ .seconds }}
{{- else -}}
preStop:
  exec:
    command: ["sleep", "{{ .seconds }}"]
{{- end }}
{{- end -}}

{{/* The ingress rule that lets Prometheus scrape a pod's metrics port; none when
networkPolicy.metricsFrom is empty. */}}
{{- define "pdserve.metricsIngress" -}}
{{- with .Values.networkPolicy.metricsFrom -}}
# Prometheus: the metrics port only
- ports:
    - {port: metrics, protocol: TCP}
  from:
    {{- toYaml . | nindent 4 }}
{{- end }}
{{- end -}}

{{/* A NetworkPolicy peer: the pods of one component of this release. */}}
{{- define "pdserve.peer" -}}
- podSelector:
    matchLabels:
      {{- include "pdserve.selectorLabels" . | nindent 6 }}
{{- end -}}
