{{/* A worker pool (prefill or decode): Deployment, headless Service (its EndpointSlices
are what the router watches), HPA, PDB and NetworkPolicy. (dict "root" $ "role" "prefill") */}}
{{- define "pdserve.workerPool" -}}
{{- $root := .root -}}
{{- $role := .role -}}
{{- $pool := index $root.Values $role -}}
{{- $fullname := include "pdserve.fullname" $root -}}
{{- $ctx := dict "root" $root "component" $role -}}
{{- $name := printf "%s-%s" $fullname $role -}}
{{- /* engine processes per pod (tensor x pipeline parallel): each takes `gpus` GPUs */ -}}
{{- $ranks := mul (int $pool.tensorParallelSize) (int $pool.pipelineParallelSize) -}}
{{- $gpus := mul (int $pool.gpus) $ranks -}}
{{- $shm := or (gt $gpus 0) (gt $ranks 1) -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  labels:
    {{- include "pdserve.labels" $ctx | nindent 4 }}
spec:
  {{- if not $pool.autoscaling.enabled }}
  replicas: {{ $pool.replicas }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "pdserve.selectorLabels" $ctx | nindent 6 }}
  strategy:
    {{- toYaml $pool.strategy | nindent 4 }}
  template:
    metadata:
      labels:
        {{- include "pdserve.labels" $ctx | nindent 8 }}
      {{- with $pool.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- include "pdserve.podSpecCommon" (dict "root" $root "component" $role "spec" $pool "serviceAccount" (printf "%s-workers" $fullname)) | nindent 6 }}
      containers:
        - name: {{ $role }}
          image: {{ include "pdserve.image" (dict "root" $root "variant" $pool.imageVariant) }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          args:
            {{- include "pdserve.workerArgs" (dict "root" $root "role" $role "pool" $pool) | nindent 12 }}
            # after extraArgs: the GPUs asked for below are computed from these values, so they win
            - --tensor-parallel-size={{ int $pool.tensorParallelSize }}
            - --pipeline-parallel-size={{ int $pool.pipelineParallelSize }}
            {{- include "pdserve.securityArgs" $ctx | nindent 12 }}
          env:
            {{- include "pdserve.env" $root | nindent 12 }}
            {{- include "pdserve.securityEnv" $ctx | nindent 12 }}
          ports:
            - {name: grpc, containerPort: {{ $pool.port }}, protocol: TCP}
            - {name: metrics, containerPort: {{ $root.Values.metricsPort }}, protocol: TCP}
          {{- include "pdserve.probes" (dict "port" (include "pdserve.probePort" (merge (dict "port" $pool.port) $ctx)) "startup" $pool.startupProbe) | nindent 10 }}
          lifecycle:
            {{- include "pdserve.preStop" (dict "root" $root "seconds" $pool.preStopSleepSeconds) | nindent 12 }}
          resources:
            {{- $resources := deepCopy $pool.resources }}
            {{- if gt $gpus 0 }}
            {{- $_ := set $resources "limits" (merge (dict "nvidia.com/gpu" $gpus) (default (dict) $resources.limits)) }}
            {{- end }}
            {{- /* the mooncake backend over RDMA: the device plugin's resources (mooncake.yaml's store nodes ask too) */}}
            {{- with include "pdserve.mooncakeRdmaResources" $root | fromYaml }}
            {{- $_ := set $resources "limits" (merge (deepCopy .) (default (dict) $resources.limits)) }}
            {{- end }}
            {{- toYaml $resources | nindent 12 }}
          securityContext:
            {{- toYaml $root.Values.containerSecurityContext | nindent 12 }}
          volumeMounts:
            {{- include "pdserve.volumeMounts" $root | nindent 12 }}
            {{- include "pdserve.securityVolumeMounts" $ctx | nindent 12 }}
            {{- if $shm }}
            - name: dshm
              mountPath: /dev/shm
            {{- end }}
      volumes:
        {{- include "pdserve.volumes" $root | nindent 8 }}
        {{- include "pdserve.securityVolumes" $ctx | nindent 8 }}
        {{- if $shm }}
        # torch and NCCL need more shared memory than the runtime's 64 MiB default, and the
        # ranks of a tensor/pipeline parallel worker exchange data through it (NCCL's
        # intra-node transport, torch's shared-memory tensors): 2Gi per rank
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: {{ mul 2 $ranks }}Gi
        {{- end }}
---
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}
  labels:
    {{- include "pdserve.labels" $ctx | nindent 4 }}
spec:
  # headless: the router talks to each pod, found through this Service's EndpointSlices
  clusterIP: None
  publishNotReadyAddresses: false
  selector:
    {{- include "pdserve.selectorLabels" $ctx | nindent 4 }}
  ports:
    - {name: grpc, port: {{ $pool.port }}, targetPort: grpc, protocol: TCP, appProtocol: grpc}
    - {name: metrics, port: {{ $root.Values.metricsPort }}, targetPort: metrics, protocol: TCP}
{{- if $pool.autoscaling.enabled }}
{{- $a := $pool.autoscaling }}
---
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ $name }}
  labels:
    {{- include "pdserve.labels" $ctx | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ $name }}
  minReplicas: {{ $a.minReplicas }}
  maxReplicas: {{ $a.maxReplicas }}
  metrics:
    # the pods' {{ $a.metric.quantile }} quantile over {{ $a.metric.window }}, from prometheus-adapter (adapter-rules.yaml)
    - type: Pods
      pods:
        metric:
          name: {{ $a.metric.name }}
        target:
          type: AverageValue
          averageValue: {{ printf "%dm" (round (mulf $a.metric.targetSeconds 1000) 0 | int) }}
  {{- with $a.behavior }}
  behavior:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- if $pool.pdb.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ $name }}
  labels:
    {{- include "pdserve.labels" $ctx | nindent 4 }}
spec:
  maxUnavailable: {{ $pool.pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "pdserve.selectorLabels" $ctx | nindent 6 }}
{{- end }}
{{- if $root.Values.networkPolicy.enabled }}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: {{ $name }}
  labels:
    {{- include "pdserve.labels" $ctx | nindent 4 }}
spec:
  podSelector:
    matchLabels:
      {{- include "pdserve.selectorLabels" $ctx | nindent 6 }}
  policyTypes: [Ingress]
  ingress:
    # work and load polls come from the router only
    - ports:
        - {port: grpc, protocol: TCP}
      from:
        {{- include "pdserve.peer" (dict "root" $root "component" "router") | nindent 8 }}
    {{- include "pdserve.metricsIngress" $root | nindent 4 }}
{{- end }}
{{- end -}}
