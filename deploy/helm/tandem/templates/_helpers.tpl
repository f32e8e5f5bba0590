{{/* Names: <release>-<component>. */}}
{{- define "tandem.name" -}}{{ .Release.Name }}-{{ .component }}{{- end -}}

{{- define "tandem.labels" -}}
app.kubernetes.io/name: tandem
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{- define "tandem.selector" -}}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Trainer rank 0's stable DNS name (the StatefulSet's pod 0 behind its headless Service). */}}
{{- define "tandem.trainerHost" -}}{{ .Release.Name }}-trainer-0.{{ .Release.Name }}-trainer{{- end -}}

{{- define "tandem.rolloutList" -}}
{{- $hosts := list -}}
{{- range $i := until (int .Values.rollout.replicas) -}}
{{- $hosts = append $hosts (printf "{host: %s-rollout-%d.%s-rollout, port: %d}" $.Release.Name $i $.Release.Name (int $.Values.ports.rollout)) -}}
{{- end -}}
[{{ join ", " $hosts }}]
{{- end -}}

{{- define "tandem.redisUrl" -}}
{{- if .Values.redis.enabled -}}redis://{{ .Release.Name }}-redis:6379/0{{- else -}}{{ required "redis.externalUrl is required when redis.enabled is false" .Values.redis.externalUrl }}{{- end -}}
{{- end -}}

{{/* The wiring every Tandem service reads: the same list as x-wiring in deploy/docker-compose.yml, with this
release's addresses. $(TANDEM_AUTH_TOKEN) is expanded by Kubernetes from the Secret. */}}
{{- define "tandem.wiring" -}}
- /config/run.yaml
- --run-dir
- /runs/{{ .Values.runName }}
- --set
- services.bind_host=0.0.0.0
- --set
- services.coordinator.host={{ .Release.Name }}-coordinator
- --set
- services.coordinator.port={{ .Values.ports.coordinator }}
- --set
- services.trainer.host={{ include "tandem.trainerHost" . }}
- --set
- services.trainer.port={{ .Values.ports.trainer }}
- --set
- {{ printf "services.rollout=%s" (include "tandem.rolloutList" .) | quote }}
- --set
- services.reward.host={{ .Release.Name }}-reward
- --set
- services.reward.port={{ .Values.ports.reward }}
- --set
- services.auth_token=$(TANDEM_AUTH_TOKEN)
- --set
- redis.url={{ include "tandem.redisUrl" . }}
- --set
- weights.master_addr={{ include "tandem.trainerHost" . }}
- --set
- trainer.num_ranks={{ mul .Values.trainer.nodes .Values.trainer.gpusPerNode }}
- --set
- trainer.checkpoint_dir=/checkpoints
- --set
- weights.transport={{ .Values.weights.transport }}
- --set
- tracing.exporter={{ .Values.tracing.exporter }}
{{- if .Values.secrets.tls.cert }}
- --set
- services.tls_cert=/tls/tls.crt
- --set
- services.tls_key=/tls/tls.key
- --set
- services.tls_ca=/tls/ca.crt
{{- end }}
{{- end -}}

{{- define "tandem.secretName" -}}{{ default (printf "%s-secrets" .Release.Name) .Values.secrets.existingSecret }}{{- end -}}

{{/* Environment of every Tandem container (the compose file's x-tandem environment). */}}
{{- define "tandem.env" -}}
- name: HF_HUB_OFFLINE
  value: "1"
- name: TOKENIZERS_PARALLELISM
  value: "false"
- name: CUDA_DEVICE_ORDER
  value: PCI_BUS_ID
{{- range $k, $v := .Values.ncclEnv }}
- name: {{ $k }}
  value: {{ $v | quote }}
{{- end }}
{{- with .Values.tracing.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
{{- end }}
- name: POD_INDEX
  valueFrom:
    fieldRef:
      fieldPath: metadata.labels['apps.kubernetes.io/pod-index']
- name: TANDEM_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "tandem.secretName" . }}
      key: auth-token
{{- end -}}

{{- define "tandem.claim" -}}
{{- $p := index .root.Values.persistence .name -}}
{{ default (printf "%s-%s" .root.Release.Name .name) $p.existingClaim }}
{{- end -}}

