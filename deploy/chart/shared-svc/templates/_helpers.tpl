{{/* Name of every object: the release name when it already says shared-svc. */}}
{{- define "shared-svc.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The namespace shared-svc runs in and manages: gpu-operator's (the release namespace by default). */}}
{{- define "shared-svc.namespace" -}}
{{- .Values.namespace | default .Release.Namespace -}}
{{- end -}}

{{- define "shared-svc.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "shared-svc.labels" -}}
{{ include "shared-svc.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: gpu-operator
{{- end -}}

{{/* Settings that cannot work together fail the render with a message. */}}
{{- define "shared-svc.validate" -}}
{{- if and (gt (int .Values.replicas) 1) (not .Values.leaderElection.enabled) -}}
{{- fail "replicas > 1 needs leaderElection.enabled=true (otherwise every replica writes)" -}}
{{- end -}}
{{- if not (or .Values.controllers.services .Values.controllers.upgrade) -}}
{{- fail "controllers.services and controllers.upgrade are both false: nothing to run" -}}
{{- end -}}
{{- end -}}
