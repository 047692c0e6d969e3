variable "project_id" {
  description = "GCP project of the bucket, the service account and the GKE cluster (Workload Identity pool <project>.svc.id.goog)."
  type        = string
}

variable "bucket_name" {
  description = "Name of the GCS bucket that holds the checkpoints (globally unique)."
  type        = string
}

variable "location" {
  description = "Bucket location: the GKE cluster's region (e.g. \"us-central1\") keeps checkpoint traffic regional and free of egress charges."
  type        = string
}

variable "checkpoint_prefix" {
  description = "Object prefix the training jobs write under, ending in '/' (e.g. \"checkpoints/\"); age-based deletion applies below it only."
  type        = string
  default     = "checkpoints/"
}

variable "versioning_enabled" {
  description = "Keep noncurrent object versions. Off by default for the reasons given for S3 (README.md): cloudckpt writes create-only (ifGenerationMatch=0) and never overwrites, and deleted checkpoints would keep costing their size."
  type        = bool
  default     = false
}

variable "soft_delete_retention_seconds" {
  description = "GCS soft delete keeps deleted objects restorable (and billed) this long. 0 (default) turns it off, as versioning: cloudckpt gc deletes whole checkpoints on purpose. Set e.g. 604800 (7 days) to guard against accidental deletion."
  type        = number
  default     = 0
}

variable "abort_incomplete_multipart_upload_days" {
  description = "Days after which XML-API multipart uploads left open are aborted (gcsfs itself uses resumable uploads, which GCS expires after a week)."
  type        = number
  default     = 1
}

variable "delete_checkpoints_after_days" {
  description = "Optional: delete objects under checkpoint_prefix this many days after they were written. null (default): keep them; prune with `cloudckpt gc --keep-last N`."
  type        = number
  default     = null
}

variable "kms_key_name" {
  description = "Optional Cloud KMS key for CMEK default encryption (null: Google-managed encryption)."
  type        = string
  default     = null
}

variable "log_bucket" {
  description = "Optional: bucket receiving usage logs (null: none)."
  type        = string
  default     = null
}

variable "force_destroy" {
  description = "Allow `terraform destroy` to delete a bucket that still holds checkpoints."
  type        = bool
  default     = false
}

variable "service_account_id" {
  description = "Account id of the Google service account the training pods act as."
  type        = string
  default     = "cloudckpt-trainer"
}

variable "use_custom_role" {
  description = "Grant a custom role with exactly the permissions cloudckpt uses (storage.objects.create, delete, get, list) instead of roles/storage.objectAdmin."
  type        = bool
  default     = true
}

variable "custom_role_id" {
  description = "Id of the custom project role (with use_custom_role)."
  type        = string
  default     = "cloudckptCheckpointWriter"
}

variable "namespace" {
  description = "Kubernetes namespace of the training job's service account."
  type        = string
  default     = "ml-training"
}

variable "kubernetes_service_account" {
  description = "Kubernetes service account the training pods run as."
  type        = string
  default     = "cloudckpt-trainer"
}

variable "labels" {
  description = "Labels for the bucket."
  type        = map(string)
  default     = {}
}
