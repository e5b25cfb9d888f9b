{{- define "machgen.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "machgen.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "machgen.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: triton
{{- end -}}

{{- define "machgen.image" -}}
{{- if not .Values.image.repository -}}
{{- fail "image.repository is required: an image with Triton and machgen (deploy/docker/Dockerfile)" -}}
{{- end -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "machgen.terminationGrace" -}}
{{- add .Values.serve.drainTimeoutSeconds .Values.serve.preStopSeconds 60 -}}
{{- end -}}

{{- /* GPUs per pod: `gpus`, or the ranks of the repository's parallel layout (their product) when more. */ -}}
{{- define "machgen.gpus" -}}
{{- $gpus := int .Values.gpus -}}
{{- if .Values.parallelLayout -}}
{{- $ranks := 1 -}}
{{- range splitList "," .Values.parallelLayout -}}
{{- $degree := trim (last (splitList "=" .)) -}}
{{- if not (regexMatch "^[1-9][0-9]*$" $degree) -}}
{{- fail (printf "parallelLayout %q: expected AXIS=DEGREE, comma separated (machgen-build --parallel)" $.Values.parallelLayout) -}}
{{- end -}}
{{- $ranks = mul $ranks (int $degree) -}}
{{- end -}}
{{- $gpus = max $gpus $ranks -}}
{{- end -}}
{{- $gpus -}}
{{- end -}}