{{- define "tandem.volumes" -}}
- name: config
  configMap:
    name: {{ .Release.Name }}-config
- name: models
  persistentVolumeClaim:
    claimName: {{ include "tandem.claim" (dict "root" . "name" "models") }}
- name: checkpoints
  persistentVolumeClaim:
    claimName: {{ include "tandem.claim" (dict "root" . "name" "checkpoints") }}
- name: runs
  persistentVolumeClaim:
    claimName: {{ include "tandem.claim" (dict "root" . "name" "runs") }}
{{- with .Values.persistence.data.existingClaim }}
- name: data
  persistentVolumeClaim:
    claimName: {{ . }}
    readOnly: true
{{- end }}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shmSize }}
{{- if .Values.secrets.tls.cert }}
- name: tls
  secret:
    secretName: {{ include "tandem.secretName" . }}
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
      - {key: ca.crt, path: ca.crt}
{{- end }}
{{- end -}}

{{- define "tandem.mounts" -}}
- {name: config, mountPath: /config, readOnly: true}
- {name: models, mountPath: /models}
- {name: checkpoints, mountPath: /checkpoints}
- {name: runs, mountPath: /runs}
{{- if .Values.persistence.data.existingClaim }}
- {name: data, mountPath: /data, readOnly: true}
{{- end }}
- {name: shm, mountPath: /dev/shm}
{{- if .Values.secrets.tls.cert }}
- {name: tls, mountPath: /tls, readOnly: true}
{{- end }}
{{- end -}}

{{/* gRPC health probes: the compose health check's command (services.rpc.healthcheck); a long start-up probe
lets a large model load, SERVING ends it at once. */}}
{{- define "tandem.probes" -}}
{{- $cmd := list "python" "-m" "services.rpc.healthcheck" (printf "127.0.0.1:%d" (int .port)) -}}
startupProbe:
  exec: {command: {{ toJson $cmd }}}
  periodSeconds: {{ .root.Values.probes.periodSeconds }}
  timeoutSeconds: 5
  failureThreshold: {{ .root.Values.probes.startupFailureThreshold }}
livenessProbe:
  exec: {command: {{ toJson $cmd }}}
  periodSeconds: {{ .root.Values.probes.periodSeconds }}
  timeoutSeconds: 5
  failureThreshold: {{ .root.Values.probes.livenessFailureThreshold }}
readinessProbe:
  exec: {command: {{ toJson $cmd }}}
  periodSeconds: {{ .root.Values.probes.periodSeconds }}
  timeoutSeconds: 5
{{- end -}}

{{- define "tandem.podSecurity" -}}
securityContext:
  runAsUser: 1000            # the image's `tandem` user
  runAsGroup: 1000
  runAsNonRoot: true
  fsGroup: 1000
{{- with .Values.imagePullSecrets }}
imagePullSecrets: {{ toJson . }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector: {{ toJson . }}
{{- end }}
{{- with .Values.tolerations }}
tolerations: {{ toJson . }}
{{- end }}
{{- with .Values.affinity }}
affinity: {{ toJson . }}
{{- end }}
{{- end -}}

{{- define "tandem.image" -}}{{ .Values.image.repository }}:{{ .Values.image.tag }}{{- end -}}

{{/* Waits for the init Job's model (pods of trainer and rollout start together with it). */}}
{{- define "tandem.waitForModel" -}}
{{- if .Values.init.enabled }}
initContainers:
  - name: wait-for-model
    image: {{ include "tandem.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command: [sh, -c, {{ printf "until test -f %s/config.json; do sleep 2; done" .Values.init.modelPath | quote }}]
    volumeMounts:
      - {name: models, mountPath: /models}
{{- end }}
{{- end -}}

{{- define "tandem.gpuResources" -}}
{{- $res := deepCopy (default dict .resources) -}}
{{- if gt (int .gpus) 0 -}}
{{- $limits := merge (default dict $res.limits) (dict "nvidia.com/gpu" (int .gpus)) -}}
{{- $_ := set $res "limits" $limits -}}
{{- end -}}
{{ toJson $res }}
{{- end -}}
