variable "bucket_name" {
  description = "Name of the S3 bucket that holds the checkpoints (globally unique)."
  type        = string
}

variable "checkpoint_prefix" {
  description = "Key prefix the training jobs write under, without a leading slash and ending in '/' (e.g. \"checkpoints/\"). The IAM policy grants access below it only; run URIs are s3://<bucket>/<prefix><run>."
  type        = string
  default     = "checkpoints/"

  validation {
    condition     = can(regex("^[^/].*/$", var.checkpoint_prefix))
    error_message = "checkpoint_prefix must not start with '/' and must end with '/'."
  }
}

variable "kms_key_arn" {
  description = "ARN of a customer-managed KMS key for SSE-KMS (with an S3 bucket key). null: SSE-S3 (AES256), no KMS permissions needed."
  type        = string
  default     = null
}

variable "versioning_enabled" {
  description = <<-EOT
    Keep old versions of objects. Off by default: cloudckpt never overwrites an object
    (every write of a save is create-only: If-None-Match: * on the claim, the manifest and
    the commit marker; data objects are written once under a fresh checkpoint prefix), so
    versioning protects only against deletion, and every deleted checkpoint (cloudckpt gc
    / rm, lifecycle expiry) would keep costing its full size as noncurrent versions until
    they expire. Turn it on where accidental deletion by people or other tools is the
    bigger risk; noncurrent versions then expire after noncurrent_version_expiration_days.
  EOT
  type        = bool
  default     = false
}

variable "noncurrent_version_expiration_days" {
  description = "With versioning on: days after which noncurrent (deleted or replaced) versions are removed."
  type        = number
  default     = 7
}

variable "abort_incomplete_multipart_upload_days" {
  description = "Days after which multipart uploads left open (a killed job's unfinished shard uploads) are aborted and their parts deleted. cloudckpt aborts its own failed uploads; this catches those of killed processes."
  type        = number
  default     = 1
}

variable "expire_checkpoints_after_days" {
  description = "Optional: delete objects under checkpoint_prefix this many days after they were written. null (default): keep them; prune with `cloudckpt gc --keep-last N`. Must be far longer than any run (a run's latest checkpoint must never expire while it trains)."
  type        = number
  default     = null
}

variable "access_log_bucket" {
  description = "Optional: bucket receiving S3 server access logs (null: no access logging)."
  type        = string
  default     = null
}

variable "force_destroy" {
  description = "Allow `terraform destroy` to delete a bucket that still holds checkpoints."
  type        = bool
  default     = false
}

variable "create_irsa_role" {
  description = "Create an IAM role for EKS IRSA that the training pods' service account assumes."
  type        = bool
  default     = true
}

variable "oidc_provider_arn" {
  description = "ARN of the EKS cluster's IAM OIDC provider (aws_iam_openid_connect_provider); required with create_irsa_role."
  type        = string
  default     = null
}

variable "oidc_provider_url" {
  description = "The EKS cluster's OIDC issuer URL (https://oidc.eks.<region>.amazonaws.com/id/<id>); required with create_irsa_role."
  type        = string
  default     = null
}

variable "namespace" {
  description = "Kubernetes namespace of the training job's service account."
  type        = string
  default     = "ml-training"
}

variable "service_account" {
  description = "Kubernetes service account the training pods run as."
  type        = string
  default     = "cloudckpt-trainer"
}

variable "role_name" {
  description = "Name of the IRSA role and prefix of the IAM policy's name."
  type        = string
  default     = "cloudckpt-trainer"
}

variable "tags" {
  description = "Tags for every resource."
  type        = map(string)
  default     = {}
}
