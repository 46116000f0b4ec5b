{{/* Credentials and TLS (docs/security.md): the API key on the router's public ports, the
internal token on every internal port, TLS from kubernetes.io/tls Secrets. Each helper
takes (dict "root" $ "component" "router"|"prefill"|"decode"|"kvstore"|"test"). */}}

{{- define "pdserve.apiKeySecret" -}}
{{- $a := .Values.auth.apiKey -}}
{{- if $a.existingSecret -}}{{ $a.existingSecret }}{{- else if $a.value -}}{{ include "pdserve.fullname" . }}-api-key{{- end -}}
{{- end -}}

{{- define "pdserve.internalTokenSecret" -}}
{{- $t := .Values.auth.internalToken -}}
{{- if $t.existingSecret -}}{{ $t.existingSecret }}{{- else if $t.value -}}{{ include "pdserve.fullname" . }}-internal-token{{- end -}}
{{- end -}}

{{/* True ("true") when the component's own gRPC port serves TLS: its probes then use the
plaintext health-only port. */}}
{{- define "pdserve.servesTLS" -}}
{{- $tls := .root.Values.tls -}}
{{- if eq .component "router" -}}{{ if $tls.router.secretName }}true{{ end }}
{{- else if and (ne .component "test") $tls.internal.secretName -}}true{{- end -}}
{{- end -}}

{{- define "pdserve.probePort" -}}
{{- if include "pdserve.servesTLS" . -}}{{ .root.Values.tls.healthPort }}{{- else -}}{{ .port }}{{- end -}}
{{- end -}}

{{- define "pdserve.securityEnv" -}}
{{- $apiKey := include "pdserve.apiKeySecret" .root -}}
{{- $token := include "pdserve.internalTokenSecret" .root -}}
{{- if and $apiKey (has .component (list "router" "test")) }}
- name: PDSERVE_API_KEY
  valueFrom:
    secretKeyRef: {name: {{ $apiKey }}, key: {{ .root.Values.auth.apiKey.key }}}
{{- end }}
{{- if and $token (ne .component "test") }}
- name: PDSERVE_INTERNAL_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ $token }}, key: {{ .root.Values.auth.internalToken.key }}}
{{- end }}
{{- if and .root.Values.tls.router.secretName (eq .component "test") }}
- name: PDSERVE_TLS_CA_FILE
  value: /var/run/pdserve/tls/router/ca.crt
{{- end }}
{{- end -}}

{{- define "pdserve.securityArgs" -}}
{{- $tls := .root.Values.tls -}}
{{- $pub := "/var/run/pdserve/tls/router" -}}
{{- $int := "/var/run/pdserve/tls/internal" -}}
{{- if include "pdserve.servesTLS" . }}
{{- $dir := ternary $pub $int (eq .component "router") }}
- --tls-cert-file={{ $dir }}/tls.crt
- --tls-key-file={{ $dir }}/tls.key
{{- if ne .component "router" }}
- --tls-client-ca-file={{ $int }}/ca.crt
{{- end }}
- --health-port={{ $tls.healthPort }}
{{- end }}
{{- if and $tls.internal.secretName (has .component (list "router" "prefill" "decode")) }}
- --internal-tls-ca-file={{ $int }}/ca.crt
- --internal-tls-cert-file={{ $int }}/tls.crt
- --internal-tls-key-file={{ $int }}/tls.key
- --internal-tls-server-name={{ $tls.internal.serverName }}
{{- end }}
{{- end -}}

{{- define "pdserve.securityVolumeMounts" -}}
{{- if and .root.Values.tls.router.secretName (has .component (list "router" "test")) }}
- {name: tls-router, mountPath: /var/run/pdserve/tls/router, readOnly: true}
{{- end }}
{{- if and .root.Values.tls.internal.secretName (ne .component "test") }}
- {name: tls-internal, mountPath: /var/run/pdserve/tls/internal, readOnly: true}
{{- end }}
{{- end -}}

{{- define "pdserve.securityVolumes" -}}
{{- if and .root.Values.tls.router.secretName (has .component (list "router" "test")) }}
- name: tls-router
  secret: {secretName: {{ .root.Values.tls.router.secretName }}, defaultMode: 0440}
{{- end }}
{{- if and .root.Values.tls.internal.secretName (ne .component "test") }}
- name: tls-internal
  secret: {secretName: {{ .root.Values.tls.internal.secretName }}, defaultMode: 0440}
{{- end }}
{{- end -}}
