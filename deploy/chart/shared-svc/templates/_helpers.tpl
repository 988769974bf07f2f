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

{{/* Name of the guard's admission objects (cluster-scoped: the namespace is part of it). */}}
{{- define "shared-svc.guardName" -}}
{{- printf "%s-%s-guard" (include "shared-svc.fullname" .) (include "shared-svc.namespace" .) -}}
{{- end -}}

{{/* "true" when the validating (delete-guard) webhook is rendered. */}}
{{- define "shared-svc.admissionValidatingWebhook" -}}
{{- if and .Values.admission.webhook.enabled .Values.admission.deleteGuard -}}true{{- end -}}
{{- end -}}

{{/* "true" when a webhook configuration is rendered (so a serving certificate is needed). */}}
{{- define "shared-svc.anyWebhook" -}}
{{- if or (include "shared-svc.admissionMutatingWebhook" .) (include "shared-svc.admissionValidatingWebhook" .) -}}true{{- end -}}
{{- end -}}

{{/* "true" when the Deployment serves the webhooks in the cluster (behind the Service
<fullname>-webhook); with admission.webhook.url the API server calls that URL instead. */}}
{{- define "shared-svc.webhookServing" -}}
{{- if and (include "shared-svc.anyWebhook" .) (not .Values.admission.webhook.url) -}}true{{- end -}}
{{- end -}}

{{/* The Secret holding the webhook's serving certificate (tls.crt, tls.key, ca.crt). */}}
{{- define "shared-svc.webhookSecret" -}}
{{- .Values.admission.certificate.secretName | default (printf "%s-webhook-tls" (include "shared-svc.fullname" .)) -}}
{{- end -}}

{{/* Annotations of the webhook configurations: cert-manager's CA injector fills the
caBundle from the Certificate's Secret. */}}
{{- define "shared-svc.webhookAnnotations" -}}
{{- if eq .Values.admission.certificate.source "certManager" -}}
annotations:
  cert-manager.io/inject-ca-from: {{ printf "%s/%s-webhook" (include "shared-svc.namespace" .) (include "shared-svc.fullname" .) | quote }}
{{- end -}}
{{- end -}}

{{/* clientConfig of the webhook configurations, for one path. The caBundle is rendered
only with certificate.source=external: otherwise the hook Job (chart) or cert-manager's CA
injector (certManager) writes it, and a rendered value would be reset on every upgrade
or sync. */}}
{{- define "shared-svc.webhookClientConfig" -}}
{{- $w := .root.Values.admission.webhook -}}
{{- $external := eq .root.Values.admission.certificate.source "external" -}}
{{- if and $external (not $w.caBundle) -}}
{{- fail "admission.certificate.source=external needs admission.webhook.caBundle (base64 PEM of the CA that signed the webhook's serving certificate)" -}}
{{- end -}}
{{- if and (not $external) $w.caBundle -}}
{{- fail "admission.webhook.caBundle goes with admission.certificate.source=external (chart and certManager write the caBundle themselves)" -}}
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
{{- if $external }}
caBundle: {{ $w.caBundle | quote }}
{{- end }}
{{- end -}}

{{/* Pod settings shared by the hook Jobs: same image, identity rules and placement. */}}
{{- define "shared-svc.hookPod" -}}
restartPolicy: Never
serviceAccountName: {{ .sa }}
automountServiceAccountToken: true
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  runAsNonRoot: true
  runAsUser: 65532
  runAsGroup: 65532
  seccompProfile:
    type: RuntimeDefault
{{- with .root.Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .root.Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
containers:
  - name: {{ .container }}
    image: "{{ .root.Values.image.repository }}:{{ .root.Values.image.tag | default .root.Chart.AppVersion }}"
    imagePullPolicy: {{ .root.Values.image.pullPolicy }}
    args:
      {{- toYaml .args | nindent 6 }}
    resources:
      requests:
        cpu: 10m
        memory: 64Mi
      limits:
        memory: 128Mi
    securityContext:
      allowPrivilegeEscalation: false
      readOnlyRootFilesystem: true
      runAsNonRoot: true
      capabilities:
        drop: [ALL]
{{- end -}}
