{{/*
Names, labels and the pieces every ferry pod shares. Every ferry flag a template passes is one
`ferry router|prefill|decode --help` lists (src/cmd/serve.rs, router/src/config.rs,
worker/src/args.rs, decode/src/server.rs, decode/src/spec.rs); settings that have an
environment variable go through the ConfigMaps instead.
*/}}

{{- define "ferry.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ferry.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "ferry.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "ferry.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ferry
{{- end -}}

{{/* Selector labels of one component: call with (dict "root" $ "component" "router"). */}}
{{- define "ferry.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ferry.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "ferry.image" -}}
{{- $tag := printf "%s%s" (default .Chart.AppVersion .Values.image.tag) .Values.image.tagSuffix -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{- define "ferry.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "ferry.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the cluster token, and its key. */}}
{{- define "ferry.clusterTokenSecret" -}}
{{- default (printf "%s-cluster-token" (include "ferry.fullname" .)) .Values.clusterToken.existingSecret -}}
{{- end -}}
{{- define "ferry.clusterTokenKey" -}}
{{- if .Values.clusterToken.existingSecret -}}{{ .Values.clusterToken.existingSecretKey }}{{- else -}}token{{- end -}}
{{- end -}}

{{/* The Secret holding the API keys file, and its key. */}}
{{- define "ferry.apiKeysSecret" -}}
{{- default (printf "%s-api-keys" (include "ferry.fullname" .)) .Values.apiKeys.existingSecret -}}
{{- end -}}
{{- define "ferry.apiKeysKey" -}}
{{- if .Values.apiKeys.existingSecret -}}{{ .Values.apiKeys.existingSecretKey }}{{- else -}}api-keys{{- end -}}
{{- end -}}

{{/* host:port of the router's internal plane (the Registry), as workers' --router takes it. */}}
{{- define "ferry.routerInternal" -}}
{{- printf "%s-router-internal:%d" (include "ferry.fullname" .) (int .Values.router.ports.internal) -}}
{{- end -}}

{{/* The OTLP/gRPC endpoint every ferry process exports traces to, or "" for none. */}}
{{- define "ferry.otlpEndpoint" -}}
{{- if .Values.otel.collector.enabled -}}
{{- printf "http://%s-otel-collector:4317" (include "ferry.fullname" .) -}}
{{- else -}}
{{- .Values.otel.endpoint -}}
{{- end -}}
{{- end -}}

{{/*
Environment every ferry container gets: who it is (the downward API; workers bind and
advertise $(POD_IP) and use $(POD_NAME) as their worker id), where its traces go, and the
directory the embedded model is unpacked into.
*/}}
{{/* The events plane's URL (`FERRY_EVENTS` of the router and every worker; empty: off):
`events: nats` is this release's NATS Service, which must then run with JetStream. */}}
{{- define "ferry.eventsUrl" -}}
{{- if eq .Values.events "nats" -}}
{{- if not (and .Values.nats.enabled .Values.nats.jetstream) -}}
{{- fail "events: nats needs nats.enabled and nats.jetstream (the KV stream lives in JetStream)" -}}
{{- end -}}
nats://{{ include "ferry.fullname" . }}-nats:4222
{{- else -}}
{{- .Values.events -}}
{{- end -}}
{{- end -}}

{{- define "ferry.commonEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: XDG_CACHE_HOME
  value: /var/lib/ferry/cache
- name: FERRY_LOG
  value: {{ .Values.logLevel | quote }}
{{- with (include "ferry.eventsUrl" .) }}
- name: FERRY_EVENTS
  value: {{ . | quote }}
{{- end }}
{{- with (include "ferry.otlpEndpoint" .) }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: "k8s.namespace.name=$(POD_NAMESPACE),k8s.pod.name=$(POD_NAME)"
{{- with $.Values.otel.sampler }}
- name: OTEL_TRACES_SAMPLER
  value: {{ . | quote }}
{{- end }}
{{- with $.Values.otel.samplerArg }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Volumes every ferry pod mounts: a writable cache and /tmp (the root filesystem is
read-only), the cluster token, and the model volume when one is set. */}}
{{- define "ferry.commonVolumes" -}}
- name: cache
  emptyDir:
    sizeLimit: {{ .Values.cacheSizeLimit }}
- name: tmp
  emptyDir:
    sizeLimit: 256Mi
- name: cluster-token
  secret:
    secretName: {{ include "ferry.clusterTokenSecret" . }}
    defaultMode: 0440
    items:
      - key: {{ include "ferry.clusterTokenKey" . }}
        path: token
{{- with .Values.model.volume }}
- name: model
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "ferry.commonVolumeMounts" -}}
- name: cache
  mountPath: /var/lib/ferry/cache
- name: tmp
  mountPath: /tmp
- name: cluster-token
  mountPath: /etc/ferry/cluster-token
  readOnly: true
{{- if .Values.model.volume }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* Prometheus scrape annotations (the common `prometheus.io/*` convention). */}}
{{- define "ferry.scrapeAnnotations" -}}
{{- if .root.Values.metrics.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- if .https }}
prometheus.io/scheme: https
{{- end }}
{{- end }}
{{- end -}}

{{/* A checksum of what the chart's Secrets are made from (not of their rendered bytes, which
hold random values on a first install), so pods roll when the settings change. */}}
{{- define "ferry.secretsChecksum" -}}
{{- toJson (dict "clusterToken" .Values.clusterToken "apiKeys" .Values.apiKeys) | sha256sum -}}
{{- end -}}
