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

{{/* The admission guard (docs/install.md). "true" when the MutatingAdmissionPolicy is
rendered: admission.mutation=policy, or auto and the API server serves the v1 kind. Helm
knows kinds only from the cluster's discovery (install, upgrade, template --validate or
--api-versions admissionregistration.k8s.io/v1/MutatingAdmissionPolicy); its offline
default capabilities list group/versions only, so `helm template` alone renders none. */}}
{{- define "shared-svc.admissionPolicy" -}}
{{- $served := .Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy" -}}
{{- $mode := .Values.admission.mutation -}}
{{- if or (eq $mode "policy") (and (eq $mode "auto") $served) -}}true{{- end -}}
{{- end -}}

{{/* "true" when the mutating webhook is rendered: the webhook is on, and the mutation is
webhook, or auto where the policy is not served. */}}
{{- define "shared-svc.admissionMutatingWebhook" -}}
{{- $served := .Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy" -}}
{{- $mode := .Values.admission.mutation -}}
{{- if and .Values.admission.webhook.enabled (or (eq $mode "webhook") (and (eq $mode "auto") (not $served))) -}}true{{- end -}}
{{- end -}}

{{/* clientConfig of the webhook configurations, for one path. */}}
{{- define "shared-svc.webhookClientConfig" -}}
{{- $w := .root.Values.admission.webhook -}}
{{- if not $w.caBundle -}}
{{- fail "admission.webhook.enabled needs admission.webhook.caBundle (base64 PEM of the CA that signed the webhook's serving certificate)" -}}
{{- end -}}
{{- if $w.url }}
url: {{ printf "%s%s" (trimSuffix "/" $w.url) .path | quote }}
{{- else }}
service:
  name: {{ include "shared-svc.fullname" .root }}-webhook
  namespace: {{ include "shared-svc.namespace" .root }}
  port: 443
  path: {{ .path | quote }}
{{- end }}
caBundle: {{ $w.caBundle | quote }}
{{- end -}}
