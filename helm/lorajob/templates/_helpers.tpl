{{/* Name of the chart's objects: the release name, with the chart name appended unless it is already in it. */}}
{{- define "lorajob.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "lorajob.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "lorajob.labels" -}}
{{ include "lorajob.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "lorajob.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "lorajob.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "lorajob.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The fine-tuning API server (api.*): its objects' name, and its pods' labels, which the operator's selector
(lorajob.selectorLabels) must not match. */}}
{{- define "lorajob.api.fullname" -}}
{{- printf "%s-api" (include "lorajob.fullname" .) -}}
{{- end -}}

{{- define "lorajob.api.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}-api
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "lorajob.api.labels" -}}
{{ include "lorajob.labels" . }}
app.kubernetes.io/component: api
{{- end -}}

{{- define "lorajob.api.serviceAccountName" -}}
{{- if .Values.api.serviceAccount.create -}}
{{- default (include "lorajob.api.fullname" .) .Values.api.serviceAccount.name -}}
{{- else -}}
{{- required "api.serviceAccount.name is required when api.serviceAccount.create is false" .Values.api.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The server's config file (operator/lorajob_operator/openai_api/config.py, ServerConfig): the ConfigMap's
config.yaml, and the checksum on the pods that rolls them when it changes. */}}
{{- define "lorajob.api.config" -}}
{{- toYaml .Values.api.config -}}
{{- end -}}
