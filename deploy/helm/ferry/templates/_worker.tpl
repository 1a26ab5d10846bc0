{{/*
A worker role: StatefulSet (stable pod names = stable worker ids), headless Service (stable DNS
names and the metrics port for scraping; nothing load-balances through it) and a
PodDisruptionBudget. Call with (dict "root" $ "role" "prefill"|"decode").
*/}}
{{- define "ferry.worker" -}}
{{- $root := .root -}}
{{- $role := .role -}}
{{- $v := index $root.Values $role -}}
{{- $fullname := include "ferry.fullname" $root -}}
{{- $name := printf "%s-%s" $fullname $role -}}
{{- $service := ternary "ferry.internal.v1.DecodeWorker" "ferry.internal.v1.PrefillWorker" (eq $role "decode") -}}
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: {{ $name }}
  labels:
    {{- include "ferry.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ $role }}
spec:
  serviceName: {{ $name }}
  replicas: {{ $v.replicas }}
  # Workers do not depend on each other: start and replace them all at once.
  podManagementPolicy: Parallel
  updateStrategy:
    type: RollingUpdate
  selector:
    matchLabels:
      {{- include "ferry.selectorLabels" (dict "root" $root "component" $role) | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "ferry.selectorLabels" (dict "root" $root "component" $role) | nindent 8 }}
        app.kubernetes.io/part-of: ferry
        {{- with $v.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        checksum/config: {{ include (print $root.Template.BasePath "/configmap.yaml") $root | sha256sum }}
        checksum/secrets: {{ include "ferry.secretsChecksum" $root }}
        {{- include "ferry.scrapeAnnotations" (dict "root" $root "port" $v.ports.metrics "https" false) | nindent 8 }}
        {{- with $v.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      serviceAccountName: {{ include "ferry.serviceAccountName" $root }}
      automountServiceAccountToken: {{ $root.Values.serviceAccount.automountToken }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.runtimeClassName }}
      runtimeClassName: {{ . }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
      containers:
        - name: {{ $role }}
          image: {{ include "ferry.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          args:
            - {{ $role }}
            - --router={{ include "ferry.routerInternal" $root }}
            - --cluster-token-file=/etc/ferry/cluster-token/token
            # The pod name: stable across restarts, unique in the cluster.
            - --worker-id=$(POD_NAME)
            # ferry registers the address it binds, so bind the pod IP (not 0.0.0.0).
            - --grpc-addr=$(POD_IP):{{ $v.ports.grpc }}
            - --metrics-addr=0.0.0.0:{{ $v.ports.metrics }}
            - --kv-blocks={{ $v.kvBlocks }}
            - --max-batch-tokens={{ $v.maxBatchTokens }}
            - --max-running={{ $v.maxRunning }}
            - --max-in-flight={{ $v.maxInFlight }}
            - --heartbeat-ms={{ $v.heartbeatMs }}
            {{- if eq $role "decode" }}
            - --transfer-addr=$(POD_IP):{{ $v.ports.transfer }}
            - --local-prefill-threshold={{ $v.localPrefillThreshold }}
            - --on-prefill-failure={{ $v.onPrefillFailure }}
            - --prefill-timeout-s={{ $v.prefillTimeoutS }}
            - --verify-len={{ $v.verifyLen }}
            - --max-verify-tokens={{ $v.maxVerifyTokens }}
            {{- end }}
            {{- with $v.extraArgs }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          env:
            {{- include "ferry.commonEnv" $root | nindent 12 }}
            {{- with $v.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          envFrom:
            - configMapRef:
                name: {{ $fullname }}-model
          ports:
            - name: grpc
              containerPort: {{ $v.ports.grpc }}
              protocol: TCP
            {{- if eq $role "decode" }}
            - name: transfer
              containerPort: {{ $v.ports.transfer }}
              protocol: TCP
            {{- end }}
            - name: metrics
              containerPort: {{ $v.ports.metrics }}
              protocol: TCP
          # The gRPC listener opens once the model is loaded and the engine started.
          startupProbe:
            grpc:
              port: {{ $v.ports.grpc }}
            periodSeconds: {{ $v.startupProbe.periodSeconds }}
            failureThreshold: {{ $v.startupProbe.failureThreshold }}
            timeoutSeconds: 3
          # Whole server ("" service): SERVING while the process runs.
          livenessProbe:
            grpc:
              port: {{ $v.ports.grpc }}
            periodSeconds: 10
            timeoutSeconds: 3
            failureThreshold: 3
          # The role's service: NOT_SERVING once the worker starts shutting down.
          readinessProbe:
            grpc:
              port: {{ $v.ports.grpc }}
              service: {{ $service }}
            periodSeconds: 5
            timeoutSeconds: 3
            failureThreshold: 2
          resources:
            {{- $res := deepCopy $v.resources }}
            {{- if gt (int $v.gpus) 0 }}
            {{- $limits := default (dict) $res.limits }}
            {{- $_ := set $limits "nvidia.com/gpu" (int $v.gpus) }}
            {{- $_ := set $res "limits" $limits }}
            {{- end }}
            {{- toYaml $res | nindent 12 }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          volumeMounts:
            {{- include "ferry.commonVolumeMounts" $root | nindent 12 }}
      volumes:
        {{- include "ferry.commonVolumes" $root | nindent 8 }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- toYaml . | nindent 8 }}
      {{- end }}
---
# Headless: per-pod DNS names ({{ $name }}-N.{{ $name }}) and the metrics port for
# ServiceMonitor. The router reaches workers at the pod IPs they register, not through this.
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}
  labels:
    {{- include "ferry.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ $role }}
spec:
  clusterIP: None
  publishNotReadyAddresses: true
  selector:
    {{- include "ferry.selectorLabels" (dict "root" $root "component" $role) | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $v.ports.grpc }}
      targetPort: grpc
      protocol: TCP
      appProtocol: kubernetes.io/h2c
    {{- if eq $role "decode" }}
    - name: transfer
      port: {{ $v.ports.transfer }}
      targetPort: transfer
      protocol: TCP
    {{- end }}
    - name: metrics
      port: {{ $v.ports.metrics }}
      targetPort: metrics
      protocol: TCP
      appProtocol: http
{{- if $v.pdb.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ $name }}
  labels:
    {{- include "ferry.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ $role }}
spec:
  maxUnavailable: {{ $v.pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "ferry.selectorLabels" (dict "root" $root "component" $role) | nindent 6 }}
{{- end }}
{{- end -}}
