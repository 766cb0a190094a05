{{/* Names, labels and the environment that several templates share. */}}

{{- define "tern.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tern.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "tern.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "tern.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component: include "tern.selectorLabels" (list . "gateway") */}}
{{- define "tern.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "tern.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "tern.componentLabels" -}}
{{ include "tern.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "tern.image" -}}
{{- $root := index . 0 -}}
{{- $image := index . 1 -}}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) -}}
{{- end -}}

{{- define "tern.secretName" -}}
{{- default (include "tern.fullname" .) .Values.secrets.existingSecret -}}
{{- end -}}

{{- define "tern.engineName" -}}
{{- printf "%s-engine" (include "tern.fullname" .) -}}
{{- end -}}

{{- define "tern.postgresName" -}}
{{- printf "%s-postgresql" (include "tern.fullname" .) -}}
{{- end -}}

{{- define "tern.redisName" -}}
{{- printf "%s-redis" (include "tern.fullname" .) -}}
{{- end -}}

{{/*
TERN_ENGINE_URLS. routing: tern: the engine pods, each its own engine to the gateway (it balances,
health-checks and prefix-routes per engine): with engine.discovery=dns one dns+ entry, the headless
Service's name, which the gateway resolves to the pods again before every health round; with static
one URL per pod (the StatefulSet's stable names). routing: inference-pool: the inference Gateway,
which picks the pod through llm-d's endpoint picker. Then gateway.engineUrls.
*/}}
{{- define "tern.engineUrls" -}}
{{- $urls := list -}}
{{- $engine := include "tern.engineName" . -}}
{{- $port := int .Values.engine.port -}}
{{- if eq .Values.routing "inference-pool" -}}
{{- if not .Values.engine.enabled -}}
{{- fail "routing: inference-pool pools the chart's engine pods: set engine.enabled=true" -}}
{{- end -}}
{{- if not .Values.inferencePool.gatewayUrl -}}
{{- fail "routing: inference-pool needs inferencePool.gatewayUrl, your inference Gateway's Service (for example http://inference-gateway.tern.svc:80)" -}}
{{- end -}}
{{- $urls = append $urls (printf "openai+%s" (trimSuffix "/" .Values.inferencePool.gatewayUrl)) -}}
{{- else if and .Values.engine.enabled (eq .Values.engine.discovery "dns") -}}
{{- $urls = append $urls (printf "dns+http://%s.%s.svc:%d" $engine .Release.Namespace $port) -}}
{{- else if .Values.engine.enabled -}}
{{- range $i := until (int .Values.engine.replicas) -}}
{{- $urls = append $urls (printf "http://%s-%d.%s.%s.svc:%d" $engine $i $engine $.Release.Namespace $port) -}}
{{- end -}}
{{- end -}}
{{- $urls = concat $urls .Values.gateway.engineUrls -}}
{{- if not $urls -}}
{{- fail "no engines: set engine.enabled=true or list gateway.engineUrls (for example openai+http://vllm.vllm.svc:8000)" -}}
{{- end -}}
{{- join "," $urls -}}
{{- end -}}

{{- define "tern.poolName" -}}
{{- printf "%s-pool" (include "tern.fullname" .) -}}
{{- end -}}

{{/* llm-d's endpoint picker Service: inferencePool.endpointPicker.service, else <fullname>-epp. */}}
{{- define "tern.eppName" -}}
{{- default (printf "%s-epp" (include "tern.fullname" .)) .Values.inferencePool.endpointPicker.service -}}
{{- end -}}

{{/* TERN_DATABASE_URL as an EnvVar list; the bundled PostgreSQL's password is spliced in by Kubernetes. */}}
{{- define "tern.databaseEnv" -}}
{{- if .Values.postgresql.enabled -}}
- name: POSTGRES_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "tern.postgresName" . }}
      key: password
- name: TERN_DATABASE_URL
  value: {{ printf "postgresql+asyncpg://%s:$(POSTGRES_PASSWORD)@%s:5432/%s" .Values.postgresql.auth.username (include "tern.postgresName" .) .Values.postgresql.auth.database | quote }}
{{- else if .Values.externalDatabase.existingSecret -}}
- name: TERN_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.externalDatabase.existingSecret }}
      key: {{ .Values.externalDatabase.existingSecretKey }}
{{- else if .Values.externalDatabase.url -}}
- name: TERN_DATABASE_URL
  value: {{ .Values.externalDatabase.url | quote }}
{{- else -}}
{{- fail "postgresql.enabled=false needs externalDatabase.existingSecret (or externalDatabase.url)" -}}
{{- end -}}
{{- end -}}

{{- define "tern.redisEnv" -}}
{{- if .Values.redis.enabled -}}
- name: TERN_REDIS_URL
  value: {{ printf "redis://%s:6379/0" (include "tern.redisName" .) | quote }}
{{- else if .Values.externalRedis.existingSecret -}}
- name: TERN_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.externalRedis.existingSecret }}
      key: {{ .Values.externalRedis.existingSecretKey }}
{{- else if .Values.externalRedis.url -}}
- name: TERN_REDIS_URL
  value: {{ .Values.externalRedis.url | quote }}
{{- else -}}
{{- fail "redis.enabled=false needs externalRedis.existingSecret (or externalRedis.url)" -}}
{{- end -}}
{{- end -}}

{{/* The most gateway processes that can run at once: what fail-open limits are divided by. */}}
{{- define "tern.limitsReplicas" -}}
{{- if .Values.gateway.limitsReplicas -}}
{{- .Values.gateway.limitsReplicas -}}
{{- else if .Values.gateway.autoscaling.enabled -}}
{{- mul (int .Values.gateway.autoscaling.maxReplicas) (int .Values.gateway.workers) -}}
{{- else -}}
{{- mul (int .Values.gateway.replicaCount) (int .Values.gateway.workers) -}}
{{- end -}}
{{- end -}}

{{- define "tern.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "tern.containerSecurityContext" -}}
allowPrivilegeEscalation: false
capabilities:
  drop: [ALL]
{{- end -}}
