{{/*
Named templates of the spin chart. Templates under templates/monitoring/ may use:

  spin.name                      root context -> chart name (nameOverride)
  spin.fullname                  root context -> object name prefix (<release>-spin or the release name)
  spin.chart                     root context -> "spin-<chart version>" (helm.sh/chart label value)
  spin.labels                    root context -> common labels of every object (no component):
                                   helm.sh/chart, app.kubernetes.io/{name,instance,version,managed-by}
  spin.selectorLabels            root context -> app.kubernetes.io/{name,instance}: selects every pod
                                   and Service of the release
  spin.componentLabels           (dict "ctx" $ "component" "router") -> spin.labels + component
  spin.componentSelectorLabels   (dict "ctx" $ "component" "router") -> selectorLabels + component
  spin.routerName, spin.verifierName, spin.redisName
                                 root context -> <fullname>-router, -verifier, -redis
  spin.drafterName               (dict "ctx" $ "name" "draft-code") -> <fullname>-drafter-<name>

Every router, drafter and verifier Service and pod names its ports `grpc` and `metrics` (path
/metrics); the drafter and verifier Services carry spin.dev/role (drafter|verifier) and drafter
Services spin.dev/drafter: <name>.
*/}}

{{- define "spin.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "spin.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "spin.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "spin.selectorLabels" -}}
app.kubernetes.io/name: {{ include "spin.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "spin.labels" -}}
helm.sh/chart: {{ include "spin.chart" . }}
{{ include "spin.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "spin.componentLabels" -}}
{{ include "spin.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "spin.componentSelectorLabels" -}}
{{ include "spin.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Selector labels of one draft model's pods. dict "ctx" $ "name" <drafter name> */}}
{{- define "spin.drafterSelectorLabels" -}}
{{ include "spin.componentSelectorLabels" (dict "ctx" .ctx "component" "drafter") }}
spin.dev/drafter: {{ .name }}
{{- end }}

{{- define "spin.routerName" -}}
{{- printf "%s-router" (include "spin.fullname" .) }}
{{- end }}

{{- define "spin.verifierName" -}}
{{- printf "%s-verifier" (include "spin.fullname" .) }}
{{- end }}

{{- define "spin.redisName" -}}
{{- printf "%s-redis" (include "spin.fullname" .) }}
{{- end }}

{{- define "spin.drafterName" -}}
{{- printf "%s-drafter-%s" (include "spin.fullname" .ctx) .name }}
{{- end }}

{{- define "spin.routerServiceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "spin.routerName" .) .Values.serviceAccount.routerName }}
{{- else }}
{{- default "default" .Values.serviceAccount.routerName }}
{{- end }}
{{- end }}

{{- define "spin.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "spin.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Image of the SPIN processes: the CUDA image with gpu.enabled, else the CPU one. */}}
{{- define "spin.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s%s" .Chart.AppVersion (ternary "" "-cpu" .Values.gpu.enabled)) }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{- define "spin.modelsRoot" -}}
{{- if eq .Values.models.source "image" }}{{ .Values.models.imagePath }}{{ else }}{{ .Values.models.mountPath }}{{ end }}
{{- end }}

{{/* A model's directory: absolute as given, else under the models root. dict "ctx" $ "model" <path> */}}
{{- define "spin.modelPath" -}}
{{- if hasPrefix "/" .model }}{{ .model }}{{ else }}{{ printf "%s/%s" (include "spin.modelsRoot" .ctx) .model }}{{ end }}
{{- end }}

{{/* Which Redis the routers use: external | chart | none. */}}
{{- define "spin.redisMode" -}}
{{- if .Values.redis.external.url }}external{{ else if .Values.redis.enabled }}chart{{ else }}none{{ end }}
{{- end }}

{{- define "spin.redisUrl" -}}
{{- $mode := include "spin.redisMode" . }}
{{- if eq $mode "external" }}{{ .Values.redis.external.url }}
{{- else if eq $mode "chart" }}{{ printf "redis://%s:6379/%d" (include "spin.redisName" .) (int .Values.redis.database) }}
{{- end }}
{{- end }}

{{/* Secret name and key of the external Redis password; empty when there is none. */}}
{{- define "spin.redisPasswordSecret" -}}
{{- if eq (include "spin.redisMode" .) "external" }}
{{- if .Values.redis.external.existingSecret }}{{ .Values.redis.external.existingSecret }}
{{- else if .Values.redis.external.password }}{{ printf "%s-redis-password" (include "spin.fullname" .) }}
{{- end }}
{{- end }}
{{- end }}

{{- define "spin.redisPasswordKey" -}}
{{- if .Values.redis.external.existingSecret }}{{ .Values.redis.external.existingSecretKey }}{{ else }}password{{ end }}
{{- end }}

{{/* The device-plugin MPS sharing config (YAML). */}}
{{- define "spin.mpsConfig" -}}
version: v1
sharing:
  mps:
    resources:
      - name: {{ .Values.gpu.resourceName }}
        replicas: {{ .Values.mps.replicas }}
{{- end }}

{{/*
Env of every SPIN container. dict "ctx" $ "service" <OTEL service name> "extra" <EnvVar list>
*/}}
{{- define "spin.env" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- with .ctx.Values.tracing }}
{{- if .enabled }}
- name: OTEL_SERVICE_NAME
  value: {{ $.service | quote }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .otlpEndpoint | quote }}
- name: OTEL_TRACES_SAMPLER
  value: parentbased_traceidratio
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ .sampleRatio | toString | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: k8s.namespace.name=$(POD_NAMESPACE),k8s.pod.name=$(POD_NAME)
{{- end }}
{{- end }}
{{- with .ctx.Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- with .extra }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Model flags of a verifier or drafter container (args list items). dict "c" <role values>
`slots` is the old name of maxSeqs and wins when set; null maxModelLen/kvCacheMemory pass no flag.
*/}}
{{- define "spin.modelArgs" -}}
{{- $c := .c }}
{{- $maxSeqs := $c.maxSeqs | default 64 }}
{{- if $c.slots }}{{ $maxSeqs = $c.slots }}{{ end -}}
- --device
- {{ $c.device | default "auto" | quote }}
- --dtype
- {{ $c.dtype | default "auto" | quote }}
- --max-seqs
- {{ $maxSeqs | int | toString | quote }}
- --gpu-memory-utilization
- {{ (hasKey $c "gpuMemoryUtilization" | ternary $c.gpuMemoryUtilization 0.9) | toString | quote }}
- {{ (hasKey $c "cudaGraphs" | ternary $c.cudaGraphs true) | ternary "--cuda-graphs" "--no-cuda-graphs" }}
- {{ $c.compile | default false | ternary "--compile" "--no-compile" }}
- {{ (hasKey $c "prefixCaching" | ternary $c.prefixCaching true) | ternary "--prefix-caching" "--no-prefix-caching" }}
- --attention
- {{ $c.attention | default "sdpa" | quote }}
{{- with $c.kvCacheMemory }}
- --kv-cache-memory
- {{ . | quote }}
{{- end }}
{{- with $c.maxModelLen }}
- --max-model-len
- {{ . | int | toString | quote }}
{{- end }}
{{- end }}

{{/* Probes of a SPIN container on its grpc port. dict "ctx" $ "port" <int> "startup" <startupProbe values> */}}
{{- define "spin.probes" -}}
{{- $p := .ctx.Values.probes }}
startupProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: {{ .startup.periodSeconds }}
  timeoutSeconds: 5
  failureThreshold: {{ .startup.failureThreshold }}
readinessProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: {{ $p.readiness.periodSeconds }}
  timeoutSeconds: {{ $p.readiness.timeoutSeconds }}
  failureThreshold: {{ $p.readiness.failureThreshold }}
livenessProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: {{ $p.liveness.periodSeconds }}
  timeoutSeconds: {{ $p.liveness.timeoutSeconds }}
  failureThreshold: {{ $p.liveness.failureThreshold }}
{{- end }}

{{/* Container resources plus the GPU request. dict "ctx" $ "resources" <map> "gpus" <int> */}}
{{- define "spin.resources" -}}
{{- $res := deepCopy (.resources | default dict) }}
{{- if and .ctx.Values.gpu.enabled (gt (int .gpus) 0) }}
{{- range $part := list "requests" "limits" }}
{{- $m := dict }}
{{- if hasKey $res $part }}{{ $m = deepCopy (get $res $part) }}{{ end }}
{{- $_ := set $m $.ctx.Values.gpu.resourceName (int $.gpus) }}
{{- $_ := set $res $part $m }}
{{- end }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/* volumeMounts of a SPIN container. dict "ctx" $ "shm" <bool> */}}
{{- define "spin.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /home/spin/.cache
{{- if eq .ctx.Values.models.source "pvc" }}
- name: models
  mountPath: {{ .ctx.Values.models.mountPath }}
  readOnly: true
{{- end }}
{{- if .shm }}
- name: shm
  mountPath: /dev/shm
{{- end }}
{{- end }}

{{/* volumes of a SPIN pod. dict "ctx" $ "shm" <sizeLimit or ""> "models" <bool> */}}
{{- define "spin.volumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .ctx.Values.scratch.tmpSizeLimit }}
- name: cache
  emptyDir:
    sizeLimit: {{ .ctx.Values.scratch.cacheSizeLimit }}
{{- if and .models (eq .ctx.Values.models.source "pvc") }}
- name: models
  persistentVolumeClaim:
    claimName: {{ .ctx.Values.models.pvc.existingClaim | default (printf "%s-models" (include "spin.fullname" .ctx)) }}
    readOnly: {{ not .ctx.Values.models.init.enabled }}
{{- end }}
{{- if .shm }}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shm }}
{{- end }}
{{- end }}

{{/* The optional models fetch init container. dict "ctx" $ "modelPath" <dir> */}}
{{- define "spin.modelsInit" -}}
{{- $i := .ctx.Values.models.init }}
{{- if and $i.enabled (eq .ctx.Values.models.source "pvc") }}
initContainers:
  - name: fetch-models
    image: {{ $i.image }}
    imagePullPolicy: {{ $i.pullPolicy }}
    {{- with $i.command }}
    command:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with $i.args }}
    args:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    env:
      - name: SPIN_MODELS_DIR
        value: {{ .ctx.Values.models.mountPath | quote }}
      - name: SPIN_MODEL_PATH
        value: {{ .modelPath | quote }}
      {{- with $i.env }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    resources:
      {{- toYaml $i.resources | nindent 6 }}
    securityContext:
      {{- toYaml .ctx.Values.securityContext | nindent 6 }}
    volumeMounts:
      - name: tmp
        mountPath: /tmp
      - name: cache
        mountPath: /home/spin/.cache
      - name: models
        mountPath: {{ .ctx.Values.models.mountPath }}
{{- end }}
{{- end }}

{{/*
Pod-level fields shared by the SPIN pods: service account, security, scheduling.
dict "ctx" $ "c" <component values> "selector" <selector labels (YAML string)> "gpu" <bool>
     "serviceAccount" <name> "automountToken" <bool> "nodeSelector" <extra map> "grace" <seconds>
*/}}
{{- define "spin.podCommon" -}}
{{- $ctx := .ctx }}
{{- $c := .c }}
serviceAccountName: {{ .serviceAccount }}
automountServiceAccountToken: {{ .automountToken }}
enableServiceLinks: false
terminationGracePeriodSeconds: {{ add (int .grace) 15 }}
securityContext:
  {{- toYaml $ctx.Values.podSecurityContext | nindent 2 }}
{{- with $ctx.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- $nodeSelector := merge (deepCopy (.nodeSelector | default dict)) (deepCopy ($c.nodeSelector | default dict)) }}
{{- with $nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $tolerations := $c.tolerations | default list }}
{{- if .gpu }}{{ $tolerations = concat $tolerations $ctx.Values.gpu.tolerations }}{{ end }}
{{- with $tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- include "spin.affinity" (dict "c" $c "selector" .selector) }}
{{- with $c.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- range . }}
  {{- $t := deepCopy . }}
  {{- if not (hasKey $t "labelSelector") }}
  {{- $_ := set $t "labelSelector" (dict "matchLabels" (fromYaml $.selector)) }}
  {{- end }}
  - {{ toYaml $t | nindent 4 | trim }}
  {{- end }}
{{- end }}
{{- end }}

{{/* affinity: the component's own, else its podAntiAffinity preset (soft|hard) per node. */}}
{{- define "spin.affinity" -}}
{{- if .c.affinity }}
affinity:
  {{- toYaml .c.affinity | nindent 2 }}
{{- else if eq .c.podAntiAffinity "hard" }}
affinity:
  podAntiAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      - topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- .selector | nindent 12 }}
{{- else if eq .c.podAntiAffinity "soft" }}
affinity:
  podAntiAffinity:
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- .selector | nindent 14 }}
{{- end }}
{{- end }}
