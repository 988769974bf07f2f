{{/* The chart's name, or nameOverride: app.kubernetes.io/name. */}}
{{- define "shared-svc.name" -}}
{{- .Values.nameOverride | default .Chart.Name | trunc 52 | trimSuffix "-" -}}
{{- end -}}

{{/* Name of every object: fullnameOverride, else the release name when it already says
the chart's name, else <release>-<name>. 52 characters: suffixes (-webhook-tls,
-cluster-events, -guard-remove) keep the names within 63. */}}
{{- define "shared-svc.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "shared-svc.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* helm.sh/chart: <chart>-<version>. */}}
{{- define "shared-svc.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The namespace shared-svc runs in and manages: gpu-operator's. namespaceOverride, else
the release namespace. */}}
{{- define "shared-svc.namespace" -}}
{{- .Values.namespaceOverride | default .Release.Namespace -}}
{{- end -}}

{{/* The Deployment's ServiceAccount (the one its RBAC binds). The hook Jobs have their
own (<fullname>-certs, <fullname>-guard-remove). */}}
{{- define "shared-svc.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (include "shared-svc.fullname" .) -}}
{{- else -}}
{{- required "serviceAccount.create=false needs serviceAccount.name (an existing ServiceAccount; the chart binds its RBAC to it)" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The image: repository@digest when image.digest is set (the digest wins over the
tag), else repository:tag (the chart's appVersion by default). */}}
{{- define "shared-svc.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{- define "shared-svc.selectorLabels" -}}
app.kubernetes.io/name: {{ include "shared-svc.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels of every object the chart renders (the recommended app.kubernetes.io set). */}}
{{- define "shared-svc.labels" -}}
helm.sh/chart: {{ include "shared-svc.chart" . }}
{{ include "shared-svc.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: controller
app.kubernetes.io/part-of: gpu-operator
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Settings that cannot work together fail the render with a message. */}}
{{- define "shared-svc.validate" -}}
{{- if and (gt (int .Values.replicas) 1) (not .Values.leaderElection.enabled) -}}
{{- fail "replicas > 1 needs leaderElection.enabled=true (otherwise every replica writes)" -}}
{{- end -}}
{{- if not (or .Values.controllers.services .Values.controllers.upgrade) -}}
{{- fail "controllers.services and controllers.upgrade are both false: nothing to run" -}}
{{- end -}}
{{- $w := .Values.admission.webhook -}}
{{- if and (eq .Values.admission.certificate.source "serviceCA") $w.url -}}
{{- fail "admission.certificate.source=serviceCA: the service CA operator signs the webhook Service's name, which admission.webhook.url does not call" -}}
{{- end -}}
{{- if $w.hostNetwork -}}
{{- if $w.url -}}
{{- fail "admission.webhook.hostNetwork serves the webhook from the pods: it does not go with admission.webhook.url" -}}
{{- end -}}
{{- if has (int $w.port) (list 10250 10255 10256 (int .Values.port)) -}}
{{- fail (printf "admission.webhook.hostNetwork: admission.webhook.port %d is taken on the node (the kubelet's 10250/10255, kube-proxy's 10256, or shared-svc's own port); choose a free one (docs/install.md)" (int $w.port)) -}}
{{- end -}}
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
caBundle from the Certificate's Secret; OpenShift's service CA operator injects its own CA
bundle. */}}
{{- define "shared-svc.webhookAnnotations" -}}
{{- if eq .Values.admission.certificate.source "certManager" -}}
annotations:
  cert-manager.io/inject-ca-from: {{ printf "%s/%s-webhook" (include "shared-svc.namespace" .) (include "shared-svc.fullname" .) | quote }}
{{- else if eq .Values.admission.certificate.source "serviceCA" -}}
annotations:
  service.beta.openshift.io/inject-cabundle: "true"
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

{{/* Pod settings shared by the hook Jobs: same image, identity rules and placement as
the Deployment (its affinity is the Deployment's own spreading: not here). */}}
{{- define "shared-svc.hookPod" -}}
restartPolicy: Never
serviceAccountName: {{ .sa }}
automountServiceAccountToken: true
enableServiceLinks: false
{{- with .root.Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .root.Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
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
    image: {{ include "shared-svc.image" .root | quote }}
    imagePullPolicy: {{ .root.Values.image.pullPolicy }}
    args:
      {{- toYaml .args | nindent 6 }}
    {{- with .root.Values.hooks.resources }}
    resources:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with .root.Values.securityContext }}
    securityContext:
      {{- toYaml . | nindent 6 }}
    {{- end }}
{{- end -}}

{{/* One alert of the PrometheusRule, unless prometheusRule.disabled.<name>: its severity
and prometheusRule.alertLabels (the severity wins), summary, description (%s: the
namespace) and runbook_url (prometheusRule.runbookBaseUrl#<name in lower case>: the
alert's section of docs/operations.md; by default docs/operations.md of the chart's own
version at Chart.yaml's home: <home>/blob/v<version>/docs/operations.md). */}}
{{- define "shared-svc.alert" -}}
{{- $v := .root.Values.prometheusRule -}}
{{- if not (index ($v.disabled | default dict) .name) -}}
- alert: {{ .name }}
  expr: |-
    {{- .expr | nindent 4 }}
  for: {{ index ($v.for | default dict) .name | default .for }}
  {{- with $v.keepFiringFor }}
  keep_firing_for: {{ . }}
  {{- end }}
  labels:
    {{- toYaml (merge (dict "severity" .severity) $v.alertLabels) | nindent 4 }}
  annotations:
    {{- $base := $v.runbookBaseUrl | default (printf "%s/blob/v%s/docs/operations.md" .root.Chart.Home .root.Chart.Version) }}
    {{- $own := dict "summary" .summary "description" (printf .description .ns) "runbook_url" (printf "%s#%s" $base (lower .name)) }}
    {{- range $key, $value := merge $own (deepCopy ($v.alertAnnotations | default dict)) }}
    {{ $key | quote }}: {{ $value | quote }}
    {{- end }}
{{- end -}}
{{- end -}}

{{/* The labels a Prometheus (kube-prometheus-stack's) selects a ServiceMonitor or a
PrometheusRule by: release: <.release> (unless empty), then .labels (which win), as YAML
lines; nothing when both are empty. */}}
{{- define "shared-svc.monitoringLabels" -}}
{{- $out := deepCopy (.labels | default dict) -}}
{{- if and .release (not (hasKey $out "release")) -}}
{{- $_ := set $out "release" .release -}}
{{- end -}}
{{- with $out -}}
{{- toYaml . -}}
{{- end -}}
{{- end -}}


{{/* Argo CD's own hook annotations beside Helm's pre-delete hook: Argo CD runs no Helm
pre-delete hook, its PreDelete phase runs before it deletes an Application's objects. */}}
{{- define "shared-svc.argoPreDelete" -}}
argocd.argoproj.io/hook: PreDelete
argocd.argoproj.io/hook-delete-policy: BeforeHookCreation,HookSucceeded
{{- end -}}

{{/* The shared-svc container's env (a YAML list): the settings the chart passes. */}}
{{- define "shared-svc.env" -}}
{{- $le := .Values.leaderElection -}}
- name: OPERATOR_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: SHARED_SVC_PORT
  value: {{ .Values.port | quote }}
- name: SHARED_SVC_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
- name: SHARED_SVC_SERVICES_CONTROLLER
  value: {{ .Values.controllers.services | quote }}
- name: SHARED_SVC_SELECTOR_MODE
  value: {{ .Values.selectorMode | quote }}
- name: SHARED_SVC_ADOPT
  value: {{ .Values.adopt | quote }}
- name: SHARED_SVC_DRY_RUN
  value: {{ .Values.dryRun | quote }}
- name: SHARED_SVC_LEADER_ELECTION
  value: {{ $le.enabled | quote }}
{{- if $le.enabled }}
- name: SHARED_SVC_LEASE_NAME
  value: {{ $le.leaseName | quote }}
- name: SHARED_SVC_LEASE_DURATION_SECONDS
  value: {{ $le.leaseDurationSeconds | quote }}
- name: SHARED_SVC_RENEW_DEADLINE_SECONDS
  value: {{ $le.renewDeadlineSeconds | quote }}
- name: SHARED_SVC_RETRY_PERIOD_SECONDS
  value: {{ $le.retryPeriodSeconds | quote }}
{{- end }}
{{- if include "shared-svc.webhookServing" . }}
- name: SHARED_SVC_WEBHOOK_PORT
  value: {{ .Values.admission.webhook.port | quote }}
- name: SHARED_SVC_WEBHOOK_CERT_FILE
  value: /etc/shared-svc/webhook/tls.crt
- name: SHARED_SVC_WEBHOOK_KEY_FILE
  value: /etc/shared-svc/webhook/tls.key
{{- end }}
- name: SHARED_SVC_OPERATOR_SERVICE_ACCOUNT
  value: {{ .Values.admission.operatorServiceAccount | quote }}
- name: SHARED_SVC_OPERATOR_FIELD_MANAGER
  value: {{ .Values.admission.operatorFieldManager | quote }}
- name: SHARED_SVC_UPGRADE_CONTROLLER
  value: {{ .Values.controllers.upgrade | quote }}
{{- if .Values.controllers.upgrade }}
{{- with .Values.upgrade }}
- name: SHARED_SVC_UPGRADE_DRIVER_NAME
  value: {{ .driverName | quote }}
- name: SHARED_SVC_UPGRADE_CONSUMER_SELECTOR
  value: {{ .consumerSelector | quote }}
- name: SHARED_SVC_UPGRADE_DETECTION
  value: {{ .detection | quote }}
- name: SHARED_SVC_UPGRADE_RUNTIME_CLASSES
  value: {{ .runtimeClasses | toJson | quote }}
- name: SHARED_SVC_UPGRADE_EVICTION_TIMEOUT_SECONDS
  value: {{ .evictionTimeoutSeconds | quote }}
- name: SHARED_SVC_UPGRADE_DELETE_AFTER_TIMEOUT
  value: {{ .deleteAfterTimeout | quote }}
- name: SHARED_SVC_UPGRADE_POLL_SECONDS
  value: {{ .pollSeconds | quote }}
- name: SHARED_SVC_UPGRADE_RESYNC_SECONDS
  value: {{ .resyncSeconds | quote }}
- name: SHARED_SVC_UPGRADE_WORKERS
  value: {{ .workers | quote }}
- name: SHARED_SVC_UPGRADE_WRITES_PER_SECOND
  value: {{ .writesPerSecond | quote }}
- name: SHARED_SVC_UPGRADE_WRITES_BURST
  value: {{ .writesBurst | quote }}
{{- end }}
{{- end }}
{{- range $key, $value := .Values.tuning }}
{{- if not (kindIs "invalid" $value) }}
- name: SHARED_SVC_{{ snakecase $key | upper }}
  value: {{ $value | quote }}
{{- end }}
{{- end }}
{{- end -}}
